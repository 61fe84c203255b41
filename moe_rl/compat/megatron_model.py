"""Reaches into megatron-core's (0.16.x) model classes where the actor needs what no public API gives: a private
function (the routers' expert-bias update) and two forwards replaced on module instances (the output layer for the
fused log-prob kernel, RoPE for packed rows). The callers (actor/train_step.py, actor/forward.py, actor/packing.py)
say why they need each; compat/versions.py lists them with the versions they were written for."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch


def update_router_expert_bias(chunks: list[torch.nn.Module], config) -> None:
    """megatron's `finalize_model_grads._update_router_expert_bias(chunks, config)`: each router's expert bias moved
    towards balanced load from its `local_tokens_per_expert` (summed over TP x CP x DP), as finalize_model_grads does
    after a step. Private in 0.16.x; moe-rl runs its own step, so it calls the update itself."""
    # heavy: megatron-core, imported on first use
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    _update_router_expert_bias(chunks, config)


def output_layers_return_hidden(layers: Iterable[torch.nn.Module], keep_weight: Callable[[torch.Tensor], None]) -> None:
    """Make each of megatron's output layers (ColumnParallelLinear: `forward(input_, weight=None,
    runtime_gather_output=None) -> (output, bias)`) return its input hidden states, gathered over sequence
    parallel, instead of logits, and hand the weight it would have used (its own, or the tied embedding passed as
    `weight`) to `keep_weight`. An instance attribute that shadows the class's forward: `restore_forwards` removes
    it."""
    # heavy: megatron-core, imported on first use
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    def hidden_out(layer):
        def forward(input_, weight=None, runtime_gather_output=None):
            if layer.sequence_parallel:  # the kernel's backward sums dh over TP: only split it back
                input_ = gather_from_sequence_parallel_region(input_, False, group=layer.tp_group)
            keep_weight(layer.weight if weight is None else weight)
            return input_, None

        return forward

    for layer in layers:
        layer.forward = hidden_out(layer)  # instance attribute: shadows the class's forward


def add_to_router_logits(router: torch.nn.Module, add: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Replace `router.gating` (instance attribute) so its logits gain `add(input)` (None: nothing): megatron's
    routers return probabilities and a routing map, and their logits exist only inside `gating`."""
    gating = type(router).gating

    def gating_plus(x: torch.Tensor) -> torch.Tensor:
        logits = gating(router, x)
        extra = add(x)
        return logits if extra is None else logits + extra.to(logits.dtype)

    router.gating = gating_plus


def restore_forwards(modules: Iterable[torch.nn.Module]) -> None:
    """Undo `output_layers_return_hidden`: the class's forward again."""
    for module in modules:
        del module.forward


@contextmanager
def rotary_at_positions(ropes: list[torch.nn.Module], position: torch.Tensor) -> Iterator[None]:
    """Inside the block, each of megatron's RotaryEmbedding modules in `ropes` (`forward(max_seq_len, offset=0,
    packed_seq=False, cp_group=None)` -> table, or (table, mscale) for YarnRotaryEmbedding) returns its table at the
    rows `position` ([S]) instead of rows 0..S-1. The whole table is computed (packed_seq=True: megatron would
    otherwise take this context-parallel rank's rows of it), up to the largest position."""

    def at_positions(rope):
        def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
            # packed_seq=True: the whole table (megatron would take this context-parallel rank's rows of it)
            out = type(rope).forward(rope, int(position.max()) + 1, offset, True, cp_group)
            if isinstance(out, tuple):
                return (out[0][position.to(out[0].device)], *out[1:])
            return out[position.to(out.device)]

        return forward

    for rope in ropes:
        rope.forward = at_positions(rope)  # instance attribute: shadows the class's (cached) forward
    try:
        yield
    finally:
        restore_forwards(ropes)
