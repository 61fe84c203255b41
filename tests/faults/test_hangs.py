"""Hangs end the job: a stopped rank (RL and SFT), a stopped engine core (trainer.hang_timeout_s) and a reward plugin
that never returns (data.reward_timeout_s) each end every process of the run within twice the configured time, with a
message naming the rank, host, phase or plugin, the retryable exit code, and nothing left behind."""

from __future__ import annotations

import signal
import socket
import time

import pytest

from moe_rl.trainer.watchdog import EXIT_HUNG
from tests.faults.harness import Run

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow, pytest.mark.isolated]

HANG_S = 20  # trainer.hang_timeout_s of these runs (the default is 300)
RL, SFT = "launch/train_moe.py", "launch/sft_moe.py"
BASE = {  # each script's run: long enough that the SIGSTOP lands mid-run (an SFT step is 0.2 s, an RL step 1 s)
    RL: ["trainer.steps=8", "trainer.checkpoint_every=0"],
    SFT: [
        "trainer.steps=200",
        "trainer.checkpoint_every=0",
        "trainer.val_every=0",
        "trainer.export_hf=false",
    ],
}


@pytest.fixture
def run(tmp_path):
    runs = []

    def start(overrides=(), script=RL):
        r = Run(tmp_path / f"run{len(runs)}", 2, [*BASE[script], *overrides], script=script)
        runs.append(r)
        return r

    yield start
    for r in runs:
        r.kill_all()


def _ends_within(r: Run, t0: float, limit: float) -> float:
    """Every process of the run gone and every file it made removed by t0 + limit; returns the seconds taken."""
    r.wait_gone(timeout=limit - (time.time() - t0))
    left = r.new_leftovers(within=limit - (time.time() - t0))
    assert left == set(), f"left behind: {left}\n" + "\n".join(r.output().splitlines()[-40:])
    return time.time() - t0


@pytest.mark.parametrize("script, hang_s", [(RL, HANG_S), (SFT, 10)], ids=["rl", "sft"])
def test_a_stopped_rank_ends_every_rank_naming_it(run, script, hang_s):
    """RL and SFT (launch/sft_moe.py arms the same watchdog; its steps of 0.2 s let the limit be shorter)."""
    r = run([f"trainer.hang_timeout_s={hang_s}"], script)
    r.wait_for_steps(1)
    victim = next(p for p in r.ranks() if p.environ()["RANK"] == "1")
    t0 = time.time()
    victim.send_signal(signal.SIGSTOP)  # a frozen process: a stuck NFS read, a dead NIC, a debugger
    seconds = _ends_within(r, t0, 2 * hang_s)
    print(f"\nSIGSTOP of rank 1 ({script}): every process of the run gone {seconds:.1f} s later")
    out = r.output()
    assert f"rank 1 (host {socket.gethostname()}, pid {victim.pid}) STOPPED ANSWERING" in out, out[-4000:]
    assert "last seen at step " in out and f"exit code {EXIT_HUNG}" in out and "exitcode  : 75" in out
    assert r.proc.returncode != 0


def test_a_stopped_engine_core_ends_every_rank_naming_it(run):
    r = run([f"trainer.hang_timeout_s={HANG_S}"])
    r.wait_for_steps(1)
    engine = next(p for p in r.engines() if "EngineCore" in p.name())
    name = engine.name()
    t0 = time.time()
    engine.send_signal(signal.SIGSTOP)
    seconds = _ends_within(r, t0, 2 * HANG_S)
    print(f"\nSIGSTOP of an engine core: every process of the run gone {seconds:.1f} s later")
    out = r.output()
    assert f"its engine process {engine.pid} ({name}) is stopped (SIGSTOP?)" in out, out[-4000:]
    assert "STOPPED ANSWERING" not in out  # no rank froze: each rank's watchdog still answered
    assert r.proc.returncode != 0


def test_a_reward_plugin_that_never_returns_ends_the_run_naming_it(run, tmp_path, monkeypatch):
    called = tmp_path / "called"
    monkeypatch.setenv("MOE_RL_TEST_CALLED", str(called))
    r = run(["data.reward=tests.e2e.plugins:never_returns", "data.reward_timeout_s=10"])
    deadline = time.time() + 300
    while not called.is_file() and time.time() < deadline and r.proc.poll() is None:
        time.sleep(0.1)
    assert called.is_file(), r.output()[-4000:]
    t0 = float(called.read_text().split()[0])  # the first rank's call
    seconds = _ends_within(r, t0, 2 * 10)
    print(f"\na reward plugin that never returns: every process of the run gone {seconds:.1f} s after its first call")
    out = r.output()
    assert "step 1 (rank " in out and "reward function never_returns did not return within" in out, out[-4000:]
    assert "samples pending (samples 0, 1, 2," in out
    assert r.proc.returncode != 0
