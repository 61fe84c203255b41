"""Core attention of a packed row on megatron's local spec (the CPU path): each sample attends within itself.

A packed row holds several samples behind a block-diagonal causal mask (actor/packing.py). megatron's local
DotProductAttention computes the row's whole `[S, S]` score matrix and masks it, so a row of 16 samples costs 16x
the attention it needs, and the scores of a long row leave the cache (docs/performance.md, "Padding-free packing").
This class reads the samples off the mask and runs megatron's own attention on them, one batch per length class
(lengths within 2x of each other, each sample padded to its class's longest): about sum(n_i^2) instead of S^2, the
same softmax, scale, dropout and dtype handling, equal to the masked row up to fp32 rounding. Any other mask (the
padded path's causal mask, a batch of several rows, a mask that is not block-diagonal causal) takes megatron's
forward unchanged. On GPU the THD path (Transformer Engine's variable-length attention) does this instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowPlan:
    """The samples of one packed row, grouped in length classes."""

    classes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (positions [L, n], valid [n, L], causal mask)
    order: torch.Tensor  # [S]: where each row position sits among the classes' valid outputs, concatenated


def row_plan(attention_mask: torch.Tensor | None) -> RowPlan | None:
    """The samples of a `[1, 1, S, S]` block-diagonal causal mask (True = masked); None for any other mask or one
    with a single sample (nothing to gain: megatron's forward runs as it is)."""
    if attention_mask is None or attention_mask.dim() != 4 or tuple(attention_mask.shape[:2]) != (1, 1):
        return None
    masked = attention_mask[0, 0]
    s = masked.shape[0]
    if masked.shape[1] != s or s < 2 or masked.dtype != torch.bool:
        return None
    starts = torch.ones(s, dtype=torch.bool, device=masked.device)
    starts[1:] = masked.diagonal(-1)  # position i cannot see i - 1: a sample starts at i
    sample = starts.cumsum(0) - 1
    if int(sample[-1]) == 0:
        return None
    causal = torch.ones(s, s, dtype=torch.bool, device=masked.device).tril()
    if not torch.equal(masked, ~((sample[:, None] == sample[None, :]) & causal)):
        return None
    begin = torch.nonzero(starts).flatten()
    lengths = torch.bincount(sample)
    length_class = [(n - 1).bit_length() for n in lengths.tolist()]  # lengths 1 | 2 | 3-4 | 5-8 | ...
    classes, gathered = [], []
    for c in sorted(set(length_class)):
        members = torch.tensor([i for i, k in enumerate(length_class) if k == c], device=masked.device)
        n = lengths[members]
        width = int(n.max())
        steps = torch.arange(width, device=masked.device)
        positions = (begin[members][:, None] + steps).clamp(max=s - 1)  # past a sample's end: any position
        valid = steps < n[:, None]  # (its queries are dropped; its keys lie after every real query)
        causal_mask = ~torch.ones(width, width, dtype=torch.bool, device=masked.device).tril()
        # [L, n] in memory as well: an index's layout is its result's, and megatron views its keys
        classes.append((positions.t().contiguous(), valid, causal_mask))
        gathered.append(positions[valid])
    order = torch.empty(s, dtype=torch.long, device=masked.device)
    order[torch.cat(gathered)] = torch.arange(s, device=masked.device)
    return RowPlan(classes, order)


class _LastPlan:
    """Every layer of a forward (and its recompute) sees the same mask object: plan it once."""

    mask: torch.Tensor | None = None
    plan: RowPlan | None = None

    @classmethod
    def of(cls, attention_mask: torch.Tensor | None) -> RowPlan | None:
        if attention_mask is not cls.mask:
            cls.mask, cls.plan = attention_mask, row_plan(attention_mask)
        return cls.plan


@functools.cache
def packed_row_attention(base: type) -> type:
    """`base` (megatron's DotProductAttention, or a subclass of it) computing a packed row per sample."""

    if getattr(base, "packs_rows", False):  # the decoder's layer specs share one submodules object
        return base

    class PackedRowAttention(base):
        packs_rows = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # A sliding-window layer (GPT-OSS): megatron's softmax *replaces* the mask it is given by a window mask,
            # so the samples of a packed row would see each other. The window is added to the mask instead.
            self.window = self.scale_mask_softmax.window_size
            self.scale_mask_softmax.window_size = None

        def _windowed(self, mask: torch.Tensor) -> torch.Tensor:
            """`mask` (True = masked, [..., sq, sk]) with every key more than window_size[0] positions back masked."""
            if self.window is None:
                return mask
            sq, sk = mask.shape[-2:]
            back = torch.arange(sq, device=mask.device)[:, None] + (sk - sq) - torch.arange(sk, device=mask.device)
            return mask | (back > self.window[0])

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, **kwargs):
            """query [S, 1, heads, d], key/value [S, 1, groups, d] of one packed row -> context [S, 1, heads * dv]."""
            one_row = query.shape[1] == 1 and attention_bias is None and kwargs.get("packed_seq_params") is None
            plan = _LastPlan.of(attention_mask) if one_row else None
            if plan is None:
                if attention_mask is None and self.window is not None:  # megatron would build a causal one
                    s = query.shape[0]
                    attention_mask = ~torch.ones(s, s, dtype=torch.bool, device=query.device).tril()[None, None]
                mask = attention_mask if attention_mask is None else self._windowed(attention_mask)
                return super().forward(query, key, value, mask, attn_mask_type, attention_bias, **kwargs)
            q, k, v = query[:, 0], key[:, 0], value[:, 0]
            outputs = []
            for at, valid, causal in plan.classes:  # `at` [L, n]: megatron's [sequence, batch] order
                mask = self._windowed(causal[None, None])
                context = super().forward(q[at], k[at], v[at], mask, attn_mask_type)  # [L, n, hd]
                outputs.append(context.transpose(0, 1)[valid])
            return torch.cat(outputs).index_select(0, plan.order).unsqueeze(1)

    PackedRowAttention.__qualname__ = PackedRowAttention.__name__ = f"PackedRow{base.__name__}"
    return PackedRowAttention
