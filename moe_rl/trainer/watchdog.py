"""The hang watchdog (trainer.hang_timeout_s): when the job stops making progress, every rank ends with a report
that names the rank, host, phase and line that hung, or the engine process that did.

A rank that stops (SIGSTOP, a stuck NFS read, a dead NIC, a GPU that no longer answers) holds every other rank in
the next collective until torch's collective timeout (600 s), whose message names no rank or phase. Each rank runs
a thread that every `beat_s` seconds, through the job's store (torch.distributed's TCPStore, torchrun's per attempt):

- writes this rank's record: the host, the pid, the time of the beat, moe_rl.common.progress's step and phase and
  when it last moved (an engine step, a micro-batch's forward, a reward sample, a weight-sync bucket, a checkpoint
  file), the main thread's innermost frames and the state of the rank's engine processes;
- adds 1 to one job-wide counter if this rank moved since its last beat, and reads that counter.

So a beat costs each rank three store calls, whatever the world size. Once every rank has started its watchdog,
when the counter has not changed for `timeout_s` (timed on each rank's own clock), every rank still running reads
every record and ends: the first to see it prints the report (a rank whose latest beat is older than three
beats stopped answering: the hosts' clocks are taken to agree within a beat), each kills the stopped ranks of its
own host (their reapers then remove their engines) and exits with EXIT_HUNG, which torchrun's restarts and a Slurm
requeue treat as a failure to retry from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from moe_rl.common import progress
from moe_rl.trainer.logger import say

if TYPE_CHECKING:
    from moe_rl.rollout.engine import RolloutEngine

EXIT_HUNG = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, to be retried
KEY = "moe_rl/watchdog/{rank}"  # a rank's record
MOVED = "moe_rl/watchdog/moved"  # beats in which some rank moved
STARTED = "moe_rl/watchdog/started"  # ranks whose watchdog started
REPORTER = "moe_rl/watchdog/reporter"  # the first rank that saw the hang: it prints the report
BAD_STATES = {"stopped": "is stopped (SIGSTOP?)", "zombie": "has exited", "disk-sleep": "is stuck in a disk wait"}


def main_thread_frames() -> str:
    """Where the main thread is: its innermost moe-rl frame and its innermost frame (when another)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return "?"
    stack = [f for f in traceback.extract_stack(frame) if f.filename != __file__]  # (tests beat on it)
    ours = [f for f in stack if f"{os.sep}moe_rl{os.sep}" in f.filename]
    picked = [f for f in (ours[-1] if ours else None, stack[-1]) if f is not None]
    if len(picked) == 2 and picked[0] is picked[1]:
        picked = picked[:1]
    return " > ".join(f"{_short(f.filename)}:{f.lineno} in {f.name}" for f in picked)


def _short(path: str) -> str:
    parts = path.split(os.sep)
    for anchor in ("moe_rl", "site-packages", "dist-packages"):
        if anchor in parts:
            return os.sep.join(parts[parts.index(anchor) + (anchor != "moe_rl") :])
    return os.sep.join(parts[-2:])


def engine_states(processes: list) -> list[list]:
    """[pid, name, state] of each engine process (psutil.Process) still there."""
    # heavy: psutil, imported on first use
    import psutil

    out = []
    for p in processes:
        try:
            out.append([p.pid, p.name(), p.status()])
        except psutil.NoSuchProcess:
            out.append([p.pid, "?", "gone"])
    return out


def hang_report(records: dict[int, dict], frozen: set[int], now: float, timeout_s: float) -> list[str]:
    """The report's lines: the ranks that stopped answering (`frozen`) and the engine processes in a bad state first,
    then where every rank was. `records`: every rank's latest record; `now`: the reporter's wall clock."""
    lines = [
        f"HANG: no rank made progress for {timeout_s:g} s (trainer.hang_timeout_s); every rank ends with exit code "
        f"{EXIT_HUNG} (retryable: torchrun --max-restarts or a Slurm requeue resumes the newest checkpoint)"
    ]
    culprits = []
    for rank, r in sorted(records.items()):
        who = f"rank {rank} (host {r['host']}, pid {r['pid']})"
        at = f"step {r['step']}, phase '{r['phase']}', at {r['where']}"
        if rank in frozen:
            culprits.append(
                f"{who} STOPPED ANSWERING {now - r['beat_at']:.0f} s ago (a stopped or frozen process, or its host "
                f"gone); last seen at {at}"
            )
        for pid, name, state in r["engines"]:
            if state in BAD_STATES or state == "gone":
                culprits.append(
                    f"{who}: its engine process {pid} ({name}) {BAD_STATES.get(state, 'is gone')}; the rank waits at "
                    f"{at}"
                )
    if not culprits:
        lines.append(
            "no rank stopped answering and no engine process is stopped: a rank is stuck inside its own work (a "
            "hung file read, reward plugin or device); the rank whose phase or line differs from the others' is it"
        )
    lines += culprits
    for rank, r in sorted(records.items()):
        lines.append(
            f"  rank {rank} (host {r['host']}, pid {r['pid']}): step {r['step']}, phase '{r['phase']}', last progress "
            f"{now - r['moved_at']:.0f} s ago, at {r['where']}"
        )
    return lines


class Watchdog:
    """One per rank: `start()` once the trainer is built, `stop()` when the loop is done. `beat(now)` takes the wall
    clock (time.time(); tests pass their own)."""

    def __init__(
        self,
        timeout_s: float,
        engine_processes: Callable[[], list] = list,
        store=None,
        rank: int = 0,
        world: int = 1,
        end: Callable[[int], None] = os._exit,
        report_file: Path | None = None,
    ):
        self.timeout_s, self.rank, self.world, self.report_file = timeout_s, rank, world, report_file
        self.beat_s = min(max(timeout_s / 10, 0.5), 10.0)
        self.stale_s = 3 * self.beat_s  # a rank whose latest beat is older than this stopped answering
        self.engine_processes, self.store, self.end = engine_processes, store, end
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.created = _create_time(self.pid)
        self.armed = False  # every rank has published its first record
        self.my_moves: int | None = None  # progress.STATE.moves at the last beat
        self.job_moves: int | None = None  # the job-wide counter at the last beat
        self.moved_at = 0.0  # when this rank last saw the counter change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe-rl-watchdog", daemon=True)

    @classmethod
    def for_job(cls, timeout_s: float, engine_processes: Callable[[], list], report_file: Path) -> Watchdog | None:
        """This rank's watchdog over torch.distributed's store, its report also written to `report_file` (the
        Slurm templates requeue a job that left one); None when trainer.hang_timeout_s is 0."""
        if timeout_s <= 0:
            return None
        store = dist.distributed_c10d._get_default_store()
        return cls(timeout_s, engine_processes, store, dist.get_rank(), dist.get_world_size(), report_file=report_file)

    def publish(self, now: float) -> None:
        """This rank's first record, and its count among the started ones (a rank that freezes before the thread's
        first beat is still seen)."""
        self.store.set(KEY.format(rank=self.rank), json.dumps(self.record(now)))
        self.store.add(STARTED, 1)

    def start(self) -> None:
        self.publish(time.time())
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.beat_s)

    def record(self, now: float) -> dict:
        p = progress.STATE
        return {
            "host": self.host,
            "pid": self.pid,
            "created": self.created,
            "beat_at": now,
            "moved_at": now - (time.monotonic() - p.at),
            "step": p.step_number,
            "phase": p.phase,
            "where": main_thread_frames(),
            "engines": engine_states(self.engine_processes()),
        }

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self.beat(time.time())
            except Exception as e:  # the store gone (torchrun's agent died): the ranks are being stopped anyway
                say(f"[moe-rl] rank {self.rank}: hang watchdog stops ({type(e).__name__}: {e})")
                return

    def beat(self, now: float) -> None:
        """Publish this rank's record and progress, read the job's, and end the job if it hangs."""
        self.store.set(KEY.format(rank=self.rank), json.dumps(self.record(now)))
        moves = progress.STATE.moves
        job = self.store.add(MOVED, int(moves != self.my_moves))  # adding 0 reads it
        self.my_moves = moves
        if job != self.job_moves:
            self.job_moves, self.moved_at = job, now
        self.armed = self.armed or self.store.add(STARTED, 0) >= self.world
        if self.armed and now - self.moved_at > self.timeout_s:  # before every rank started: the collective timeout's
            self.finish(now)

    def reported(self) -> bool:
        """Some rank ended the job on this watchdog (a collective that fails on this rank then is its doing)."""
        return self.store.check([REPORTER])

    def finish(self, now: float) -> None:
        """Report (the first rank to see the hang: it may be the last to answer), kill this host's stopped ranks,
        end this rank."""
        keys = [KEY.format(rank=r) for r in range(self.world)]
        records = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)}  # every rank published one
        frozen = {r for r, rec in records.items() if now - rec["beat_at"] > self.stale_s and r != self.rank}
        reporter = int(self.store.compare_set(REPORTER, "", str(self.rank)))
        if self.rank == reporter:
            lines = hang_report(records, frozen, now, self.timeout_s)
            for line in lines:
                say(f"[moe-rl] {line}")
            if self.report_file is not None:
                self.report_file.write_text("\n".join(lines) + "\n")
        else:
            say(f"[moe-rl] rank {self.rank}: ending on the hang watchdog (rank {reporter} prints the report)")
        for rank in sorted(frozen):
            r = records[rank]
            if r["host"] == self.host and _create_time(r["pid"]) == r["created"]:  # that process, not a new one
                try:
                    os.kill(r["pid"], signal.SIGKILL)  # a stopped process dies too; its reaper removes its engines
                except ProcessLookupError:
                    pass
        sys.stdout.flush()
        sys.stderr.flush()
        self.end(EXIT_HUNG)


def _create_time(pid: int) -> float | None:
    # heavy: psutil, imported on first use
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


@contextmanager
def watching(timeout_s: float, engine: RolloutEngine | None, run_dir: Path) -> Iterator[None]:
    """A trainer's loop under the job's hang watchdog (none when `timeout_s` is 0), watching this rank's rollout
    `engine` (a RolloutEngine, or None) too, its report also written to <run_dir>/hang_report.txt. An error that a
    peer's hang caused (the peer ended and broke this rank's collective) becomes the watchdog's report and EXIT_HUNG
    instead."""
    engine_processes = (lambda: engine.processes) if engine is not None else list
    watchdog = Watchdog.for_job(timeout_s, engine_processes, run_dir / "hang_report.txt")
    if watchdog is None:
        yield
        return
    watchdog.start()
    try:
        yield
    except Exception:
        if watchdog.reported():
            watchdog.finish(time.time())
        raise
    finally:
        watchdog.stop()
