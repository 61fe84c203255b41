"""Sandboxed runs in parallel: `SandboxPool` runs jobs on threads (each run in its own sandbox under its own uid:
moe_rl.sandbox.slots), and the process-wide pool the code rewards share (`configure` from data.sandbox, then
`shared_pool`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from moe_rl.sandbox.config import Limits, SandboxConfig
from moe_rl.sandbox.runner import RunResult, run_program


@dataclass(frozen=True)
class Job:
    """One program to run: its source, its stdin and extra files written beside it in the work folder."""

    source: str
    stdin: bytes = b""
    files: dict[str, str] | None = None


class SandboxPool:
    """`workers` sandboxed runs at a time. Threads suffice: each run is a bwrap process the thread waits on."""

    def __init__(self, workers: int, limits: Limits = Limits(), python: str = "/usr/bin/python3"):
        if workers < 1:
            raise ValueError(f"SandboxPool: workers={workers}: must be >= 1")
        limits.check()
        self.workers, self.limits, self.python = workers, limits, python
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moe-rl-sandbox")

    def run(self, job: Job) -> RunResult:
        """One job, on the calling thread."""
        return run_program(job.source, job.stdin, self.limits, self.python, job.files)

    def run_many(self, jobs: list[Job]) -> list[RunResult]:
        """Every job, `workers` at a time; the results in the jobs' order."""
        return list(self._executor.map(self.run, jobs))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_lock = threading.Lock()
_config = SandboxConfig()
_pool: SandboxPool | None = None


def configure(cfg: SandboxConfig) -> None:
    """Use these settings for the shared pool from now on (a pool made with other settings is closed)."""
    global _config, _pool
    cfg.check()
    with _lock:
        if cfg != _config and _pool is not None:
            _pool.close()
            _pool = None
        _config = cfg


def shared_pool() -> SandboxPool:
    """The process-wide pool, made on first use from the configured settings (the defaults if never configured)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = SandboxPool(_config.pool_workers(), _config.limits(), _config.python)
        return _pool
