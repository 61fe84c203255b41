"""A step's metrics: phase times, peak memory, rewards, lengths, entropy and the
training-inference mismatch, and their reduction over ranks."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from moe_rl.common import progress
from moe_rl.common.distributed import all_gather_objects
from moe_rl.objectives.metrics import mismatch_from_sums, mismatch_sums
from moe_rl.reward import combine


class Timer:
    """Seconds per phase (`time/<phase>`), summed when a phase runs more than once."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        progress.mark(phase)
        t0 = time.perf_counter()
        yield
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


class PeakMemory:
    """This process's peak memory during a step (the trainer's; engines run in processes of their own).

    RSS: the kernel's high-water mark (VmHWM), reset at the start of the step by writing 5 to
    /proc/self/clear_refs. Where the reset is refused the mark is the process's lifetime peak;
    `resettable` says which (the trainer warns once). CUDA: torch's peak allocated bytes.
    """

    def __init__(self):
        self.resettable = True

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.resettable = False
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def read(self) -> dict[str, float]:
        with open("/proc/self/status") as f:
            hwm_kib = int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1))
        out = {"memory/peak_rss_gib": hwm_kib / 2**20}
        if torch.cuda.is_available():
            out["memory/peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of GRPO groups (group_size consecutive samples) whose rewards are all equal: those
    groups have zero advantage and teach nothing."""
    groups = rewards.reshape(-1, group_size)
    return float((groups == groups[:, :1]).all(dim=1).float().mean())


def _all_reduce(values: dict[str, float], op) -> dict[str, float]:
    if not values or not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist(), strict=True))


def reward_metrics(parts: list[tuple[dict, dict]]) -> dict[str, float]:
    """The step's reward metrics over every data-parallel rank (collective): reward/<function>/mean and extras,
    reward/<data_source>/mean, reward/timeouts and reward/errors, from the (totals, counts) each scoring rank holds
    (trainer.reward.Rewarder.take; one scorer per data-parallel replica, so nothing is counted twice). Gathered as
    objects: the data sources, and so the keys, differ per rank."""
    every = [p for rank_parts in all_gather_objects(parts) for p in rank_parts]
    return combine(every) if every else {}


def global_metrics(
    rollout, rewards, old, group_size: int, icepop_band, rank_means: dict[str, float], peaks: dict[str, float]
) -> dict[str, float]:
    """The step's metrics over the global batch (every rank's samples), with one all-reduce of
    sums and one of maxima. Reductions (docs/reference/metrics.md):
      reward/*, response/length_mean, actor/entropy, mismatch/*: sums and counts of every rank's
        samples and tokens added, then divided (maxima / minima over ranks): the whole batch's value;
      `rank_means` (actor/*, the correction's metrics, router/agreement) and
        reward/zero_variance_groups: mean over ranks of each rank's value (every rank holds the same
        number of samples and groups; the actor's loss and correction metrics arrive already global,
        token-weighted over the data-parallel ranks);
      `peaks` (time/*, memory/*, weight_sync/*): the largest rank's (the slowest, the most memory).
    """
    mask = rollout.padded.loss_mask
    band = (icepop_band.low, icepop_band.high)
    sums, maxima = mismatch_sums(old.logprobs, rollout.padded.rollout_logprobs, mask, *band)
    sums = {f"mismatch/{k}": float(v) for k, v in sums.items()}
    maxima = {f"mismatch/{k}": float(v) for k, v in maxima.items()}
    sums |= {
        "samples": len(rewards),
        "reward/sum": float(rewards.sum()),
        "response/length_sum": float(rollout.response_lengths.sum()),
        "entropy/sum": float((old.entropy * mask).sum()),
    }
    rank_means = rank_means | {"reward/zero_variance_groups": zero_variance_fraction(rewards, group_size)}
    sums |= {f"rank_sum/{k}": v for k, v in rank_means.items()}
    if rollout.truncated is not None:
        sums["response/truncated"] = float(rollout.truncated.sum())
    maxima |= {"reward/max": float(rewards.max()), "response/length_max": float(rollout.response_lengths.max())}
    maxima |= peaks
    sums, maxima = _all_reduce(sums, dist.ReduceOp.SUM), _all_reduce(maxima, dist.ReduceOp.MAX)
    mm = mismatch_from_sums(
        {k[9:]: torch.tensor(v) for k, v in sums.items() if k.startswith("mismatch/")},
        {k[9:]: torch.tensor(v) for k, v in maxima.items() if k.startswith("mismatch/")},
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    out = {k: sums[f"rank_sum/{k}"] / world for k in rank_means}
    out |= {
        "reward/mean": sums["reward/sum"] / sums["samples"],
        "reward/max": maxima["reward/max"],
        "response/length_mean": sums["response/length_sum"] / sums["samples"],
        "response/length_max": maxima["response/length_max"],
        "actor/entropy": sums["entropy/sum"] / max(sums["mismatch/tokens"], 1.0),
    }
    if "response/truncated" in sums:
        out["response/clip_ratio"] = sums["response/truncated"] / sums["samples"]
    out |= {f"mismatch/{k}": float(v) for k, v in mm.items()}
    out |= {k: maxima[k] for k in peaks}
    return out


def staleness_metrics(rollout, step: int, max_lag: int, dropped: int = 0) -> dict[str, float]:
    """How many actor versions the step's samples lag the actor (at `step`) that trains on them, over every rank's
    samples (collective): staleness/mean and staleness/max per sample (an in-flight sample's: its oldest token's);
    rollout/version_lag_mean, rollout/version_lag_max and rollout/version_lag_share_<k> (k = 0..`max_lag`, the share
    of response tokens k versions old) per response token; rollout/dropped_fraction, the share of the finished
    samples that were dropped as too stale (`dropped`: this rank's since its last step) and sampled again."""
    mask = rollout.padded.loss_mask > 0
    versions = rollout.versions
    if versions is None:  # one version per sample
        versions = rollout.policy_version[:, None].expand(mask.shape)
    lag = (step - versions)[mask]
    per_sample = step - rollout.policy_version
    counts = torch.bincount(lag.clamp(min=0), minlength=max_lag + 1)
    sums = {"tokens": mask.sum(), "lag": lag.sum(), "samples": len(per_sample), "sample_lag": per_sample.sum()}
    sums |= {"dropped": dropped} | {f"share_{k}": counts[k] for k in range(max_lag + 1)}
    maxima = {"lag": lag.max() if len(lag) else 0, "sample_lag": per_sample.max()}
    sums = _all_reduce({k: float(v) for k, v in sums.items()}, dist.ReduceOp.SUM)
    maxima = _all_reduce({k: float(v) for k, v in maxima.items()}, dist.ReduceOp.MAX)
    tokens = max(sums["tokens"], 1.0)
    out = {
        "staleness/mean": sums["sample_lag"] / sums["samples"],
        "staleness/max": maxima["sample_lag"],
        "rollout/version_lag_mean": sums["lag"] / tokens,
        "rollout/version_lag_max": maxima["lag"],
        "rollout/dropped_fraction": sums["dropped"] / (sums["dropped"] + sums["samples"]),
    }
    return out | {f"rollout/version_lag_share_{k}": sums[f"share_{k}"] / tokens for k in range(max_lag + 1)}
