"""This model's own MoE routers, in decoder order, and recording of their top-k choices.

Binds to the `TopKRouter` modules of the given model chunks, never to megatron-core's
process-global `RouterReplay.global_router_replay_instances` list (a second model built in
the same process would shift that list).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def model_routers(chunks: list[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
    """(global decoder layer index, router) for every MoE layer on this rank, in layer order."""
    out = []
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                out.append((layer.layer_number - 1, router))
    return sorted(out, key=lambda x: x[0])


@contextmanager
def record_topk(chunks: list[torch.nn.Module]) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Record each router's top-k ids for every forward inside the block.

    Yields {global layer: [ids per forward]}; ids are [tokens, K] in megatron's token order
    (`s * B + b` over this rank's sequence slice). Needs routers built with routing replay.
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    recorded: dict[int, list[torch.Tensor]] = {}
    routers = model_routers(chunks)
    originals = []
    for layer, router in routers:
        rr = router.router_replay
        if rr is None:
            raise RuntimeError("routers were built without routing replay (model option router_replay=false)")
        recorded[layer] = []
        originals.append((rr, rr.record_indices))

        def record(ids, _store=recorded[layer], _rr=rr):
            _rr.recorded_topk_idx = ids
            _store.append(ids.detach().clone())

        rr.record_indices = record
        rr.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield recorded
    finally:
        for rr, orig in originals:
            rr.record_indices = orig
            rr.clear_router_replay_action()
