"""This model's own MoE routers, in decoder order.

Binds to the `TopKRouter` modules of the given model chunks, never to megatron-core's
process-global `RouterReplay.global_router_replay_instances` list (a second model built in
the same process would shift that list).
"""

from __future__ import annotations

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
