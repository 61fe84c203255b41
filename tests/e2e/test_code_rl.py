"""RL on HumanEval with the code reward (issue 80): launch/train_moe.py for 3 steps of data.task=humaneval on the
built-in tiny model, every response run against its problem's tests in the bubblewrap sandbox. The random model
scores 0; the run proves the path: rollouts -> sandbox -> rewards -> update, with reward/timeouts and the sandbox
statuses logged, and the process ends when the run does (the sandbox's thread pool stops at exit)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from moe_rl.reward.programs import STATUSES
from tests.conftest import ONE_ENGINE, run_job

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed here"),
]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "launch/train_moe.py"]


def test_three_humaneval_rl_steps_score_in_the_sandbox_and_log_its_statuses(tmp_path):
    run_dir = tmp_path / "run"
    # Responses of 2 tokens: a random model's longer ones never parse, while many 2-token completions of a
    # HumanEval prompt do (a name after the function), so programs really run in the sandbox and fail there.
    overrides = [f"hydra.run.dir={run_dir}", "logging.wandb.mode=disabled", "trainer.checkpoint_every=-1"]
    overrides += ["trainer.steps=3", ONE_ENGINE, "data.task=humaneval", "sampling.max_tokens=2"]
    out = run_job([*TORCHRUN, *overrides], timeout=600)
    assert "reward code_reward: moe_rl.reward.code:code_reward" in out, out[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert s["reward/timeouts"] == 0 and s["reward/errors"] == 0
        statuses = {k: s[f"reward/code_reward/status_{k}"] for k in STATUSES}
        assert sum(statuses.values()) == pytest.approx(1.0), statuses  # each sample has exactly one status
        assert s["reward/mean"] == s["reward/code_reward/passed"] == statuses["passed"]
    ran = sum(s["reward/code_reward/status_failed"] + s["reward/code_reward/tests_total"] for s in steps)
    assert ran > 0, [{k: v for k, v in s.items() if k.startswith("reward/code_reward/status")} for s in steps]
