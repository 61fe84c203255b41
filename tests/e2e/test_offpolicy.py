"""Off-policy rollouts (trainer.max_staleness=1, rollout.placement=separate) through `torchrun
launch/train_moe.py`: the engine samples one batch ahead on cores of its own, every step trains samples
at most one version old, and the loop still learns the toy task. A resume samples the batch that was in
flight again from the same prompts (the data position counts trained steps), with the resumed weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe_rl.rollout import dump
from tests.conftest import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "launch/train_moe.py"]
COMMON = ["logging.wandb.mode=disabled", "trainer.max_staleness=1", "rollout.placement=separate"]


def _train(run_dir: Path, overrides: list[str]) -> list[dict]:
    run_job([*TORCHRUN, f"hydra.run.dir={run_dir}", *COMMON, *overrides], timeout=900)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_step_off_policy_learns_with_staleness_at_most_one(tmp_path):
    history = _train(tmp_path, ["trainer.steps=30", "trainer.checkpoint_every=0"])
    assert [h["step"] for h in history] == list(range(1, 31))
    stale = [h["staleness/max"] for h in history]
    assert all(h["staleness/mean"] <= h["staleness/max"] <= 1 for h in history), stale
    assert sum(s == 1 for s in stale) >= 15 and stale[0] == 0  # the first step samples with the weights it trains
    assert all(h["staleness/dropped"] == 0 for h in history)
    # pi_theta has moved one optimizer step by the last mini-batch: its ratio to pi_prox is no longer 1
    moved = sum(abs(h["actor/last_minibatch_ppo_kl"]) > 10 * abs(h["actor/first_minibatch_ppo_kl"]) for h in history)
    assert moved >= 25, [(h["actor/first_minibatch_ppo_kl"], h["actor/last_minibatch_ppo_kl"]) for h in history]
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nmax_staleness=1: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    steady = history[2:]  # generation hides behind training: the trainer hardly waits for samples
    assert sum(h["time/trainer_idle"] for h in steady) < 0.5 * sum(h["time/update"] for h in steady)


def test_resume_samples_the_in_flight_prompts_again(tmp_path):
    """4 steps straight vs 2 steps, then a resume to 4: step 3 has the same prompts (nothing lost or
    skipped), sampled with the resumed weights (staleness 0 right after the resume)."""
    straight = _train(tmp_path / "straight", ["trainer.steps=4", "trainer.dump_every=1"])
    _train(tmp_path / "split", ["trainer.steps=2", "trainer.dump_every=1"])
    resumed = _train(tmp_path / "split", ["trainer.steps=4", "trainer.dump_every=1"])
    assert [h["step"] for h in resumed][-2:] == [3, 4]
    assert [h["staleness/max"] for h in straight] == [0, 1, 1, 1]
    assert [h["staleness/max"] for h in resumed][-2:] == [0, 1]
    for step in (3, 4):
        a = _prompts(tmp_path / "straight" / "dumps", step)
        b = _prompts(tmp_path / "split" / "dumps", step)
        assert a == b, f"step {step}: the resumed run trained other prompts"
    assert _prompts(tmp_path / "straight" / "dumps", 3) != _prompts(tmp_path / "straight" / "dumps", 2)


def _prompts(root: Path, step: int) -> list[tuple[int, ...]]:
    tensors, _ = dump.read(dump.rank_file(root, step - 1, 0))  # folders count from 0
    ids, prompt = tensors["input_ids"], (tensors["attention_mask"] > 0) & (tensors["loss_mask"] == 0)
    return sorted({tuple(row[m].tolist()) for row, m in zip(ids, prompt, strict=True)})
