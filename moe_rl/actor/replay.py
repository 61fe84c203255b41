"""Routing replay in the Megatron actor (R3: rollout routes; R2: routes recorded by the actor).

megatron-core's routers call `router.router_replay.get_replay_topk(...)` for their top-k
selection. We install our own `RouterHook` on *this model's* routers instead of using
megatron's `RouterReplay`, whose instances live in one process-global list in construction
order (a second model in the process would shift the mapping) and whose recompute path needs
a global action switch. Each hook keeps FIFO queues:

- forward: one target per micro-batch, consumed in the schedule's forward order;
- recompute: a forward that runs inside activation checkpointing (megatron's
  `is_checkpointing()` without grad) re-queues its target, and the recompute in the backward
  pass (`is_checkpointing()` with grad) consumes it again, in the order the schedule runs
  backwards (FIFO per router: 1F1B and interleaved schedules run each chunk's backward passes
  in forward order).

On exit every queue must be empty: every route was used exactly once (else `RouteError`).
Replay replaces only the top-k selection; probabilities are gathered from the live scores,
so the router still gets gradients.

Under tensor (sequence) and context parallelism a pipeline stage's ranks of one data-parallel rank see
different positions of the same samples. Only the first of them (TP rank 0, CP rank 0: `holds_routes`) holds
the samples' routes; at the start of each pass it cuts every rank's positions out of each micro-batch and
sends them (`RouteShare`). The others carry zero-width `[B, 0, L_moe, K]` routes in their place and never
hold more than their own positions of one pass. R2's recordings are gathered on that rank the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.actor.forward import MicroBatch
from moe_rl.actor.routers import model_routers
from moe_rl.common.distributed import all_gather_objects
from moe_rl.routing.compare import route_sets_differ, routed_positions
from moe_rl.routing.layout import rank_positions, slice_sequence, to_router_order
from moe_rl.routing.records import RouteError, filler_row, missing_rows, route_dtype

REPLAY_MODES = ("r3", "r2", "off")


def check_replay_supported(config) -> None:
    """Refuse router settings under which replay would be skipped or undone silently."""
    problems = []
    if getattr(config, "moe_router_fusion", False):
        problems.append("moe_router_fusion=True (Transformer Engine's fused top-k never calls the replay hook)")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append(
            f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping after "
            "replay would route tokens differently from the rollout)"
        )
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        problems.append("moe_router_load_balancing_type='sinkhorn' (bypasses the top-k hook)")
    if problems:
        raise ValueError("routing replay cannot be used with " + "; ".join(problems))


def rank_moe_layers(chunks: list[torch.nn.Module], moe_layers: list[int]) -> list[int]:
    """The MoE layers whose routers are on this rank (its pipeline stage's), in route-column order: the route
    columns this rank receives, replays and records (all of `moe_layers` without pipeline parallelism)."""
    mine = {layer for layer, _ in model_routers(chunks)}
    return [layer for layer in moe_layers if layer in mine]


class RouterHook:
    """Stands in for `router.router_replay` on one router: idle, record or replay."""

    def __init__(self, layer: int, router: torch.nn.Module):
        self.layer = layer
        self.mode = "idle"
        self.forward_q: deque[torch.Tensor] = deque()
        self.recompute_q: deque[torch.Tensor] = deque()
        self.recorded: list[torch.Tensor] = []
        self.verify: bool | str = False  # True: raise on a dispatch mismatch; "count": only count
        self.checked = 0  # token rows dispatched under replay and compared with their target
        self.mismatched = 0  # ... of which went to other experts than the replayed ones
        self.last_target: torch.Tensor | None = None
        self.recomputes = 0  # targets replayed by activation recompute (for tests and logs)
        router.register_forward_hook(self._verify_hook)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        # heavy: megatron-core, imported on first use
        from megatron.core.tensor_parallel.random import is_checkpointing

        if self.mode == "record":
            probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            if not (is_checkpointing() and torch.is_grad_enabled()):
                self.recorded.append(idx.detach().clone())
            return probs, idx
        if self.mode != "replay":
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        recompute = is_checkpointing() and torch.is_grad_enabled()
        queue = self.recompute_q if recompute else self.forward_q
        if not queue:
            raise RouteError(
                f"MoE layer {self.layer}: a {'recompute' if recompute else 'forward'} pass found no "
                "routes to replay (more forwards than micro-batches given?)"
            )
        target = queue.popleft()
        self.recomputes += recompute
        if not recompute and is_checkpointing():
            self.recompute_q.append(target)
        if target.shape != (scores.shape[0], topk):
            raise RouteError(
                f"MoE layer {self.layer}: replay target {tuple(target.shape)} does not match "
                f"{scores.shape[0]} tokens x top-{topk} at this router"
            )
        idx = target.to(scores.device, torch.long)  # queued in the routes' narrow dtype
        live = missing_rows(target)  # no recorded route (multi-turn missing_routes=live); on the host: no device sync
        if live.any():
            _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            idx = torch.where(live.to(scores.device)[:, None], own, idx)
        self.last_target = idx
        return scores.gather(1, idx), idx

    def _verify_hook(self, _module, _inputs, output) -> None:
        if not (self.verify and self.mode == "replay" and self.last_target is not None):
            return
        routing_map = output[1]
        expected = torch.zeros_like(routing_map, dtype=torch.bool).scatter(1, self.last_target, True)
        bad = int((routing_map.bool() != expected).any(-1).sum())
        self.checked += routing_map.shape[0]
        self.mismatched += bad
        if bad and self.verify is True:
            raise RouteError(
                f"MoE layer {self.layer}: {bad} tokens were dispatched to experts other than the "
                "replayed ones (token dropping or a routing path that ignores replay?)"
            )


def install_hook(layer: int, router: torch.nn.Module, verify: bool | str = False) -> RouterHook:
    """This router's hook (installed once; megatron's own RouterReplay, if any, is replaced).

    Not a patch, so it stays here rather than in moe_rl/compat/: `router.router_replay` is the
    slot megatron's top-k (`moe_utils.topk_routing_with_score_function`) consults, and
    RouterHook answers its `get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)`.
    """
    hook = router.router_replay if isinstance(router.router_replay, RouterHook) else RouterHook(layer, router)
    hook.verify = verify
    router.router_replay = hook
    return hook


@contextmanager
def record_topk(chunks: list[torch.nn.Module]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record each router's top-k ids for every forward inside the block.

    Yields {global layer: [ids per forward]}; ids are `[tokens, K]` in megatron's token order
    (`s * B + b` over this rank's sequence slice).
    """
    hooks = [install_hook(layer, router) for layer, router in model_routers(chunks)]
    recorded: dict[int, list[torch.Tensor]] = {h.layer: h.recorded for h in hooks}
    for h in hooks:
        h.recorded.clear()
        h.mode = "record"
    try:
        yield recorded
    finally:
        for h in hooks:
            h.mode = "idle"


def holds_routes() -> bool:
    """Whether this rank holds its data-parallel rank's routes for its pipeline stage; the source sends routes to
    these ranks only."""
    return _holds(_rank_layout())


def _holds(layout: dict) -> bool:
    """The route holder of a tensor x context-parallel group: its TP rank 0, CP rank 0."""
    return layout["tp_rank"] == layout["cp_rank"] == 0


def _rank_layout() -> dict:
    """This rank's place in the positions of a micro-batch (routing.layout.rank_positions' arguments)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    return dict(
        tp=tp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        cp=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        sequence_parallel=tp > 1,
    )


@dataclass(frozen=True)
class RouteShare:
    """The ranks that see positions of the same samples in one pipeline stage (its tensor x context-parallel
    group) and which of them holds the routes. Build with `route_share` (collective over that group)."""

    group: dist.ProcessGroup | None  # None: this rank alone
    ranks: list[int]  # global ranks, in group order
    layouts: list[dict]  # each group rank's `_rank_layout()`, in group order
    me: int  # this rank's index in `ranks`

    @property
    def holder(self) -> int:
        """Global rank of the routes' holder."""
        return self.ranks[next(i for i, lay in enumerate(self.layouts) if _holds(lay))]

    @property
    def is_holder(self) -> bool:
        return self.ranks[self.me] == self.holder

    def scatter(self, per_rank: Callable[[dict], object]):
        """On the holder, `per_rank(layout)` for every rank of the group, each sent to its rank; returns this
        rank's (peers never call `per_rank`)."""
        if self.group is None:
            return per_rank(self.layouts[0])
        out = [None]
        items = [per_rank(lay) for lay in self.layouts] if self.is_holder else None
        dist.scatter_object_list(out, items, src=self.holder, group=self.group)
        return out[0]

    def from_holder(self, value: Callable[[], object]):
        """`value()` computed on the holder, returned on every rank of the group."""
        if self.group is None:
            return value()
        box = [value() if self.is_holder else None]
        dist.broadcast_object_list(box, src=self.holder, group=self.group)
        return box[0]


def route_share() -> RouteShare:
    """This rank's RouteShare. Collective over its tensor x context-parallel group (when that has several)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    layout = _rank_layout()
    group = ps.get_tensor_and_context_parallel_group()
    if dist.get_world_size(group) == 1:
        return RouteShare(None, [dist.get_rank()], [layout], 0)
    ranks = dist.get_process_group_ranks(group)
    return RouteShare(group, ranks, all_gather_objects(layout, group), ranks.index(dist.get_rank()))


class RouteReplay:
    """Replay / record controller bound to one model's routers.

    chunks: this rank's model chunks; moe_layers: decoder layer of each route column.
    verify: check after each replayed router that tokens were dispatched to exactly the replayed
    experts; True raises RouteError on a difference, "count" only counts (`dispatch_check`).
    """

    def __init__(self, chunks: list[torch.nn.Module], moe_layers: list[int], verify: bool | str = False):
        check_replay_supported(chunks[0].config)
        self.moe_layers = list(moe_layers)
        self.col = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.hooks: list[RouterHook] = []
        for layer, router in model_routers(chunks):
            if layer not in self.col:
                raise RouteError(
                    f"decoder layer {layer} has a router but is not in the route record's MoE layers {self.moe_layers}"
                )
            self.hooks.append(install_hook(layer, router, verify))
        self.topk = chunks[0].config.moe_router_topk
        self.num_experts = chunks[0].config.num_moe_experts
        self._share: RouteShare | None = None

    def dispatch_check(self, reset: bool = False) -> tuple[int, int]:
        """(token-layer rows checked, rows dispatched elsewhere than replayed) on this rank."""
        out = (sum(h.checked for h in self.hooks), sum(h.mismatched for h in self.hooks))
        if reset:
            for h in self.hooks:
                h.checked = h.mismatched = 0
        return out

    # ---- which positions reach which rank ----------------------------------------------------
    @property
    def share(self) -> RouteShare:
        """Built at the first pass (every rank of the group runs it), then kept."""
        if self._share is None:
            self._share = route_share()
        return self._share

    def _targets(self, routes: torch.Tensor, seq_len: int, layout: dict) -> dict[int, torch.Tensor]:
        """Per-layer `[s_local * b, K]` targets (the routes' dtype) of one micro-batch's `[b, T, L_moe, K]` routes,
        at the positions of the rank with `layout`."""
        if routes.dim() != 4 or routes.shape[2] != len(self.moe_layers) or routes.shape[3] != self.topk:
            raise RouteError(
                f"micro-batch routes have shape {tuple(routes.shape)}; expected [b, T, "
                f"{len(self.moe_layers)}, {self.topk}]"
            )
        if routes.shape[1] == 0:
            raise RouteError(
                f"rank {dist.get_rank() if dist.is_initialized() else 0} holds the routes of its tensor/context-"
                "parallel group but was given zero-width routes (those are for the other ranks of the group)"
            )
        if routes.shape[1] < seq_len:  # pad rows: distinct ids, never duplicates
            pad = torch.from_numpy(filler_row(len(self.moe_layers), self.topk, routes.numpy().dtype))
            routes = torch.cat([routes, pad.expand(routes.shape[0], seq_len - routes.shape[1], -1, -1)], dim=1)
        elif routes.shape[1] > seq_len:
            raise RouteError(f"routes have {routes.shape[1]} positions for a {seq_len}-token micro-batch")
        local = slice_sequence(routes, rank_positions(seq_len, **layout))
        return {h.layer: to_router_order(local[:, :, self.col[h.layer]]) for h in self.hooks}

    # ---- replay ---------------------------------------------------------------------------
    @contextmanager
    def replay(self, microbatches: list[MicroBatch], key: str = "routes") -> Iterator[None]:
        """Replay `mb.extra[key]` ([b, T, L_moe, K], host) for each micro-batch, in order. Collective over the
        tensor x context-parallel group: its route holder sends each rank its positions; the others' routes
        (zero-width) are not read."""
        for mb in microbatches:
            if key not in mb.extra:
                raise RouteError(f"micro-batch {mb.index.tolist()} carries no {key!r} to replay")
        per_mb = self.share.scatter(
            lambda layout: [self._targets(mb.extra[key], mb.input_ids.shape[1], layout) for mb in microbatches]
        )
        for targets in per_mb:
            for h in self.hooks:
                h.forward_q.append(targets[h.layer])
        for h in self.hooks:
            h.mode = "replay"
        ok = False
        try:
            yield
            ok = True
        finally:
            left = {h.layer: (len(h.forward_q), len(h.recompute_q)) for h in self.hooks if h.forward_q or h.recompute_q}
            for h in self.hooks:
                h.mode, h.last_target = "idle", None
                h.forward_q.clear()
                h.recompute_q.clear()
            if ok and left:
                raise RouteError(f"routes not consumed exactly once: layer -> (forward, recompute) left {left}")

    # ---- record (R2) ----------------------------------------------------------------------
    @contextmanager
    def record(self, microbatches: list[MicroBatch], num_samples: int, length: int) -> Iterator[dict]:
        """Record this model's top-k for the micro-batches run inside the block.

        Yields a dict whose "routes" entry (set on exit) is a host `[num_samples, >= length, L_moe, K]`
        array holding this rank's layers (other layers hold filler ids), gathered over
        sequence/context-parallel ranks on their route holder (zero-width on the others) and unpacked
        per sample (packed micro-batches), so it can be re-sliced for any later micro-batching.
        """
        for h in self.hooks:
            h.recorded.clear()
            h.mode = "record"
        out: dict = {}
        try:
            yield out
        finally:
            for h in self.hooks:
                h.mode = "idle"
        out["routes"] = self._assemble(microbatches, num_samples, length)

    def _assemble(self, microbatches: list[MicroBatch], num_samples: int, length: int) -> np.ndarray:
        """On the route holder, every rank's recorded positions; elsewhere zero-width (see the module doc)."""
        dtype, share = route_dtype(self.num_experts), self.share
        mine = []  # (micro-batch number, layer col, [rows, s_local, K])
        for h in self.hooks:
            if len(h.recorded) != len(microbatches):
                raise RouteError(
                    f"MoE layer {h.layer}: recorded {len(h.recorded)} forwards for {len(microbatches)} micro-batches"
                )
            for number, (mb, ids) in enumerate(zip(microbatches, h.recorded, strict=True)):
                rows, seq_len = mb.input_ids.shape
                local_pos = rank_positions(seq_len, **share.layouts[share.me])
                local = ids.reshape(len(local_pos), rows, self.topk).transpose(0, 1).cpu().numpy().astype(dtype)
                mine.append((number, self.col[h.layer], local))
            h.recorded.clear()
        parts = [mine]
        if share.group is not None:
            parts = [None] * len(share.ranks) if share.is_holder else None
            dist.gather_object(mine, parts, dst=share.holder, group=share.group)
        if not share.is_holder:
            return np.empty((num_samples, 0, len(self.moe_layers), self.topk), dtype=dtype)
        width = length if microbatches[0].pack is not None else microbatches[0].input_ids.shape[1]
        full = np.empty((num_samples, width, len(self.moe_layers), self.topk), dtype=dtype)
        full[:] = filler_row(len(self.moe_layers), self.topk, dtype)
        for layout, entries in zip(share.layouts, parts, strict=True):
            for number, col, ids in entries:
                mb = microbatches[number]
                pos = rank_positions(mb.input_ids.shape[1], **layout)
                if mb.pack is None:
                    full[np.ix_(mb.index.numpy(), pos, [col])] = ids[:, :, None, :]
                    continue
                sample = mb.pack.sample.numpy()[pos]  # packed positions -> (sample, position)
                real = sample >= 0
                rows = mb.index.numpy()[sample[real]]
                full[rows, mb.pack.position.numpy()[pos][real], col] = ids[0, real]
        return full


def router_agreement(replay, padded, routes: torch.Tensor) -> float:
    """Fraction of (token, MoE layer) pairs where `routes` (recorded by `replay`, a RouteReplay: the layers
    of this rank) pick the same expert set as the rollout engine's `padded.routes` (real tokens but the last).
    Computed by the route holder of the tensor/context-parallel group, which has both (collective over it)."""

    def agreement() -> float:
        cols = sorted({replay.col[h.layer] for h in replay.hooks})
        valid = routed_positions(padded.attention_mask)
        engine = padded.routes[:, :, cols][valid]
        differ, _ = route_sets_differ(routes[:, :, cols][valid], engine)
        recorded = ~missing_rows(engine)  # rows without an engine route (multi-turn missing_routes=live) do not count
        agree = ~differ if recorded.all() else (~differ)[recorded]
        return float(agree.float().mean()) if agree.numel() else 1.0

    return replay.share.from_holder(agreement)
