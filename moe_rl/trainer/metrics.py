"""A step's metrics: phase times, rewards, lengths, entropy and the training-inference mismatch,
and their reduction over ranks."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist


class Timer:
    """Seconds per phase (`time/<phase>`), summed when a phase runs more than once."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of GRPO groups (group_size consecutive samples) whose rewards are all equal: those
    groups have zero advantage and teach nothing."""
    return float(_flat_groups(rewards, group_size).float().mean())


def _flat_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    groups = rewards.reshape(-1, group_size)
    return (groups == groups[:, :1]).all(dim=1)


def _all_reduce(values: dict[str, float], op) -> dict[str, float]:
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist(), strict=True))


def global_metrics(
    rollout, rewards, old, group_size: int, icepop_band, rank_means: dict[str, float], times: dict[str, float]
) -> dict[str, float]:
    """The step's metrics over the global batch (every rank's samples), with one all-reduce of
    sums and one of maxima. Reductions (docs/metrics.md):
      reward/*, response/length_mean, actor/entropy, mismatch/*: sums and counts of every rank's
        samples and tokens added, then divided (maxima / minima over ranks): the whole batch's value;
      `rank_means` (actor/*, the correction's metrics, router/agreement): mean over ranks of each
        rank's value (every rank holds the same number of samples);
      time/*: the slowest rank's.
    """
    from moe_rl.objectives.metrics import mismatch_from_sums, mismatch_sums

    mask = rollout.padded.loss_mask
    band = (icepop_band.low, icepop_band.high)
    sums, maxima = mismatch_sums(old["logprobs"], rollout.padded.rollout_logprobs, mask, *band)
    sums = {f"mismatch/{k}": float(v) for k, v in sums.items()}
    maxima = {f"mismatch/{k}": float(v) for k, v in maxima.items()}
    sums |= {
        "samples": len(rewards),
        "reward/sum": float(rewards.sum()),
        "groups": len(rewards) // group_size,
        "flat_groups": float(_flat_groups(rewards, group_size).sum()),
        "response/length_sum": float(rollout.response_lengths.sum()),
        "entropy/sum": float((old["entropy"] * mask).sum()),
        "ranks": 1.0,
    }
    sums |= {f"rank_sum/{k}": v for k, v in rank_means.items()}
    maxima |= {"reward/max": float(rewards.max())} | times
    sums, maxima = _all_reduce(sums, dist.ReduceOp.SUM), _all_reduce(maxima, dist.ReduceOp.MAX)
    mm = mismatch_from_sums(
        {k[9:]: torch.tensor(v) for k, v in sums.items() if k.startswith("mismatch/")},
        {k[9:]: torch.tensor(v) for k, v in maxima.items() if k.startswith("mismatch/")},
    )
    out = {k: v / sums["ranks"] for k, v in ((k[9:], v) for k, v in sums.items() if k.startswith("rank_sum/"))}
    out |= {
        "reward/mean": sums["reward/sum"] / sums["samples"],
        "reward/max": maxima["reward/max"],
        "reward/zero_variance_groups": sums["flat_groups"] / sums["groups"],
        "response/length_mean": sums["response/length_sum"] / sums["samples"],
        "actor/entropy": sums["entropy/sum"] / max(sums["mismatch/tokens"], 1.0),
    }
    out |= {f"mismatch/{k}": float(v) for k, v in mm.items()}
    out |= {k: v for k, v in maxima.items() if k.startswith("time/")}
    return out
