"""Sequence-level advantages from scalar rewards (one per sample).

Samples of one prompt are contiguous: rewards[g * group_size : (g + 1) * group_size].
"""

from __future__ import annotations

import torch

from moe_rl.objectives.registry import ADVANTAGES

EPS = 1e-6


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a whole number of groups of {group_size}")
    return rewards.float().view(-1, group_size)


@ADVANTAGES.register("grpo", needs_groups=True)  # all-zero with groups of one
def grpo_advantages(rewards: torch.Tensor, group_size: int, norm_by_std: bool = True) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std(group) + 1e-6); Dr.GRPO (`norm_by_std=False`) drops the std.

    std is the unbiased sample std (torch default, as GRPO implementations use); a group of one
    has advantage 0, a zero-variance group has advantage 0 (not NaN).
    """
    g = _groups(rewards, group_size)
    centered = g - g.mean(dim=1, keepdim=True)
    if norm_by_std:
        std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
        centered = centered / (std + EPS)
    return centered.reshape(-1)


@ADVANTAGES.register("drgrpo", needs_groups=True)  # all-zero with groups of one
def drgrpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO: group-mean baseline without std normalisation."""
    return grpo_advantages(rewards, group_size, norm_by_std=False)


@ADVANTAGES.register("rloo", needs_groups=True)  # all-zero with groups of one
def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: A_i = r_i - mean_{j != i} r_j = n/(n-1) (r_i - mean). Group of one: 0."""
    g = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(g).reshape(-1)
    loo_mean = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - loo_mean).reshape(-1)


@ADVANTAGES.register("reinforce")
def reinforce_advantages(rewards: torch.Tensor, group_size: int = 1) -> torch.Tensor:
    """REINFORCE with a batch-mean baseline: A_i = r_i - mean(r) (groups ignored)."""
    r = _groups(rewards, 1).reshape(-1)
    return r - r.mean()
