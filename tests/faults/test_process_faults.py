"""Kill -9 of a rank, of torchrun and of an engine mid-run: the run ends (or errors clearly)
within a bounded time and leaves no process, /dev/shm segment or socket file behind."""

from __future__ import annotations

import signal
import time

import pytest

from tests.faults.harness import Run

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def run(tmp_path):
    runs = []

    def start(nproc=2, overrides=()):
        r = Run(tmp_path / f"run{len(runs)}", nproc, ["trainer.steps=6", "trainer.checkpoint_every=0", *overrides])
        runs.append(r)
        return r

    yield start
    for r in runs:
        r.kill_all()


def test_kill9_of_one_rank_leaves_nothing_behind(run):
    r = run()
    r.wait_for_steps(2)
    assert len(r.engines()) >= 2, r.output()[-3000:]
    victim = r.ranks()[1]
    t0 = time.time()
    victim.send_signal(signal.SIGKILL)
    seconds = r.wait_gone(timeout=30)
    print(f"\nkill -9 of rank pid {victim.pid}: every process of the run gone {time.time() - t0:.1f} s later")
    assert r.proc.returncode != 0
    assert r.new_leftovers() == set()
