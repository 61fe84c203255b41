"""The hang watchdog's decisions over a real torch.distributed store: two ranks' watchdogs beat on a clock the test
moves; a frozen rank (a real stopped process) is named and killed, a stopped engine process is named, start-up is
not a hang. The end to end runs are tests/faults/test_hangs.py."""

from __future__ import annotations

import signal
import subprocess
import time

import psutil
import pytest
import torch.distributed as dist

from moe_rl.common import progress
from moe_rl.trainer.watchdog import EXIT_HUNG, Watchdog, main_thread_frames


@pytest.fixture
def stopped_process():
    """A real process, stopped as SIGSTOP stops a rank or an engine core."""
    proc = subprocess.Popen(["sleep", "60"])
    proc.send_signal(signal.SIGSTOP)
    process = psutil.Process(proc.pid)
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_STOPPED:  # the signal is taken when the process next runs: on a loaded
        assert time.monotonic() < deadline, process.status()  # machine, a moment after kill() returns
        time.sleep(0.01)
    yield process
    proc.kill()
    proc.wait()


def _pair(timeout_s=10.0, engines0=list):
    store, ended = dist.HashStore(), ([], [])  # each rank's calls of its `end`
    dogs = [Watchdog(timeout_s, engines0 if r == 0 else list, store, r, 2, end=ended[r].append) for r in range(2)]
    return dogs, ended


def test_a_frozen_rank_is_named_killed_and_every_rank_ends_with_the_retryable_code(stopped_process, capsys):
    (w0, w1), ended = _pair()
    w1.pid, w1.created = stopped_process.pid, stopped_process.create_time()  # rank 1 is that process
    progress.begin_step(3)
    progress.mark("update")
    w0.publish(0.0)
    w1.publish(0.0)
    now = 0.0
    for _ in range(5):  # both beat and the work moves
        now += 1.0
        progress.mark()
        w0.beat(now)
        w1.beat(now)
    assert ended == ([], [])
    while not ended[0] and now < 30:  # rank 1 froze (its thread beats no more); rank 0 waits in a collective
        now += 1.0
        w0.beat(now)
    # rank 0 saw the job's counter last change at 6 (rank 1 added after rank 0 read at 5): it ends at 17
    assert ended == ([EXIT_HUNG], []) and now == 17.0
    out = capsys.readouterr().out
    assert f"rank 1 (host {w1.host}, pid {stopped_process.pid}) STOPPED ANSWERING" in out, out
    assert "step 3, phase 'update'" in out and "trainer.hang_timeout_s" in out
    assert "test_watchdog.py" in out  # where the main thread was: this test's frames
    assert stopped_process.wait(timeout=5) == -signal.SIGKILL  # killed by rank 0, on the same host


def test_a_stopped_engine_process_is_named(stopped_process, capsys):
    (w0, w1), ended = _pair(engines0=lambda: [stopped_process])
    progress.mark("rollout")
    w0.publish(0.0)
    w1.publish(0.0)
    for now in range(1, 14):  # both beat; nothing moves after the first beats (rank 0 sees rank 1's add at 2)
        w0.beat(float(now))
        w1.beat(float(now))
        assert (ended[0] != [], ended[1] != []) == (now >= 13, now >= 12)
    assert ended[0][0] == ended[1][0] == EXIT_HUNG
    out = capsys.readouterr().out
    assert f"its engine process {stopped_process.pid} (sleep) is stopped (SIGSTOP?)" in out, out
    assert "STOPPED ANSWERING" not in out  # both ranks' threads still beat
    assert "rank 0: ending on the hang watchdog (rank 1 prints the report)" in out  # rank 1 saw it first
    assert stopped_process.status() == psutil.STATUS_STOPPED  # not ours to kill: its rank's reaper removes it


def test_no_hang_while_the_work_moves_or_before_every_rank_has_reported():
    (w0, w1), ended = _pair(timeout_s=2.0)
    w0.publish(0.0)
    for now in range(1, 20):  # rank 1 has not started its watchdog: start-up is the collective timeout's
        w0.beat(float(now))
    assert ended == ([], [])
    w1.publish(20.0)
    for now in range(20, 60):  # slow but moving work (2 s between marks at most) is not a hang
        if now % 3:
            progress.mark()
        w0.beat(float(now))
        w1.beat(float(now))
    assert ended == ([], [])


def test_the_thread_beats_on_its_own_and_stops():
    store = dist.HashStore()
    dog = Watchdog(5.0, store=store, end=pytest.fail)
    dog.start()
    time.sleep(1.2)
    dog.stop()
    assert dog.my_moves == progress.STATE.moves and not dog._thread.is_alive()  # it beat at least once
    assert "test_watchdog.py" in main_thread_frames()
