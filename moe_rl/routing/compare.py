"""Comparing two route records of the same tokens (engine vs actor), as sets of experts."""

from __future__ import annotations

import torch


def routed_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: real tokens except each sequence's last one (the engine routes no more)."""
    valid = attention_mask.bool().clone()
    valid[torch.arange(valid.shape[0]), attention_mask.sum(1) - 1] = False
    return valid


def route_sets_differ(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For [..., K] expert ids: (sets differ [...] bool, |a \\ b| [...] long)."""
    a, b = a.long(), b.long()
    in_b = (a.unsqueeze(-1) == b.unsqueeze(-2)).any(-1)  # [..., K]: a's expert also chosen in b
    missing = (~in_b).sum(-1)
    return missing > 0, missing
