"""PPO with a learned value function: generalized advantage estimation (GAE, Schulman et al. 2016,
arXiv 1506.02438), the clipped value loss, whitening and explained variance.

Tensors are padded `[B, T]`; `mask` is 1 on the response tokens the policy sampled. A token with mask 0
inside a response (an observation of a multi-turn trajectory) takes no part: its value and TD error do
not enter, and the recursion carries over it from the next sampled token to the previous one:

  delta_t = r_t + gamma * V_next(t) - V_t,   A_t = delta_t + gamma * lam * A_next(t),   returns_t = A_t + V_t

with next(t) the next token of the sample with mask 1 (V_next = A_next = 0 after the last one: the episode
ends). Rewards belong on mask-1 tokens (the outcome reward on the last response token).
"""

from __future__ import annotations

import torch

from moe_rl.objectives.aggregation import aggregate, masked_mean
from moe_rl.objectives.registry import ADVANTAGES


@torch.no_grad()
def gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both `[B, T]` and 0 where mask is 0; advantages are not whitened."""
    if not token_rewards.shape == values.shape == mask.shape or values.dim() != 2:
        raise ValueError(
            f"shape mismatch: token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)}, "
            f"mask {tuple(mask.shape)} must all be [B, T]"
        )
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma={gamma} and lam={lam} must be in [0, 1]")
    values, rewards, keep = values.double(), token_rewards.double(), mask > 0
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_advantage
        k = keep[:, t]
        advantages[:, t] = torch.where(k, a, 0.0)
        next_value = torch.where(k, values[:, t], next_value)
        next_advantage = torch.where(k, a, next_advantage)
    returns = torch.where(keep, advantages + values, 0.0)
    return advantages.to(token_rewards.dtype), returns.to(token_rewards.dtype)


@ADVANTAGES.register("gae", needs_values=True)
def gae(
    rewards: torch.Tensor, group_size: int, *, mask: torch.Tensor, values: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: (advantages, returns), [B, T], from each sample's reward `rewards` [B] on its last
    response token and the critic's `values` [B, T] by GAE over the response (not whitened; groups ignored)."""
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # each sample's last response token
    token_rewards = torch.zeros_like(values)
    token_rewards[torch.arange(len(rewards)), last] = rewards.to(values.dtype) * (mask.sum(-1) > 0)
    return gae_advantages(token_rewards, values, mask, gamma, lam)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, mean=None, var=None, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over mask-1 entries (0 elsewhere); `mean`/`var` default to this batch's
    (pass the global batch's when it is split over ranks)."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m) if mean is None else mean
    var = masked_mean((x - mean) ** 2, m) if var is None else var
    return (x - mean) * torch.rsqrt(torch.as_tensor(var, dtype=x.dtype) + eps) * m


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None,
    agg: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * aggregate(max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2)) (PPO's clipped value
    loss; `clip` None: unclipped). metrics: vf_clipfrac (masked share of tokens where the clipped error is
    the larger), value_loss (its token mean), values_mean, returns_mean (detached)."""
    if not values.shape == old_values.shape == returns.shape == mask.shape:
        raise ValueError(
            f"shape mismatch: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, returns "
            f"{tuple(returns.shape)}, mask {tuple(mask.shape)}"
        )
    if clip is not None and clip <= 0:
        raise ValueError(f"value clip {clip} must be > 0 (or None)")
    m = mask.to(values.dtype)
    unclipped = (values - returns) ** 2
    if clip is None:
        worst, clipped_larger = unclipped, torch.zeros_like(unclipped)
    else:
        clipped = (old_values + (values - old_values).clamp(-clip, clip) - returns) ** 2
        worst, clipped_larger = torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)
    loss = 0.5 * aggregate(worst, m, agg, **agg_kwargs)
    metrics = {
        "value_loss": 0.5 * masked_mean(worst.detach(), m),  # token mean, whatever `agg`
        "vf_clipfrac": masked_mean(clipped_larger, m).detach(),
        "values_mean": masked_mean(values.detach(), m),
        "returns_mean": masked_mean(returns, m),
    }
    return loss, metrics


def value_stats(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, reduce=None) -> dict[str, float]:
    """explained_variance = 1 - Var(returns - values) / Var(returns) over mask-1 tokens (1: the critic explains
    the returns; 0: no better than their mean; NaN when the returns do not vary), values_mean and returns_mean.
    From token means of the moments; `reduce(means, token counts)` turns this rank's into the global batch's
    (common.distributed.global_mean; None: this batch's)."""
    n = float(mask.sum())
    means = {
        "returns": masked_mean(returns, mask),
        "returns_sq": masked_mean(returns**2, mask),
        "values": masked_mean(values, mask),
        "residual": masked_mean(returns - values, mask),
        "residual_sq": masked_mean((returns - values) ** 2, mask),
    }
    g = {k: float(x) for k, x in means.items()}
    if reduce is not None:
        g = reduce(g, dict.fromkeys(g, n))
    var_returns = g["returns_sq"] - g["returns"] ** 2
    var_residual = g["residual_sq"] - g["residual"] ** 2
    return {
        "explained_variance": 1 - var_residual / var_returns if var_returns > 0 else float("nan"),
        "values_mean": g["values"],
        "returns_mean": g["returns"],
    }
