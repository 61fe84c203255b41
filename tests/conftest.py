"""Shared fixtures: tiny HF models built once per session, markers, distributed launch helper."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import warm_torchrun

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # a command starting so goes to the warm server
# Multi-rank runs whose subject is not the engine layout share one engine (rollout.engines=1): it samples what an
# engine per data-parallel rank samples (seeds and shards depend only on the step and the data-parallel rank;
# same metrics, checked on the default 3-step run) and spares an engine's two processes, about a fifth of a short
# 2-rank run's CPU time.
ONE_ENGINE = "rollout.engines=1"

# Tiny models used across the suite: name -> tiny_model CLI arguments.
TINY = {
    "qwen3_moe": ["--arch", "qwen3_moe", "--dense-layers", "1"],
    "mixtral": ["--arch", "mixtral"],
    "olmoe": ["--arch", "olmoe"],
    # layer 0 dense (first_k_dense_replace=1), 2 groups of 4 experts, 1 kept, shared expert, gate scale 2.5
    "glm4_moe": ["--arch", "glm4_moe"],
    # the same router with multi-latent attention (q LoRA 64, latent 512 + rope 64, as vLLM's CPU MLA needs)
    # and, as released checkpoints have, a multi-token-prediction layer 4 that nothing may load or capture
    "deepseek_v3": ["--arch", "deepseek_v3", "--mtp-layers", "1"],
    # sinks, biases, clamped SwiGLU, YaRN, sliding window of 8 keys on layers 0 and 2 (sequences of 16 pass it)
    "gpt_oss": ["--arch", "gpt_oss"],
    "qwen3_moe_tied": ["--arch", "qwen3_moe", "--dense-layers", "1", "--tie-embeddings"],
    "qwen3_moe_320e": [
        "--arch",
        "qwen3_moe",
        "--num-experts",
        "320",
        "--topk",
        "4",
        "--layers",
        "2",
        "--moe-intermediate",
        "16",
    ],
}


TIMING = ("time/", "memory/", "perf/tokens_per_s", "weight_sync/seconds", "weight_sync/gb_per_s")
"""The metrics of the machine, not of the run: wall-clock times, memory, throughput."""


def untimed(metrics: dict) -> dict:
    """A step's metrics without the machine's (TIMING), which differ between runs that train alike."""
    return {k: v for k, v in metrics.items() if not k.startswith(TIMING)}


def pytest_configure(config):
    for name, doc in {
        "distributed": "multi-process torchrun/gloo runs",
        "engine": "starts a vLLM engine",
        "e2e": "end-to-end training runs",
        "kernels": "Triton kernels under the interpreter",
        "slow": "takes more than ~30 s",
        "faults": "fault injection (kill -9, damaged checkpoints)",
        "isolated": "looks at machine-wide processes, /dev/shm or sockets: launch/test.sh runs it alone",
        "gpu": "needs CUDA (skipped without it; run on a GPU machine, docs/performance.md)",
    }.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    # megatron-core and vLLM deprecation chatter is not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Build every tiny model once per session (seconds)."""
    from moe_rl.tools.tiny_model import main

    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for name, args in TINY.items():
        main([*args, "--out", str(root / name), "--seed", "7"])
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def world1():
    """A gloo world of 1 with megatron-core parallel state (re-initialised by each build)."""
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import init_distributed

    init_distributed(ParallelConfig())
    yield


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for a launch that binds it later (a rendezvous, a daemon):
    listeners bound to port 0 and outgoing connections, which other tests and daemons open in the meantime, take
    ephemeral ports, and one of them could otherwise be this one."""
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.is_file() else 32768
    below = range(10000, low)
    for port in random.Random().sample(below, min(200, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # none free below the range: any free port
        s.bind(("", 0))
        return s.getsockname()[1]


def run_job(cmd: list[str], timeout: int = 600, env: dict | None = None) -> str:
    """Run a (multi-process) command from the repo root in its own session; fail with its log.

    Output goes to a file, not a pipe, and the whole session is killed afterwards: a process
    orphaned by a crashed rank (e.g. a vLLM engine core) can neither hang the test nor linger.
    A `python ...` command runs forked from this process's warm server (`launch`).
    """
    code, out = launch(cmd, timeout, env)
    if code != 0:
        status = "timed out" if code is None else f"failed ({code})"
        pytest.fail(f"{' '.join(cmd)} {status}:\n{out[-10000:]}")
    return out


def launch(cmd: list[str], timeout: int = 600, env: dict | None = None) -> tuple[int | None, str]:
    """(exit code or None when it ran past `timeout`, output) of a command run from the repo root in its own session
    (see run_job). `python -m torch.distributed.run ...`, `python script.py ...` and `python -m module ...` run forked
    from this process's warm server (tests/warm_torchrun.py) unless MOE_RL_TEST_WARM_LAUNCH=0."""
    env = dict(job_env(), **(env or {}))
    python = cmd[0] == sys.executable and len(cmd) > 1 and (cmd[1] == "-m" or cmd[1].endswith(".py"))
    if python and warm_torchrun.enabled():
        torchrun = cmd[:3] == TORCHRUN
        with tempfile.NamedTemporaryFile(mode="w+") as log:
            code = _warm_server().run(cmd[3:] if torchrun else cmd[1:], REPO, env, log.name, timeout, not torchrun)
            return code, log.read()
    return _run_in_session(cmd, env, timeout)


def job_env() -> dict[str, str]:
    # A world-1 fixture in this process set MASTER_ADDR/PORT; a child must pick its own port.
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    return dict(inherited, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")


def preempt(cmd: list[str], run_dir: Path, log: Path, *, to_group: bool, timeout: int = 600) -> tuple[str, int]:
    """Start `cmd` (a real launch from the repo root, in its own session, output in `log`), wait until the run
    logged its first record (run_dir/metrics.jsonl), send SIGTERM (to the whole process group as Slurm's scancel
    does, or to the launcher alone, which forwards it) and wait for the exit; whatever is left is killed. Returns
    the output and the step of the checkpoint the run saved when the signal stopped it."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=job_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.time() + timeout
            while not (run_dir / "metrics.jsonl").is_file() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.1)
            assert proc.poll() is None, log.read_text()[-5000:]
            if to_group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                os.kill(proc.pid, signal.SIGTERM)
            proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text()
    assert "stopped by a signal after saving a checkpoint" in text, text[-5000:]
    return text, int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step_"))


_WARM: list[warm_torchrun.Server] = []


def _warm_server() -> warm_torchrun.Server:
    """This pytest process's warm torchrun server (tests/warm_torchrun.py), started at its first launch."""
    if not _WARM:
        _WARM.append(warm_torchrun.Server(job_env(), Path(tempfile.mkdtemp(prefix="moe-rl-warm-"))))
    return _WARM[0]


def pytest_sessionfinish(session, exitstatus):
    for server in _WARM:
        server.close()


def _run_in_session(cmd: list[str], env: dict[str, str], timeout: int) -> tuple[int | None, str]:
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        log.seek(0)
        return code, log.read()


def torchrun(module: str, nproc: int, args: list[str], timeout: int = 600) -> str:
    """Run `torchrun --nproc-per-node=nproc -m module args`; returns its output."""
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "--standalone", "-m", module]
    return run_job([*cmd, *args], timeout=timeout)


def grouped_launches(module: str, root: Path, jobs: dict[str, tuple[int, list[str]]], timeout: int = 1800):
    """`get(name)` makes sure job `name` (world size, worker arguments that write to `root / name`) has run and
    returns that folder. The jobs of one world size run together in one torchrun launch of `module`
    (tests/distributed/jobs.py) when the first of them is asked for; a failed launch fails each of its jobs with
    its output."""
    outcome: dict[int, str | None] = {}

    def get(name: str) -> Path:
        nproc = jobs[name][0]
        if nproc not in outcome:
            spec = Path(root) / f"jobs_world{nproc}.json"
            spec.write_text(json.dumps([argv for world, argv in jobs.values() if world == nproc]))
            try:
                torchrun("tests.distributed.jobs", nproc, [module, str(spec)], timeout=timeout)
                outcome[nproc] = None
            except pytest.fail.Exception as e:
                outcome[nproc] = str(e)
        if outcome[nproc] is not None:
            pytest.fail(f"the world-{nproc} launch of {module} failed: {outcome[nproc]}", pytrace=False)
        return Path(root) / name

    return get


def read_json_results(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
