"""End-to-end RL runs of `torchrun launch/train_moe.py` on CPU (tiny MoE, toy task)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

KEYS = [
    "reward/mean",
    "response/length_mean",
    "actor/entropy",
    "actor/clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/first_minibatch_ppo_kl",
    "icepop/masked_fraction",
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
    "mismatch/log_ppl_abs_diff",
    "time/rollout",
    "time/old_logprobs",
    "time/update",
    "time/weight_sync",
    "router/agreement",
]


def _train(run_dir: Path, overrides: list[str], timeout: int = 900) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]
    out = run_job([*cmd, f"hydra.run.dir={run_dir}", *overrides], timeout=timeout)
    print("\n".join(line for line in out.splitlines() if line.startswith("step")))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_default_run_learns_the_toy_task(tmp_path):
    history = _train(tmp_path, [])  # defaults: 30 steps
    assert len(history) == 30
    for key in KEYS:
        assert key in history[0], key
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nmean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    # pi_theta == pi_old on the first mini-batch of every step (R3, fp32): ratio 1
    assert max(abs(h["actor/first_minibatch_ppo_kl"]) for h in history) < 1e-4
    assert list(tmp_path.glob("wandb/offline-run-*")), "wandb offline files missing"
    # fp32 actor and engine route identically on almost every token-layer
    assert min(h["router/agreement"] for h in history) > 0.99


def test_overrides_r2_ep2_tis(tmp_path):
    history = _train(
        tmp_path,
        [
            "trainer.steps=3",
            "parallel.ep=2",
            "actor.router_replay=r2",
            "algorithm.correction=tis",
            "logging.wandb_mode=disabled",
        ],
    )
    assert len(history) == 3
    assert max(abs(h["actor/first_minibatch_ppo_kl"]) for h in history) < 1e-4
    assert "tis/capped_fraction" in history[0]
    assert 0.99 < history[-1]["router/agreement"] <= 1.0
