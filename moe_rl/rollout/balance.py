"""Balance a step's samples over the data-parallel ranks by token count (trainer.balance_batch).

Each rank samples its own prompts, so with long-tailed response lengths one rank can hold far more
tokens than another, and every collective of the step (gradient sync, expert dispatch) waits for the
heaviest. As verl's `_balance_batch` does, whole samples move between ranks before any pass of the
step, here as whole GRPO groups (the n contiguous samples of a prompt), each within its mini-batch: each rank
keeps its group count per mini-batch, computes its groups' advantages as before, and every optimizer
step sees the same samples. The step's results change only by floating-point summation order.
"""

from __future__ import annotations

import io

import torch
import torch.distributed as dist

from moe_rl.common.distributed import all_gather_objects
from moe_rl.rollout.source import Rollout


def assign_groups(costs: list[list[int]]) -> list[list[tuple[int, int]]]:
    """The `(source rank, group)` pairs each rank takes, given every rank's group costs (the same number
    of groups per rank): heaviest group first into the lightest rank with room, a rank's own groups
    preferred on ties; kept as is when that is no better. Each rank's pairs in source order.
    Deterministic: every rank computes the same answer from the same costs."""
    ranks = len(costs)
    per = len(costs[0]) if costs else 0
    if any(len(c) != per for c in costs):
        raise ValueError(f"balance: ranks hold different group counts {[len(c) for c in costs]}")
    items = sorted(((c, s, g) for s, cs in enumerate(costs) for g, c in enumerate(cs)), key=lambda x: (-x[0], x[1:]))
    load, taken = [0] * ranks, [[] for _ in range(ranks)]
    for cost, src, g in items:
        dst = min((r for r in range(ranks) if len(taken[r]) < per), key=lambda r: (load[r], r != src, r))
        taken[dst].append((src, g))
        load[dst] += cost
    if max(load, default=0) >= max((sum(c) for c in costs), default=0):
        return [[(r, g) for g in range(per)] for r in range(ranks)]
    return [sorted(t) for t in taken]


def balance_rollout(
    rollout: Rollout, group_size: int, mini_batches: int = 1, group=None
) -> tuple[Rollout, dict[str, float]]:
    """This rank's share of the data-parallel ranks' samples after balancing (`group`: the data-parallel
    process group; collective over it), and the metrics perf/dp_token_imbalance (max / mean tokens per
    rank, after) and perf/dp_groups_moved. Groups move only within their mini-batch (each rank's rows
    i*b/m .. (i+1)*b/m), so every optimizer step sees the same samples as without balancing."""
    b = rollout.padded.input_ids.shape[0]
    groups = b // group_size
    if b % group_size or groups % mini_batches:
        raise ValueError(
            f"trainer.balance_batch: {b} samples on a rank are not {mini_batches} mini-batches of whole groups of "
            f"sampling.n={group_size}; make data.prompts_per_step a multiple of actor.mini_batches or set "
            "trainer.balance_batch=false"
        )
    tokens = rollout.padded.attention_mask.sum(-1).view(-1, group_size).sum(-1).tolist()
    costs = all_gather_objects(tokens, group)
    world = len(costs)
    per = groups // mini_batches
    plan: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for i in range(mini_batches):
        part = assign_groups([c[i * per : (i + 1) * per] for c in costs])
        for d in range(world):
            plan[d] += [(s, i * per + g) for s, g in part[d]]
    loads = [sum(costs[s][g] for s, g in pairs) for pairs in plan]
    moved = sum(s != d for d, pairs in enumerate(plan) for s, _ in pairs)
    mean = sum(loads) / max(1, len(loads))
    metrics = {"perf/dp_token_imbalance": max(loads) / mean if mean else 1.0, "perf/dp_groups_moved": float(moved)}
    if not moved:  # every rank knows the plan: all skip the exchange
        return rollout, metrics
    me = dist.get_rank(group)
    sends = [_take(rollout, [g for s, g in plan[d] if s == me], group_size) for d in range(world)]
    pieces = {}  # (source rank, group) -> that group alone
    for s, part in enumerate(_all_to_all(sends, group)):
        for j, g in enumerate(g for src, g in plan[me] if src == s):
            pieces[(s, g)] = _take(part, [j], group_size)
    return Rollout.cat([pieces[p] for p in plan[me]]), metrics


def _take(r: Rollout, groups: list[int], group_size: int) -> Rollout:
    """The rollout restricted to `groups` (in that order); prompts re-indexed from 0."""
    return r.select([g * group_size + j for g in groups for j in range(group_size)])


def _all_to_all(objs: list, group) -> list:
    """objs[d] to rank d of `group`; returns what each rank sent here. One size exchange and one
    all_to_all of pickled bytes: each rank sends only the samples that move (not an all-gather)."""
    blobs = []
    for obj in objs:
        buf = io.BytesIO()
        torch.save(obj, buf)
        blobs.append(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8))
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    send_sizes = torch.tensor([len(x) for x in blobs], dtype=torch.long, device=device)
    recv_sizes = torch.empty_like(send_sizes)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    out = torch.empty(int(recv_sizes.sum()), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, torch.cat(blobs).to(device), recv_sizes.tolist(), send_sizes.tolist(), group=group)
    pieces = out.cpu().split(recv_sizes.tolist())
    return [torch.load(io.BytesIO(p.numpy().tobytes()), weights_only=False) for p in pieces]
