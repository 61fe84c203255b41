"""torchrun launches for the test suite from a process that has imported torch, megatron-core, vLLM and
transformers once, so that a launch's agent and ranks are forked from it instead of importing them again; and
plain `python script args` / `python -m module args` launches (world-1 runs of the trainers and tools), forked
from it as well.

Imports are about half of a short launch's CPU time (a 2-rank, 3-step run: 46 CPU-s fresh, 26 forked from here;
`python bench/launch_cpu.py --warm`, docs/performance.md), and the suite starts about 60 launches on 2 cores. Here
the launch is torch's own: `torch.distributed.run.main` parses the same command line, runs the same elastic agent,
rendezvous and rank environment; only the agent and its ranks start as forks of this server (torch's
`start_method=fork` for a function entrypoint, which then runs the script or module as `__main__`, as torchrun's
fresh interpreter would). The real command line still runs where the subject is the process itself: the fault, Slurm
and signal tests, `tests/e2e/test_train_moe.py`'s SIGTERM run.

`MOE_RL_TEST_WARM_LAUNCH=0` runs every launch through a fresh `python -m torch.distributed.run` instead.

    python -m tests.warm_torchrun serve SOCKET    # what tests/conftest.run_job starts once per pytest process
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
from pathlib import Path

# What a rank imports, so that a forked rank finds it imported (moe-rl's own modules import these lazily).
PRELOAD = (
    "torch",
    "torch.distributed.run",
    "hydra",
    "omegaconf",
    "transformers",
    "wandb",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.dist_checkpointing",
    "vllm",
    "vllm.v1.engine.core",
    "moe_rl.config",
    "moe_rl.trainer.loop",
    "moe_rl.actor.actor",
    "moe_rl.rollout.engine",
)


def enabled() -> bool:
    return os.environ.get("MOE_RL_TEST_WARM_LAUNCH", "1") != "0"


# ----------------------------------------------------------------------------------------------- the ranks


def _run_main(cmd_args: list[str]) -> None:
    """Run `script args` or `-m module args` (what follows `python`) as `__main__`, as a fresh interpreter would."""
    args = [a for a in cmd_args if a != "-u"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(args[0])
        sys.argv = [args[0], *args[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def _rank(*cmd_args: str) -> None:
    """A forked rank: run the script (or `-m module`) as `__main__`, as torchrun's `python -u ...` would."""
    import torch.multiprocessing

    from moe_rl.trainer import signals as rank_signals

    torch.multiprocessing._set_thread_name("python")  # the agent named its thread pt_elastic; a rank is "python"

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # the agent's handlers, inherited by the fork
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # multiprocessing ends this process itself once torch's wrapper has reported the return value: the rank ends
    # as run_then_exit ends it (threads joined, atexit handlers run, output flushed), less the os._exit
    rank_signals.run_then_exit = functools.partial(rank_signals.run_then_exit, end=_end_by_returning)
    _run_main(list(cmd_args))


def _end_by_returning(code: int) -> None:
    if code:
        raise SystemExit(code)  # multiprocessing exits with it; the agent sees a failed rank, as torchrun does


def _fork_launch(config, entrypoint):
    """Stands in for torch.distributed.run's `elastic_launch` in a launch's process: the same config, with the
    command (`python -u script args`) run by forked ranks."""
    from torch.distributed.launcher.api import elastic_launch

    config.start_method = "fork"
    return lambda *cmd_args: elastic_launch(config, _rank)(*cmd_args)


def _launch(request: dict) -> None:
    """The forked launch process: torchrun's main (or, for a `python` request, the script or module itself) in the
    request's folder, environment and log; never returns."""
    os.setsid()  # the client kills the whole session afterwards, as run_job does
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    code = 1
    try:
        if request.get("python"):
            _run_main(request["argv"])  # a program that ends itself (run_then_exit) never comes back here
        else:
            import torch.distributed.run as torchrun

            torchrun.elastic_launch = _fork_launch
            sys.argv = ["torchrun", *request["argv"]]
            torchrun.main(request["argv"])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # torchrun prints a failed rank's error itself; anything else is printed here
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ----------------------------------------------------------------------------------------------- the server


def serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(5)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            if os.getppid() != parent:  # its pytest process is gone (killed): so is the server
                os._exit(0)
            continue
        conn.settimeout(None)
        with conn:
            request = json.loads(conn.makefile().readline())
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                _launch(request)
            conn.sendall(f"{pid}\n".encode())
            _, status = os.waitpid(pid, 0)
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


# ----------------------------------------------------------------------------------------------- the client


def _read_line(conn: socket.socket) -> str:
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise RuntimeError("the warm torchrun server closed the connection (see its log)")
        line += chunk
    return line.decode()


class Server:
    """One server per pytest process, started at its first launch (its imports take as long as one rank's)."""

    def __init__(self, env: dict[str, str], workdir: Path):
        self.path = str(workdir / "warm_torchrun.sock")
        self.log = open(workdir / "warm_torchrun.log", "w")  # noqa: SIM115 (open for the server's lifetime)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_torchrun", "serve", self.path],
            cwd=Path(__file__).resolve().parents[1],
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the warm torchrun server did not start: see {workdir / 'warm_torchrun.log'}")

    def run(
        self, argv: list[str], cwd: Path, env: dict[str, str], log: str, timeout: float, python: bool = False
    ) -> int | None:
        """`torchrun argv` (`python`: `python argv`) forked from the server; its exit code, or None when it ran past
        timeout (killed)."""
        request = {"argv": argv, "cwd": str(cwd), "env": env, "log": log, "python": python}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            conn.sendall((json.dumps(request) + "\n").encode())
            pid = int(_read_line(conn))
            conn.settimeout(timeout)
            try:
                code: int | None = int(_read_line(conn))
            except TimeoutError:
                code = None
            try:
                os.killpg(pid, signal.SIGKILL)  # whatever the launch left in its session
            except (ProcessLookupError, PermissionError):
                pass
            if code is None:
                conn.settimeout(60)
                _read_line(conn)  # the server has reaped it
            return code

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        if os.path.exists(self.path):
            os.unlink(self.path)


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"] or len(sys.argv) != 3:
        raise SystemExit(__doc__)
    serve(sys.argv[2])
