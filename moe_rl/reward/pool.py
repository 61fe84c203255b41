"""The worker processes that run synchronous per-sample rewards (verl's form, @per_sample, the built-ins): each call
with its own time limit (data.reward_call_timeout_s), a call past it killed with its worker (pebble restarts one).

Workers start with the spawn context (the trainer holds torch's threads; forking them is unsafe), load each reward by
its spec (a reward file is imported in the worker too) and run calls on their main thread, so math-verify's own
signal-based timeout works there. `close()` stops them; a worker also dies with the thread that started it
(PR_SET_PDEATHSIG), so a trainer killed outright leaves no reward process behind either.
"""

from __future__ import annotations

import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from moe_rl.common import progress
from moe_rl.reward.inprocess import sample_call
from moe_rl.reward.load import RewardFunction, load
from moe_rl.reward.sample import Sample

_LOADED: dict[str, RewardFunction] = {}  # in a worker: the rewards it has loaded, by spec
PR_SET_PDEATHSIG = 1


@dataclass
class Outcome:
    """How one call ended: `value` (what the function returned), or timed out, or `error` (with the worker's
    traceback text)."""

    value: Any = None
    timed_out: bool = False
    error: BaseException | None = None
    traceback: str = ""


def default_workers() -> int:
    """data.reward_workers=0: min(8, the CPU cores this process may use)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def start_worker(specs: list[str], preload: list[str]) -> None:
    """A worker's start: die with its parent, load the rewards and `preload` modules before the first call (so no
    call's time limit pays for imports). A failure here is left to the call, which reports it."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S110 -- the call that needs it reports the error
            pass
    for spec in specs:
        try:
            _LOADED[spec] = load(spec)
        except Exception:  # noqa: S110 -- the call reports it, naming the sample
            pass


def call_in_worker(spec: str, sample: Sample):
    """One call of reward `spec` on `sample`, in a worker (loading the reward on first use)."""
    if spec not in _LOADED:
        _LOADED[spec] = load(spec)
    return sample_call(_LOADED[spec], sample)()


class RewardPool:
    """`workers` processes for per-sample calls of `specs`, started on first use; each call limited to `timeout_s`."""

    def __init__(self, specs: list[str], workers: int, timeout_s: float, preload: list[str] = ()):
        self.specs, self.workers, self.timeout_s, self.preload = list(specs), workers, timeout_s, list(preload)
        self.pool = None
        self.lock = threading.Lock()  # a reward service scores batches on several threads: one pool for them all

    def _started(self):
        with self.lock:
            if self.pool is None:
                # heavy: pebble, imported when a reward first needs the pool
                from pebble import ProcessPool

                ctx = multiprocessing.get_context("spawn")
                args = (self.specs, self.preload)
                self.pool = ProcessPool(max_workers=self.workers, initializer=start_worker, initargs=args, context=ctx)
            return self.pool

    def run(self, calls: list[tuple[str, Sample]]) -> list[Outcome]:
        """Every (spec, sample) call, spread over the workers; their outcomes in order. Waits at most about
        timeout_s per call that runs past it (the calls run concurrently)."""
        pool = self._started()
        futures = [pool.schedule(call_in_worker, args=call, timeout=self.timeout_s or None) for call in calls]
        out = []
        for future in futures:
            try:
                out.append(Outcome(value=future.result()))
            except FutureTimeout:
                out.append(Outcome(timed_out=True))
            except Exception as e:  # the reward's exception (pebble keeps the worker's traceback), or a dead worker
                out.append(Outcome(error=e, traceback=getattr(e, "traceback", "")))
            progress.mark()
        return out

    def close(self) -> None:
        """Stop the workers (a call still running is killed) and wait for them to exit."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.stop()
            pool.join(timeout=30)
