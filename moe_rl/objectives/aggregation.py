"""Loss aggregation over a padded `[B, T]` token matrix, and masked reductions.

Modes (verl names):
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

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


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
    if mode == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return masked_sum(loss_mat, mask) / torch.as_tensor(denom, dtype=loss_mat.dtype).clamp(min=1)
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGG_MODES}")
    per_seq_tokens = mask.sum(-1)
    seqs = (per_seq_tokens > 0).sum() if num_seqs is None else num_seqs
    seqs = torch.as_tensor(seqs, dtype=loss_mat.dtype).clamp(min=1)
    seq_sum = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        return (seq_sum / per_seq_tokens.clamp(min=1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return seq_sum.sum() / seqs
    return seq_sum.sum() / seqs / (horizon or loss_mat.shape[-1])
