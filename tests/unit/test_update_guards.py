"""Non-finite updates never reach the weights; step-level health signals (zero-variance groups,
gradient-norm spikes)."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.actor.config import ParallelConfig
from moe_rl.actor.model import build_model, load_hf_config
from moe_rl.actor.optimizer import build_optimizer
from moe_rl.actor.train_step import train_minibatch
from moe_rl.actor.weights import load_hf_weights
from moe_rl.objectives.policy_loss import LossInputs
from moe_rl.trainer.health import HealthMonitor, NonFiniteUpdateError, SkipCounter
from moe_rl.trainer.metrics import zero_variance_fraction
from tests.reference import random_batch


def _params(chunks):
    return {n: p.detach().clone() for n, p in chunks[0].named_parameters()}


def _loss(logp, x):
    return -(logp * x.mask).sum() / x.mask.sum(), {}


@pytest.fixture
def actor(tiny_models, world1):
    path = tiny_models["qwen3_moe"]
    cfg = load_hf_config(path)
    chunks, conv = build_model(cfg, ParallelConfig())
    load_hf_weights(chunks, conv, path)
    ids, mask = random_batch(cfg.vocab_size, batch=4, length=9, seed=torch.seed() % 2**31)
    batch = LossInputs(input_ids=ids, attention_mask=mask, mask=mask.float())
    return chunks, build_optimizer(chunks, lr=1e-2), batch


def _adam_steps(opt) -> list[float]:
    return [float(s["step"]) for o in opt.chained_optimizers for s in o.optimizer.state.values() if "step" in s]


def test_nan_loss_skips_the_step_and_leaves_weights_unchanged(actor):
    chunks, opt, batch = actor
    before = _params(chunks)

    def nan_loss(logp, mb):
        loss, m = _loss(logp, mb)
        return loss * float("nan"), m

    m = train_minibatch(chunks, opt, batch, nan_loss, micro_batch_size=2)
    assert m["skipped"] == 1.0 and math.isnan(m["actor/grad_norm"])
    after = _params(chunks)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in chunks[0].parameters())
    assert _adam_steps(opt) in ([], [0.0] * len(_adam_steps(opt)))  # Adam never stepped


def test_nan_gradient_with_a_finite_loss_is_skipped_then_training_goes_on(actor):
    chunks, opt, batch = actor
    before = _params(chunks)
    # layer 0's experts' fc1 gradients only; every real token picks 2 of them, so some get a gradient (one
    # expert alone was unused by about 1 random batch in 100: Adam then left it unchanged after the next step)
    hooked = {
        n: p for n, p in chunks[0].named_parameters() if ".layers.0.mlp.experts." in n and n.endswith("fc1.weight")
    }
    assert len(hooked) > 1, sorted(n for n, _ in chunks[0].named_parameters())
    handles = [p.register_hook(lambda g: g * float("nan")) for p in hooked.values()]
    m = train_minibatch(chunks, opt, batch, _loss, micro_batch_size=2)
    for handle in handles:
        handle.remove()
    assert m["skipped"] == 1.0, sorted(hooked)
    assert all(torch.equal(before[k], v) for k, v in _params(chunks).items())

    m = train_minibatch(chunks, opt, batch, _loss, micro_batch_size=2)  # the next, finite step applies
    assert m["skipped"] == 0.0 and math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0
    changed = [k for k, v in _params(chunks).items() if not torch.equal(before[k], v)]
    assert any(n in changed for n in hooked) and all(torch.isfinite(p).all() for p in chunks[0].parameters())


def test_skip_counter_stops_after_the_configured_consecutive_skips():
    skips = SkipCounter(limit=3)
    assert skips(True, "a") and skips(True, "b")
    assert skips(False, "c") is None  # an applied step resets the streak
    assert "1 in a row" in skips(True, "d")
    assert "2 in a row" in skips(True, "e")
    with pytest.raises(NonFiniteUpdateError, match="f: 3 optimizer step.* in a row .*max_skipped_steps=3"):
        skips(True, "f")
    with pytest.raises(NonFiniteUpdateError):
        SkipCounter(limit=1)(True, "first")


def test_zero_variance_fraction_on_known_groups():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2, 0.2, 0.2, 0.0, 0.0, 0.0])
    assert zero_variance_fraction(rewards, 3) == pytest.approx(3 / 4)  # all but [0, 1, 0.5]
    assert zero_variance_fraction(rewards, 2) == pytest.approx(3 / 6)  # [1,1], [.2,.2], [0,0]
    assert zero_variance_fraction(rewards, 6) == 0.0
    assert zero_variance_fraction(torch.zeros(8), 4) == 1.0


def test_health_monitor_warns_on_a_grad_norm_spike_and_once_on_flat_steps():
    h = HealthMonitor()
    for norm in [2.0, 3.0, 2.5, 4.0]:
        assert h({"actor/grad_norm": norm, "reward/zero_variance_groups": 0.5}) == []
    spike = h({"actor/grad_norm": 40.0})
    assert len(spike) == 1 and "15x the median 2.75 of the previous 4 steps" in spike[0]
    assert h({"actor/grad_norm": 20.0}) == []  # 20 < 10 x median(2, 3, 2.5, 4, 40) = 30
    assert h({"actor/grad_norm": float("nan")}) == []  # a skipped step is not a spike
    flat = h({"actor/grad_norm": 3.0, "reward/zero_variance_groups": 1.0})
    assert len(flat) == 1 and "teaches nothing" in flat[0]
    assert h({"actor/grad_norm": 3.0, "reward/zero_variance_groups": 1.0}) == []  # said once
    assert h.summary() == ["2 step(s) had nothing to learn (every group's rewards equal)"]


def test_mismatch_warnings_name_the_stale_behaviour_policy_in_one_line():
    from moe_rl.trainer.health import health_warnings

    gap = {"mismatch/kl": 0.6, "mismatch/ess": 0.2, "mismatch/chi2_token": 0.5}
    sync = health_warnings(gap | {"staleness/max": 0.0}, 1e-4)
    assert len(sync) == 2 and all(w.startswith("training-inference mismatch") for w in sync)
    stale = health_warnings(gap | {"staleness/max": 1.0}, 1e-4)
    assert len(stale) == 1 and "mismatch/kl = 0.6, mismatch/ess = 0.2" in stale[0]
    assert "1 version(s) behind pi_old" in stale[0]
    assert health_warnings({"mismatch/kl": 0.01, "staleness/max": 1.0}, 1e-4) == []


def test_the_first_minibatch_check_is_off_where_pi_old_is_interpolated():
    """algorithm.prox_logp=loglinear: pi_prox is mu moved toward pi_theta, not a recompute, so pi_theta / pi_old
    on the first mini-batch is not 1 by design; the loop passes no tolerance and nothing warns."""
    from moe_rl.trainer.health import health_warnings

    moved = {"actor/first_minibatch_ppo_kl": 0.28}
    assert len(health_warnings(moved, 1e-4)) == 1 and "broken weight sync" in health_warnings(moved, 1e-4)[0]
    assert health_warnings(moved, None) == []
