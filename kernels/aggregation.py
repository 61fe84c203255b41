"""Loss aggregation as per-sequence coefficients: loss = sum_i c_i * sum_t l_it m_it.

One definition for the padded torch losses (`moe_rl.objectives.aggregation`) and the fused
packed kernels, so both normalise alike. Modes (verl names):

  token-mean               c_i = 1 / num_tokens
  seq-mean-token-mean      c_i = 1 / (n_i * num_seqs)                      [GSPO default]
  seq-mean-token-sum       c_i = 1 / num_seqs
  seq-mean-token-sum-norm  c_i = 1 / (num_seqs * horizon)                   [Dr.GRPO]

n_i is sequence i's token count; c_i = 0 for a sequence without tokens. `num_tokens` /
`num_seqs` default to these sequences' own counts; pass the global counts of a mini-batch that
is split over micro-batches or data-parallel ranks so every token or sequence weighs the same.
"""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def sequence_coefficients(
    tokens_per_seq: torch.Tensor,
    mode: str,
    num_tokens: float | torch.Tensor | None = None,
    num_seqs: float | torch.Tensor | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """c_i for each sequence ([S], dtype of `tokens_per_seq`); see the module doc."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {AGG_MODES}")
    n = tokens_per_seq
    has = (n > 0).to(n.dtype)
    if mode == "token-mean":
        tokens = n.sum() if num_tokens is None else num_tokens
        return has / torch.as_tensor(tokens, dtype=n.dtype, device=n.device).clamp(min=1)
    seqs = has.sum() if num_seqs is None else num_seqs
    seqs = torch.as_tensor(seqs, dtype=n.dtype, device=n.device).clamp(min=1)
    if mode == "seq-mean-token-mean":
        return has / n.clamp(min=1) / seqs
    if mode == "seq-mean-token-sum":
        return has / seqs
    if horizon is None:
        raise ValueError("seq-mean-token-sum-norm needs `horizon` (the maximum response length)")
    return has / seqs / horizon
