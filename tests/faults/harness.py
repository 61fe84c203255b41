"""Fault-injection harness: start a training run in its own session, watch every process it
starts, inject a fault, and report what it left behind (processes, /dev/shm segments, socket
files in the temp folder)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from moe_rl.tools.chaos import alive, remember
from tests.conftest import REPO

TRAIN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "launch/train_moe.py"]
QUIET = ["logging.wandb.mode=disabled", "logging.router_agreement_every=0"]


def leftovers_snapshot() -> set[str]:
    """/dev/shm entries, unix socket files and vLLM's FileStore files (vllm_dist_*) in the temp folder."""
    out = {f"/dev/shm/{n}" for n in os.listdir("/dev/shm")} if os.path.isdir("/dev/shm") else set()
    tmp = Path(tempfile.gettempdir())
    for p in tmp.iterdir():
        try:
            if p.is_socket() or p.name.startswith("vllm_dist_"):
                out.add(str(p))
        except OSError:
            pass
    return out


class Run:
    """`torchrun --nproc-per-node=N launch/train_moe.py` (or another `script`: launch/sft_moe.py, which takes
    `logging.wandb.mode` of QUIET only) in its own session, its processes watched."""

    def __init__(
        self,
        run_dir: Path,
        nproc: int,
        overrides: list[str],
        torchrun_args: tuple[str, ...] = (),
        script: str = "launch/train_moe.py",
    ):
        self.run_dir, self.script = run_dir, script
        self.before = leftovers_snapshot()
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
        env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
        self.log_path = run_dir.parent / f"{run_dir.name}.{len(list(run_dir.parent.glob(run_dir.name + '.*.log')))}.log"
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                *TRAIN[:4],
                f"--nproc-per-node={nproc}",
                *torchrun_args,
                script,
                f"hydra.run.dir={run_dir}",
                *(QUIET if script == TRAIN[4] else QUIET[:1]),
                *overrides,
            ],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.seen: dict[int, psutil.Process] = {}

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def track(self) -> None:
        """Remember every process of the run (torchrun, ranks, engines, reapers)."""
        remember(self.proc.pid, self.seen)
        for p in psutil.process_iter(["cmdline"]):  # reapers live in their own session
            cmd = p.info["cmdline"] or []
            if "moe_rl.rollout.reaper" in cmd and any(str(q) in cmd for q in self.seen):
                self.seen.setdefault(p.pid, p)

    def ranks(self) -> list[psutil.Process]:
        self.track()
        return sorted(
            (
                p
                for p in self.seen.values()
                if alive(p) and self.script in " ".join(p.cmdline()) and p.pid != self.proc.pid
            ),
            key=lambda p: p.pid,
        )

    def engines(self) -> list[psutil.Process]:
        self.track()
        return [p for p in self.seen.values() if alive(p) and any("EngineCore" in x or "VLLM" in x for x in _name(p))]

    def wait_for_steps(self, steps: int, timeout: float = 400) -> None:
        deadline = time.time() + timeout
        metrics = self.run_dir / "metrics.jsonl"
        while time.time() < deadline:
            self.track()
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"run ended ({self.proc.returncode}) before step {steps}:\n{self.output()[-5000:]}"
                )
            time.sleep(0.3)
        raise AssertionError(f"no step {steps} within {timeout} s:\n{self.output()[-5000:]}")

    def wait_gone(self, timeout: float) -> float:
        """Seconds until every process of the run has exited (AssertionError past `timeout`)."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            self.track()
            if not [p for p in self.seen.values() if alive(p)]:
                return time.time() - t0
            time.sleep(0.2)
        left = [f"{p.pid} {' '.join(_cmd(p))[:120]}" for p in self.seen.values() if alive(p)]
        raise AssertionError(f"processes still running {timeout} s later:\n" + "\n".join(left))

    def new_leftovers(self, within: float = 0.0) -> set[str]:
        """Files the run created that still exist (polled for up to `within` seconds)."""
        deadline = time.time() + within
        while (left := leftovers_snapshot() - self.before) and time.time() < deadline:
            time.sleep(0.2)
        return left

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

    def kill_all(self) -> None:
        self.track()
        for p in self.seen.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def _cmd(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _name(p: psutil.Process) -> list[str]:
    try:
        return [p.name(), *p.cmdline()]
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []
