"""Supervised fine-tuning's loss: next-token cross-entropy on the response tokens."""

from __future__ import annotations

import torch

from moe_rl.objectives.aggregation import masked_mean
from moe_rl.objectives.policy_loss import LossInputs


def nll_loss(logp: torch.Tensor, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sum(log p of each target token) / `x.num_tokens` over the tokens of `x.mask` ([b, T], aligned with `logp`:
    entry t scores token t). `x.num_tokens` counts the whole batch over every data-parallel rank, so the loss is the
    global token mean whatever the micro-batch and data-parallel split. Metric `nll`: this micro-batch's token mean
    (the trainer weighs micro-batches by their tokens)."""
    mask = x.mask.to(logp.dtype)
    loss = -(logp * mask).sum() / max(x.num_tokens, 1.0)
    return loss, {"nll": masked_mean(-logp.detach(), mask)}
