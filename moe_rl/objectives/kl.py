"""KL to a reference policy: per-token estimators, as a loss term or folded into rewards.

k1 = logp - ref                       (unbiased, can be negative)
k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's low-variance estimator, >= 0)
low_var_kl = clamp(k3, -10, 10)       (verl's name and bound for its default KL loss)
"""

from __future__ import annotations

import torch

from moe_rl.objectives.aggregation import aggregate

KL_KINDS = ("k1", "k3", "low_var_kl")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate [B, T] (differentiable in `logp`)."""
    if kind == "k1":
        return logp - ref_logp
    if kind in ("k3", "low_var_kl"):
        d = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp() finite for huge log-ratios
        k3 = d.exp() - d - 1.0
        return k3 if kind == "k3" else k3.clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")


def kl_loss(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    agg: str = "token-mean",
    **agg_kwargs,
) -> torch.Tensor:
    """KL as a loss term (add coef * kl_loss to the policy loss)."""
    return aggregate(kl_penalty(logp, ref_logp, kind), mask.to(logp.dtype), agg, **agg_kwargs)


@torch.no_grad()
def kl_shaped_token_rewards(
    rewards: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float, kind: str = "k1"
) -> torch.Tensor:
    """Classic RLHF shaping: r_t = -beta * KL_t on every response token, plus the sequence
    reward on its last response token. Returns [B, T] (0 off the mask)."""
    m = mask.to(logp.dtype)
    token = -beta * kl_penalty(logp, ref_logp, kind) * m
    lengths = mask.sum(-1)
    has = lengths > 0
    # last response token = last index where mask is 1
    idx = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask.bool(), idx, torch.full_like(idx, -1)).max(dim=-1).values
    rows = torch.nonzero(has).squeeze(-1)
    token[rows, last[rows]] += rewards.to(token.dtype)[rows]
    return token
