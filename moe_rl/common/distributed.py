"""Collective helpers for small host-side values, used by every part (the actor, the rollout sources, the weight
sync, the trainer): maxima, object gathers, token-weighted means, and byte-bounded buckets."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist


def world_max(*values: int) -> list[int]:
    """Max over all ranks (one all-reduce). Used for the padded length (data-parallel ranks that
    share an expert-parallel group must pad to one sequence length: megatron's token dispatchers
    exchange equal-sized blocks) and for flags every rank must agree on."""
    t = torch.tensor(values, dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_objects(obj, group=None) -> list:
    """Every rank's `obj` (picklable; small metadata only), in rank order of `group` (default: the world)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def global_sums(values: list[float]) -> list[float]:
    """Each value summed over the data-parallel and context-parallel ranks, in one all-reduce (float64; counts
    stay exact). The CP ranks share their samples, so a count of them is CP times the samples' (megatron's
    schedule multiplies each loss by CP, which cancels it: actor/context_parallel.py)."""
    from megatron.core import parallel_state as ps  # the data-parallel group (megatron is the actor's, not a need here)

    t = torch.tensor(values, dtype=torch.float64)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def loss_counts(masks: list[torch.Tensor]) -> list[dict[str, float]]:
    """The loss normalisers of each mini-batch's loss mask `[b, T]` over the data-parallel ranks: num_tokens (its
    1s) and num_seqs (rows with any), for all mini-batches in one all-reduce."""
    local = [float(x) for m in masks for x in (m.sum(), (m.sum(-1) > 0).sum())]
    total = global_sums(local)
    return [{"num_tokens": total[2 * i], "num_seqs": total[2 * i + 1]} for i in range(len(masks))]


def global_mean(values: dict[str, float], weights: dict[str, float]) -> dict[str, float]:
    """Each value (a mean over this rank's `weights[key]` tokens or sequences) as the mean over the
    data-parallel ranks' tokens or sequences: one all-reduce of the weighted sums and the weights."""
    keys = list(values)
    sums = global_sums([values[k] * weights[k] for k in keys] + [weights[k] for k in keys])
    return {k: n / d if d > 0 else 0.0 for k, n, d in zip(keys, sums[: len(keys)], sums[len(keys) :], strict=True)}


def tensor_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a tensor of this shape and dtype name ("float32", "bfloat16", ...)."""
    return math.prod(shape) * getattr(torch, dtype).itemsize


def buckets(items: Iterable, limit: int, size) -> Iterator[list]:
    """Consecutive items of at most `limit` bytes in all (`size(item)`; a larger item travels alone)."""
    bucket, total = [], 0
    for item in items:
        n = size(item)
        if bucket and total + n > limit:
            yield bucket
            bucket, total = [], 0
        bucket.append(item)
        total += n
    if bucket:
        yield bucket
