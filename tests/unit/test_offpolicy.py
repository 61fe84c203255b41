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
from moe_rl.objectives.corrections import IcePopConfig
from moe_rl.objectives.policy_loss import GSPOConfig, PPOConfig


def _policies(b: int = 6, t: int = 12):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    mask = torch.zeros(b, t)
    for i in range(b):
        start = int(torch.randint(1, 4, (), generator=g))
        mask[i, start : start + int(torch.randint(2, t - start + 1, (), generator=g))] = 1
    mu = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3  # log mu of a stale engine version
    prox = mu + 0.6 * torch.randn(b, t, generator=g, dtype=torch.float64)  # some tokens leave IcePop's band
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
    batch = {"old_logprobs": prox, "rollout_logprobs": mu, "advantages": adv, "loss_mask": corr.mask}
    batch["weights"] = corr.weights
    got, _ = objective.loss(logp, batch, num_tokens=float(mask.sum()), num_seqs=float((mask.sum(-1) > 0).sum()))
    got.backward()
    ref_logp = theta.clone().requires_grad_(True)
    want = _direct(loss, mu, prox, ref_logp, adv, mask, cfg)
    want.backward()
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-9), (float(got), float(want))
    assert torch.allclose(logp.grad.double(), ref_logp.grad, rtol=1e-5, atol=1e-9)
    # the ratio is taken against pi_prox, not mu: with mu in its place the loss differs
    stale = _direct(loss, mu, mu, theta, adv, mask, cfg)
    assert not torch.allclose(stale, want, rtol=1e-3)
