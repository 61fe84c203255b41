"""Off-policy training (trainer.max_staleness): the decoupled three-policy objective against its formula.

Behaviour policy mu (the engine version that sampled, here several updates stale), proximal policy
pi_prox (the actor's recompute before the update: the old-log-prob pass), target pi_theta:
  loss_t = w_t * clip-loss(pi_theta / pi_prox, A),  w_t = k_t 1[0.5 <= k_t <= 5], k_t = pi_prox / mu
(IcePop; a constant)
written out directly (GSPO: the sequence ratio exp(mean_t log pi_theta/pi_prox); PPO: per token) and
compared with the objective the trainer uses, fused and unfused, value and gradient.
"""

from __future__ import annotations

import pytest
import torch

from moe_rl.config import AlgorithmConfig
from moe_rl.objectives import Objective
from moe_rl.objectives.config import GSPOConfig, IcePopConfig, PPOConfig
from moe_rl.objectives.policy_loss import LossInputs


def _policies(b: int = 6, t: int = 12):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    mask = torch.zeros(b, t)
    for i in range(b):
        start = int(torch.randint(1, 4, (), generator=g))
        mask[i, start : start + int(torch.randint(2, t - start + 1, (), generator=g))] = 1
    mu = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3  # log mu of a stale engine version
    prox = mu + 0.6 * torch.randn(b, t, generator=g, dtype=torch.float64)  # some tokens leave IcePop's band
    first = int(mask[0].argmax())
    prox[0, first] = mu[0, first] - 1.5  # and at least one does (k = 0.22): ~1% of draws had none
    theta = prox + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return mu * mask, prox * mask, theta * mask, adv, mask.double()


def _direct(loss: str, mu, prox, theta, adv, mask, cfg) -> torch.Tensor:
    k = (prox - mu).exp()
    w = k * ((k >= 0.5) & (k <= 5.0)).double() * mask  # IcePop: the ratio k inside [0.5, 5], 0 outside
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    a = adv[:, None]
    if loss == "ppo":  # token-mean over every token of the mini-batch
        r = (theta - prox).exp()
        per_token = torch.maximum(-a * r, -a * r.clamp(lo, hi)) * w
        return (per_token * mask).sum() / mask.sum()
    # GSPO, seq-mean-token-mean: s_i = exp(mean_t log pi_theta/pi_prox); gradient s_i * grad log pi_theta_t
    n = mask.sum(-1)
    seq = ((theta - prox) * mask).sum(-1) / n
    s = (seq.detach()[:, None] + theta - theta.detach()).exp()
    per_token = torch.maximum(-a * s, -a * s.clamp(lo, hi)) * w
    return ((per_token * mask).sum(-1) / n).sum() / (n > 0).sum()


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("loss", ["gspo", "ppo"])
def test_decoupled_objective_equals_the_three_policy_formula(loss, fused):
    cfg = GSPOConfig(clip_low=0.01, clip_high=0.02) if loss == "gspo" else PPOConfig(agg="token-mean")
    objective = Objective(AlgorithmConfig(loss=cfg, correction=IcePopConfig(), fused_loss=fused), group_size=2)
    mu, prox, theta, adv, mask = _policies()
    corr = objective.correct(prox, mu, mask)
    assert 0 < float((corr.weights == 0)[mask.bool()].double().mean()) < 0.9  # IcePop drops some tokens
    logp = theta.clone().requires_grad_(True)
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum())}
    batch = LossInputs(old_logp=prox, rollout_logp=mu, advantages=adv, mask=corr.mask, weights=corr.weights, **counts)
    got, _ = objective.loss(logp, batch)
    got.backward()
    ref_logp = theta.clone().requires_grad_(True)
    want = _direct(loss, mu, prox, ref_logp, adv, mask, cfg)
    want.backward()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9), (float(got), float(want))
    assert torch.allclose(logp.grad.double(), ref_logp.grad, rtol=1e-5, atol=1e-9)
    # the ratio is taken against pi_prox, not mu: with mu in its place the loss differs
    stale = _direct(loss, mu, mu, theta, adv, mask, cfg)
    assert not torch.allclose(stale, want, rtol=1e-6, atol=1e-9)  # the tolerance the equality above passed with


# ---- algorithm.prox_logp=loglinear (A-3PO): pi_prox interpolated from mu and pi_theta by versions ----------


def test_loglinear_alpha_follows_the_versions():
    from moe_rl.objectives.proximal import loglinear_alpha

    step = 7  # the actor's version before this update; pi_theta is version 8
    got = loglinear_alpha(torch.tensor([7, 6, 5, 2]), step)
    want = torch.tensor([0 / 1, 1 / 2, 2 / 3, 5 / 6])  # (v_prox - v_mu) / (v_theta - v_mu)
    assert torch.allclose(got, want)
    with pytest.raises(ValueError, match="sample 1 was sampled by policy version 9, newer than the actor's 7"):
        loglinear_alpha(torch.tensor([7, 9]), step)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("loss", ["gspo", "ppo"])
def test_loglinear_objective_equals_the_a3po_formula(loss, fused):
    """The loss with pi_prox = mu + alpha (sg[pi_theta] - mu) (log space) and the correction on that pi_prox,
    against the three-policy formula with that pi_prox written out: value and gradient."""
    cfg = GSPOConfig(clip_low=0.01, clip_high=0.02) if loss == "gspo" else PPOConfig(dual_clip=None)
    algorithm = AlgorithmConfig(loss=cfg, correction=IcePopConfig(), fused_loss=fused, prox_logp="loglinear")
    objective = Objective(algorithm, group_size=2)
    mu, _, _, adv, mask = _policies()
    theta = mu + 2.0 * torch.randn(mu.shape, dtype=torch.float64) * mask  # pi_theta far from mu: IcePop bites
    alpha = 0.3 + 0.7 * torch.rand(mu.shape[0], dtype=torch.float64)
    # two tokens that decide the checks below whatever the draw: IcePop keeps the first under alpha = 0.5
    # (k = 0.61) and drops it with pi_theta as pi_prox (k = 0.37); it drops the second either way (k = 0.37, 0.14)
    first = int(mask[0].argmax())
    alpha[0], theta[0, first], theta[0, first + 1] = 0.5, mu[0, first] - 1.0, mu[0, first + 1] - 2.0
    logp = theta.clone().requires_grad_(True)
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float((mask.sum(-1) > 0).sum())}
    batch = LossInputs(rollout_logp=mu, advantages=adv, mask=mask, prox_alpha=alpha, **counts)
    got, metrics = objective.loss(logp, batch)
    got.backward()
    ref_logp = theta.clone().requires_grad_(True)
    prox = (mu + alpha[:, None] * (theta - mu)) * mask  # a constant: no gradient through pi_prox
    want = _direct(loss, mu, prox, ref_logp, adv, mask, cfg)
    want.backward()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9), (float(got), float(want))
    assert torch.allclose(logp.grad.double(), ref_logp.grad, rtol=1e-5, atol=1e-9)
    k = (prox - mu).exp()[mask.bool()]
    dropped = float(((k < 0.5) | (k > 5.0)).double().mean())
    assert 0 < dropped < 0.9 and metrics["icepop/masked_fraction"].item() == pytest.approx(dropped)
    # pi_theta itself as pi_prox (alpha = 1) is another loss
    other = _direct(loss, mu, theta.detach(), theta, adv, mask, cfg)
    assert not torch.allclose(got.double(), other, rtol=1e-6, atol=1e-9), (float(got), float(other))


def _tensors(obj, clone: bool = False) -> dict[str, torch.Tensor]:
    """A dataclass's tensor fields (copies if `clone`)."""
    return {k: v.clone() if clone else v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def test_loglinear_update_on_a_fresh_batch_equals_mu_as_pi_prox(tiny_models, world1):
    """On-policy samples (alpha = 0): the loglinear update is the recompute update with mu in pi_prox's place,
    on a real Megatron actor (same weights after two mini-batches); the update reports its own forward's
    log-probs, which for the first mini-batch are the actor's before the update."""
    from moe_rl.actor.actor import Actor
    from moe_rl.common.batch import PaddedBatch, ProxPolicy
    from moe_rl.config import TrainConfig
    from tests.reference import random_batch

    cfg = TrainConfig()
    cfg.actor.router_replay, cfg.actor.mini_batches, cfg.actor.lr = "off", 2, 3e-2
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)  # the seed in a failure message reproduces the whole draw
    adv, noise = torch.randn(8, generator=g), 0.3 * torch.randn(8, 14, generator=g)
    weights, seen = [], {}
    for prox_logp in ("recompute", "loglinear"):
        cfg.algorithm.prox_logp = prox_logp
        actor = Actor(cfg.actor, cfg.model, cfg.parallel, tiny_models["qwen3_moe"], record_routes=False)
        ids, attn = random_batch(actor.hf_config.vocab_size, batch=8, length=14, seed=seed, min_len=8)
        loss_mask = attn.float().clone()
        loss_mask[:, :4] = 0
        # GSPO's clip (3e-4) zeroes a sequence whose ratio pi/mu = exp(-mean noise) sits outside the range on the
        # advantage's side; signs that keep every sequence inside the pessimistic min make the update move
        # (a 1-in-16 seed otherwise clipped the whole first mini-batch and nothing moved)
        adv = adv.abs() * torch.sign((noise * loss_mask).sum(1))
        padded = PaddedBatch(ids, attn, loss_mask, torch.zeros(ids.shape), None)
        initial = [p.detach().clone() for c in actor.chunks for p in c.parameters()]
        before = actor.old_logprobs(padded)
        padded.rollout_logprobs = (before.logprobs + noise) * loss_mask  # mu != pi_old
        objective = Objective(cfg.algorithm, group_size=4)
        if prox_logp == "recompute":
            old = ProxPolicy(logprobs=padded.rollout_logprobs, entropy=before.entropy)
        else:
            old = ProxPolicy(alpha=torch.zeros(8))
        given = _tensors(old, clone=True), _tensors(padded, clone=True)
        m = actor.train(padded, old, adv, objective, lambda skipped, i: skipped)
        # Actor.train changes nothing it was given: pi_prox (the same fields, the same values) and the batch
        for was, now in zip(given, (_tensors(old), _tensors(padded)), strict=True):
            assert was.keys() == now.keys() and all(torch.equal(was[k], now[k]) for k in was)
        # pi_prox = mu: every token's IcePop ratio is 1
        assert m["actor/skipped_steps"] == 0 and m["icepop/weight_mean"] == pytest.approx(1.0), m
        weights.append([p.detach().clone() for c in actor.chunks for p in c.parameters()])
        seen[prox_logp] = (before, actor.update_policy, m)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(*weights, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(weights[1], initial, strict=True))  # the update moved
    before, old, m = seen["loglinear"]
    assert m["actor/ppo_kl"] == pytest.approx(seen["recompute"][2]["actor/ppo_kl"], rel=1e-5)
    first, real = slice(0, 4), loss_mask.bool()
    assert torch.allclose(old.logprobs[first][real[first]], before.logprobs[first][real[first]], atol=1e-5)
    assert torch.allclose(old.entropy[first][real[first]], before.entropy[first][real[first]], atol=1e-5)
    # the second mini-batch ran after an optimizer step: pi_theta there is no longer the actor before the update
    moved = (old.logprobs[4:][real[4:]] - before.logprobs[4:][real[4:]]).abs().max()
    assert moved > 1e-5, f"seed {seed}: the second mini-batch's log-probs moved only {moved:.2e}"
