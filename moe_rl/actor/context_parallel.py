"""Context parallel (`parallel.cp`) on the local (non-Transformer-Engine) layer spec.

Megatron-core's context-parallel attention is Transformer Engine's ring attention (GPU). This is
the CPU path: every CP rank holds megatron's zig-zag slice of each sequence (chunks r and
2*CP-1-r of 2*CP, `routing.layout.zigzag_indices`); attention gathers the keys and values of the
whole sequence from the CP group and masks by global position, so it is exact (one softmax over
all keys), at O(s/CP x s) scores per head. RoPE is sliced by megatron itself.

The loss is sequence-level (GSPO sums a sample's tokens), so per-token scores are gathered back
to whole sequences (`gather_sequence`) and every CP rank computes the same loss; each rank's
backward then flows through its own positions only, and the data x context-parallel gradient sum
(`train_step.sync_gradients`) adds the ranks' parts. The loss normaliser counts every sample once
per CP rank (`common.distributed.loss_counts`) and megatron's schedule multiplies the loss by CP: the two
cancel, so the gradient is the one of a CP=1 run.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.actor.config import ParallelConfig
from moe_rl.routing.layout import zigzag_indices


def cp_size() -> int:
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def seq_multiple() -> int:
    """`ParallelConfig.seq_multiple` of the initialised layout (TP x 2*CP)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    return ParallelConfig(tp=ps.get_tensor_model_parallel_world_size(), cp=cp_size()).seq_multiple


@functools.cache
def _indices(length: int, cp: int, cp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's positions, the permutation from the CP group's concatenated slices to sequence order)."""
    mine = torch.from_numpy(zigzag_indices(length, cp, cp_rank))
    concat = np.concatenate([zigzag_indices(length, cp, r) for r in range(cp)])
    return mine, torch.from_numpy(np.argsort(concat, kind="stable"))


def local_positions(length: int) -> torch.Tensor:
    """Positions of a length-`length` sequence that this CP rank holds."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    return _indices(length, cp_size(), ps.get_context_parallel_rank())[0]


def slice_sequence(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """This CP rank's zig-zag slice of a whole-sequence tensor along `dim`."""
    return x.index_select(dim, local_positions(x.shape[dim]).to(x.device))


class _GatherScores(torch.autograd.Function):
    """All-gather per-position scores along `dim` into sequence order. Backward: this rank's own
    positions of the gradient, unreduced: every CP rank computes the same loss from the gathered
    scores, so each passes back only what flows through its own positions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        group = ps.get_context_parallel_group()
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        length = x.shape[dim] * group.size()
        mine, order = _indices(length, group.size(), group.rank())
        ctx.dim, ctx.mine = dim, mine.to(x.device)
        return torch.cat(parts, dim).index_select(dim, order.to(x.device))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.index_select(ctx.dim, ctx.mine), None


def gather_sequence(x: torch.Tensor | None, dim: int = 1) -> torch.Tensor | None:
    """Whole sequences from this rank's zig-zag slices (differentiable; identity at CP = 1)."""
    if x is None or cp_size() == 1:
        return x
    return _GatherScores.apply(x, dim)


def _gather_keys(x: torch.Tensor) -> torch.Tensor:
    """[s/CP, b, g, h] keys or values of this rank -> [s, b, g, h] in sequence order. Backward: each
    rank's queries attended to every rank's keys, so the gradients are summed back to the owner."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    group = ps.get_context_parallel_group()
    full = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    return full.index_select(0, _indices(full.shape[0], group.size(), group.rank())[1].to(x.device))


@functools.cache
def attention_class():
    """megatron's local DotProductAttention, made context-parallel (built on first use: megatron is
    imported lazily)."""
    # heavy: megatron-core, imported on first use
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class ContextParallelAttention(DotProductAttention):
        """This rank's zig-zag queries over the whole sequence's keys, under the rows of the whole sequence's
        mask that belong to those queries (`attention_mask` [1, 1, s, s], True = hidden: causal, or a pack's
        block-causal one; actor.forward.run_schedule passes it). Takes (and ignores) multi-latent attention's
        k/v channel widths, as LocalMLACoreAttention does."""

        def __init__(self, config, *args, k_channels=None, v_channels=None, **kwargs):
            local = copy.copy(config)  # megatron's class asserts CP = 1: it attends within its inputs
            local.context_parallel_size = 1
            super().__init__(local, *args, **kwargs)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
            if kwargs.get("packed_seq_params") is not None:
                raise ValueError("THD packs (Transformer Engine) do not run on the local spec's context parallel")
            key, value = _gather_keys(key), _gather_keys(value)
            rows = attention_mask.index_select(-2, local_positions(key.shape[0]).to(attention_mask.device))
            return super().forward(query, key, value, rows.to(query.device), attn_mask_type, attention_bias)

    return ContextParallelAttention
