"""The sandbox for untrusted programs (moe_rl/sandbox, issue 80): real bubblewrap runs of ordinary and hostile
programs. Each hostile run ends within its limit + 2 s, the host is unharmed and nothing is left behind: no process
of the run's uid, no cgroup, no file of its /tmp on the host. Every program here is run only through run_program
(or the pool / the command line, which call it): never in this process or a plain subprocess."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.sandbox import Job, Limits, SandboxConfig, SandboxPool, SandboxUnavailable, check_available, run_program
from moe_rl.sandbox import pool as pool_module
from moe_rl.sandbox.runner import RunResult
from moe_rl.sandbox.slots import PIDS_CGROUP, uid_processes

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed here")


def run(source: str, limits: Limits = Limits(wall_s=5.0, cpu_s=5.0), **kw) -> RunResult:
    """run_program, then the checks every run must pass: within its wall limit + 2 s, nothing left behind."""
    result = run_program(source, limits=limits, **kw)
    assert result.seconds <= limits.wall_s + 2.0, result
    assert_nothing_left(result)
    print(f"\n[sandbox] {result.status} in {result.seconds:.2f} s (wall limit {limits.wall_s:g} s)")
    return result


def assert_nothing_left(result: RunResult) -> None:
    assert uid_processes(result.uid) == [], f"processes of uid {result.uid} remain"
    assert not list((PIDS_CGROUP / "moe-rl-sandbox").glob(f"{result.uid}-*")), "the run's cgroup remains"


def out(result: RunResult) -> str:
    return result.stdout.decode()


# --- ordinary programs ---


def test_exit_statuses_map_to_passed_failed_oom_crashed():
    ok = run("print('hello')")
    assert (ok.status, ok.exit_code, ok.stdout, ok.signal) == ("passed", 0, b"hello\n", None)
    assert ok.stdout_bytes == ok.stdout_total == 6
    exits = run("import sys; sys.exit(3)")
    assert (exits.status, exits.exit_code) == ("failed", 3)
    raised = run("def f():\n    raise ValueError('bad')\nf()")
    assert (raised.status, raised.exit_code) == ("failed", 1) and b"ValueError: bad" in raised.stderr
    syntax = run("def f(:\n")
    assert syntax.status == "failed" and b"SyntaxError" in syntax.stderr
    oom = run("x = bytearray(8 * 2**30)")
    assert (oom.status, oom.exit_code) == ("oom", 1) and oom.stderr.rstrip().endswith(b"MemoryError")
    caught = run("try:\n    x = bytearray(8 * 2**30)\nexcept MemoryError:\n    raise KeyError('after')")
    assert caught.status == "failed"  # the last traceback line decides: a KeyError
    segv = run("import os; os.kill(os.getpid(), 11)")
    assert (segv.status, segv.exit_code, segv.signal) == ("crashed", None, signal.SIGSEGV)
    assert ok.as_json().keys() >= {"status", "exit_code", "seconds", "stdout_bytes"}


def test_stdin_and_files_reach_the_program_in_its_private_folder():
    source = (
        "import os, sys, json\n"
        "data = sys.stdin.read()\n"
        "open('made.txt', 'w').write('mine')\n"
        "print(json.dumps({'stdin': data, 'cwd': os.getcwd(), 'helper': open('pkg/helper.py').read(),\n"
        "                  'made': open('/tmp/made.txt').read(), 'uid': os.getuid()}))\n"
        "import pkg.helper\n"
    )
    result = run(source, stdin=b"line 1\nline 2\n", files={"pkg/helper.py": "X = 1\n", "pkg/__init__.py": ""})
    assert result.status == "passed", result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"stdin": "line 1\nline 2\n", "cwd": "/tmp", "helper": "X = 1\n", "made": "mine", "uid": result.uid}
    assert result.uid >= 61000
    with pytest.raises(ValueError, match="relative path"):
        run_program("pass", files={"../x.py": ""})


def test_the_private_folder_is_gone_after_the_run():
    name = f"moe-rl-sandbox-marker-{uuid.uuid4().hex}"
    first = run(f"open('/tmp/{name}', 'w').write('x'); open('{name}.2', 'w').write('y'); print('ok')")
    assert first.status == "passed", first.stderr
    assert not Path("/tmp", name).exists() and not list(Path("/tmp").glob(f"**/{name}*"))
    again = run(f"import os; print(os.path.exists('/tmp/{name}'), sorted(os.listdir('/tmp')))")
    assert out(again) == "False ['main.py']\n"  # a new run starts from an empty folder


# --- hostile programs ---


def test_files_of_the_project_and_the_home_folder_are_not_there(tmp_path):
    marker = Path.home() / f".moe-rl-sandbox-test-{uuid.uuid4().hex}"
    marker.write_text("secret")
    try:
        paths = [str(REPO / "setup.py"), "/work/main/setup.py", str(marker), str(Path(sys.executable)), "/etc/passwd"]
        source = (
            "import json\nout = {}\n"
            f"for p in {paths!r}:\n"
            "    try:\n        open(p).read(); out[p] = 'read'\n"
            "    except OSError as e:\n        out[p] = type(e).__name__\n"
            "import os\nout['/'] = sorted(os.listdir('/'))\nprint(json.dumps(out))\n"
        )
        result = run(source)
    finally:
        marker.unlink()
    seen = json.loads(result.stdout)
    assert {seen[p] for p in paths} <= {"FileNotFoundError", "PermissionError"}, seen
    assert seen["/"] == ["bin", "dev", "lib", "lib64", "proc", "sbin", "tmp", "usr"]


def test_writes_outside_the_private_folder_fail():
    targets = ["/usr/moe-rl-sandbox-x", "/x", "/etc/x", "/proc/sys/kernel/hostname", "/usr/local/x"]
    source = (
        "import json\nout = {}\n"
        f"for p in {targets!r}:\n"
        "    try:\n        open(p, 'w').write('x'); out[p] = 'wrote'\n"
        "    except OSError as e:\n        out[p] = type(e).__name__\n"
        "print(json.dumps(out))\n"
    )
    seen = json.loads(run(source).stdout)
    assert "wrote" not in seen.values(), seen
    assert not Path("/usr/moe-rl-sandbox-x").exists()


def test_no_network_not_even_the_hosts_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        source = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__)\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=2); print('out')\n"
            "except OSError as e:\n    print(type(e).__name__)\n"
        )
        result = run(source)
        with pytest.raises(TimeoutError):
            server.accept()  # nothing reached the host's server
    finally:
        server.close()
    assert out(result) == "ConnectionRefusedError\nOSError\n", out(result)


def test_a_fork_bomb_is_bounded_and_leaves_no_process():
    limits = Limits(wall_s=1.0, cpu_s=5.0, processes=16)
    source = (
        "import os, sys, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n            time.sleep(100)\n"
        "        n += 1\n"
        "except OSError:\n    pass\n"
        "print(n, flush=True)\n"
        "while True:\n"  # then the bomb proper: every process forks for ever
        "    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    result = run(source, limits)
    assert result.status == "timeout" and result.cgroup
    assert 1 <= int(result.stdout.split()[0]) < limits.processes


def test_allocating_ten_times_the_memory_limit_is_oom():
    limits = Limits(wall_s=5.0, cpu_s=5.0, memory_mib=128)
    at_once = run("x = bytearray(1280 * 2**20)", limits)
    piece_by_piece = run("chunks = []\nwhile len(chunks) < 1280:\n    chunks.append(bytearray(2**20))", limits)
    assert at_once.status == piece_by_piece.status == "oom", piece_by_piece.stderr[-300:]


def test_an_infinite_loop_times_out_at_the_wall_and_at_the_cpu_limit():
    wall = run("while True:\n    pass", Limits(wall_s=1.0, cpu_s=30.0))
    assert (wall.status, wall.signal) == ("timeout", signal.SIGKILL) and wall.seconds >= 1.0
    cpu = run("while True:\n    pass", Limits(wall_s=6.0, cpu_s=1.0))
    assert (cpu.status, cpu.signal) == ("timeout", signal.SIGXCPU) and cpu.seconds < 4.0
    source = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    ignores = run(source, Limits(wall_s=6.0, cpu_s=1.0))  # RLIMIT_CPU's hard limit, a second later: SIGKILL
    assert (ignores.status, ignores.signal) == ("timeout", signal.SIGKILL) and ignores.seconds < 5.0


def test_a_child_that_ignores_sigterm_and_outlives_its_parent_is_gone():
    source = (
        "import os, signal, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "        signal.signal(signal.SIGHUP, signal.SIG_IGN)\n"
        "        time.sleep(1000)\n"
        "    os._exit(0)\n"
        "time.sleep(0.3)\n"
        "print(len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
    )
    result = run(source)
    assert result.status == "passed" and int(result.stdout) >= 3  # init, itself and the child were there
    assert result.seconds < 2.0  # it ended with its main process: the PID namespace took the child along


def test_kill_minus_one_kills_only_the_sandbox():
    # First prove the program's own PID namespace: it is pid 2 under bwrap's init and sees no other process
    # (the host's, this test's included). Only then run kill(-1): through run_program, never here.
    proof = run(
        "import os, json\n"
        "print(json.dumps({'pid': os.getpid(), 'procs': sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}))"
    )
    seen = json.loads(proof.stdout)
    assert seen == {"pid": 2, "procs": [1, 2]}, seen
    assert os.getpid() not in seen["procs"] and proof.uid != 0
    sentinel = subprocess.Popen(["sleep", "30"])
    try:
        kill_all = (
            "import os, time\n"
            "child = os.fork()\n"
            "if child == 0:\n    time.sleep(100)\n"
            "time.sleep(0.2)\n"
            "os.kill(-1, 9)\n"
            "_, status = os.waitpid(child, 0)\n"
            "print('child killed by', os.WTERMSIG(status), 'and I survived')\n"
        )
        result = run(kill_all)
        assert sentinel.poll() is None, "a host process died"
    finally:
        sentinel.kill()
        sentinel.wait()
    assert result.status == "passed" and out(result) == "child killed by 9 and I survived\n"


def test_printing_a_gigabyte_keeps_the_limit_and_counts_the_rest():
    limits = Limits(wall_s=20.0, cpu_s=20.0, output_bytes=2**20)
    source = "import sys\nb = b'x' * 2**20\nfor _ in range(1024):\n    sys.stdout.buffer.write(b)\n"
    result = run(source, limits)
    assert result.status == "passed"
    assert result.stdout_bytes == len(result.stdout) == 2**20 and result.stdout_total == 2**30


def test_a_program_that_closes_its_output_and_sleeps_ends_at_the_wall_limit():
    result = run("import os, time\nos.close(1)\nos.close(2)\ntime.sleep(100)", Limits(wall_s=1.0, cpu_s=5.0))
    assert result.status == "timeout" and 1.0 <= result.seconds < 2.0


# --- the pool, the settings, the command line, the availability check ---


def test_the_pool_runs_jobs_in_parallel_each_under_its_own_uid():
    limits = Limits(wall_s=1.5, cpu_s=5.0, processes=16)
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    with SandboxPool(2, limits) as pool:
        results = pool.run_many([Job(bomb), Job("import os; print(os.fork() > 0)"), Job("print(input())", b"7\n")])
        assert [r.status for r in results] == ["timeout", "passed", "passed"]  # a fork bomb starves no other run
        assert results[0].uid != results[1].uid and out(results[2]) == "7\n"
        n = 40
        start = time.monotonic()
        trivial = pool.run_many([Job("print(1)")] * n)
        rate = n / (time.monotonic() - start)
    assert {r.status for r in trivial} == {"passed"}
    for r in results + trivial:
        assert_nothing_left(r)
    print(f"\n[sandbox] {rate:.1f} trivial runs/s on a pool of 2")
    assert rate > 2


def test_the_settings_give_the_limits_and_refuse_bad_values(monkeypatch):
    cfg = SandboxConfig(timeout_s=3, cpu_s=2, memory_mib=256, output_mib=1, workers=3)
    assert cfg.limits() == Limits(wall_s=3, cpu_s=2, memory_mib=256, output_bytes=2**20)
    with pytest.raises(ConfigError, match=r"config data\.sandbox\.timeout_s: 0"):
        SandboxConfig(timeout_s=0).check()
    with pytest.raises(ConfigError, match=r"config data\.sandbox\.python: .*/usr"):
        SandboxConfig(python="/root/.pyenv/bin/python").check()
    monkeypatch.setattr(pool_module, "_pool", None)
    monkeypatch.setattr(pool_module, "_config", SandboxConfig())
    pool_module.configure(cfg)
    shared = pool_module.shared_pool()
    assert (shared.workers, shared.limits) == (3, cfg.limits()) and pool_module.shared_pool() is shared
    assert run_program("print(2)", limits=shared.limits).stdout == b"2\n"
    pool_module.configure(SandboxConfig())
    assert pool_module.shared_pool() is not shared and pool_module.shared_pool().workers >= 1
    pool_module.shared_pool().close()


def test_the_command_runs_a_program_and_imports_no_torch(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\nsys.exit(int(sys.argv[0] == 'x'))\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("abc")
    check = (
        "import sys\nfrom moe_rl.sandbox.cli import main\n"
        f"rc = main(['run', {str(program)!r}, '--stdin', {str(stdin)!r}, '--timeout', '5', '--show-output'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'megatron', 'transformers'))\n"
        "print('heavy', heavy)\nsys.exit(rc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=60)
    line, heavy = done.stdout.splitlines()
    assert done.returncode == 0 and heavy == "heavy []", done.stderr
    assert json.loads(line)["status"] == "passed" and json.loads(line)["stdout_bytes"] == 4
    assert "ABC" in done.stderr  # --show-output
    program.write_text("while True:\n    pass\n")
    start = time.monotonic()
    cmd = [sys.executable, "-m", "moe_rl.sandbox.cli", "run", str(program), "--timeout", "1.5"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 1 and json.loads(done.stdout)["status"] == "timeout"
    assert time.monotonic() - start < 1.5 + 2.0  # the limit is the wall time of the whole command
    helped = subprocess.run([*cmd[:4], "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert "examples:" in helped.stdout and "moe-rl-sandbox run solution.py --stdin" in helped.stdout


def test_check_available_names_the_package_when_bwrap_is_missing(tmp_path, monkeypatch):
    check_available()  # here it is installed
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"bwrap.*bubblewrap.*apt-get install bubblewrap.*setup_env\.sh"):
        check_available.__wrapped__()
