"""What-if plans: features that the layouts peers publish for the largest models rely on and moe-rl lacks.

`moe-rl-plan --assume NAME` plans as if moe-rl had NAME; the trainer itself refuses such a layout or does not do
it, and every plan made so says which assumptions it rests on. docs/guides/planning.md sets them beside the peers'
published layouts.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

ASSUMPTIONS = {
    "engine-across-nodes": (
        "an engine's tensor parallelism spans nodes: rollout.tensor_parallel_size 16, 32 or 64 (vLLM over Ray, as "
        "verl's vLLM TP32 for DeepSeek-V3); moe-rl's engine workers share their leader's node (TP <= 8)"
    ),
    "trainer-offload": (
        "the trainer's parameters, gradients and optimizer states leave the GPU while its colocated engine generates, "
        "and the engine sleeps while the trainer trains (verl's param/grad/optimizer offload, slime's --colocate); "
        "moe-rl's trainer keeps its states on the GPU"
    ),
}
"""Name -> what it assumes, who relies on it, and what moe-rl does instead."""

BUILT = {
    "optimizer-offload": (
        "moe-rl has it now: set actor.optimizer_offload.fraction=1 (with actor.distributed_optimizer=true)"
    ),
}
"""Former assumptions that are features now -> the setting that plans them."""

ENGINE_TP_ACROSS_NODES = (16, 32, 64)  # engine TPs the search adds with engine-across-nodes


def describe(assumed: Iterable[str]) -> list[str]:
    """Each assumption and what it means, wrapped to 118 columns, for the plan's text and --help."""
    return [
        textwrap.fill(f"{name}: {ASSUMPTIONS[name]}", 118, initial_indent="  ", subsequent_indent="    ")
        for name in sorted(assumed)
    ]
