"""KL to a reference policy: per-token estimators, as a loss term or folded into rewards.

k1 = logp - ref                       (unbiased, can be negative)
k3 = exp(ref - logp) - (ref - logp) - 1   (Schulman's low-variance estimator, >= 0)
low_var_kl = clamp(k3, -10, 10)       (verl's name and bound for its default KL loss)
"""

from __future__ import annotations

import torch

from moe_rl.objectives.config import KL_KINDS


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate [B, T] (differentiable in `logp`)."""
    if kind == "k1":
        return logp - ref_logp
    if kind in ("k3", "low_var_kl"):
        d = (ref_logp - logp).clamp(-20.0, 20.0)  # keeps exp() finite for huge log-ratios
        k3 = d.exp() - d - 1.0
        return k3 if kind == "k3" else k3.clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")
