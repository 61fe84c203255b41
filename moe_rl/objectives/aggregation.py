"""Loss aggregation over a padded `[B, T]` token matrix, and masked reductions.

The modes and their per-sequence coefficients are defined once, in
`moe_rl.kernels.aggregation` (shared with the fused loss kernel):
  token-mean               sum(l * m) / num_tokens
  seq-mean-token-mean      mean over sequences of (per-sequence token mean)     [GSPO default]
  seq-mean-token-sum       mean over sequences of (per-sequence token sum)
  seq-mean-token-sum-norm  sum(l * m) / (num_seqs * horizon)                    [Dr.GRPO]

`num_tokens` / `num_seqs` default to this batch's counts (sequences with at least one token);
pass global counts when a batch is split over micro-batches or data-parallel ranks so every
token or sequence weighs the same. `horizon` defaults to T.
"""

from __future__ import annotations

import torch

from moe_rl.kernels.aggregation import AGG_MODES, sequence_coefficients

__all__ = ["AGG_MODES", "aggregate", "masked_mean", "masked_sum"]


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over mask==1 entries; 0 (not NaN) where there are none."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a `[B, T]` per-token loss to a scalar (see module doc for the modes)."""
    mask = mask.to(loss_mat.dtype)
    coef = sequence_coefficients(mask.sum(-1), mode, num_tokens, num_seqs, horizon or loss_mat.shape[-1])
    return (coef * masked_sum(loss_mat, mask, dim=-1)).sum()
