"""Chaos: one run hit by three faults of different kinds (drawn from a seed) under torchrun --max-restarts ends
where an undisturbed run ends: every step's metrics equal value for value (the machine's aside), the final weights
bitwise equal, and nothing left behind. MOE_RL_CHAOS_SEED replays another schedule."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import ONE_ENGINE, REPO
from tests.faults.harness import QUIET, leftovers_snapshot

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow, pytest.mark.isolated]


def test_three_kinds_of_fault_in_one_run_end_as_an_undisturbed_run_ends(tmp_path):
    seed = os.environ.get("MOE_RL_CHAOS_SEED", "19")  # 19: kill -9 of a rank, of torchrun, SIGTERM, by step 5
    before = leftovers_snapshot()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
    command = [sys.executable, "-m", "moe_rl.tools.chaos", "--seed", seed, "--faults", "3", "--steps", "8"]
    command += ["--out", str(tmp_path / "chaos"), "--", ONE_ENGINE, *QUIET]
    t0 = time.time()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    print(f"\n{done.stdout}chaos: {time.time() - t0:.0f} s")
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "chaos" / "chaos.log").read_text()[-6000:]
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["metrics_equal"] and summary["weights_equal"]
    assert len({f["kind"] for f in summary["schedule"]}) == 3
    assert len([x for x in summary["injected"] if x.startswith("after step")]) == 3  # every fault landed
    assert f"[moe-rl-chaos] seed {seed}: 3 faults over 8 steps" in done.stdout  # the seed and schedule, first
    deadline = time.time() + 30
    while (left := leftovers_snapshot() - before) and time.time() < deadline:
        time.sleep(0.5)
    assert left == set()
