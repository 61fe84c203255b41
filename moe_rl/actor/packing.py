"""Padding-free micro-batches: samples packed into token-budget bins, one bin per forward.

RL response lengths have long tails, so padding every sample to the longest of the batch wastes
most of the compute. Here the samples of each mini-batch go into `k = ceil(tokens / budget)` bins
balanced by token count (longest first into the lightest bin; a bin that would overflow the budget
adds a bin); ranks that exchange tokens inside a forward (expert parallel) agree on the bin count
and on each bin's length, and each bin runs as one row:

  tokens  [1, S]         the samples back to back, then padding up to S
  mask    [1, 1, S, S]   block-diagonal causal (True = masked): a token sees only earlier tokens of
                         its own sample; a padding position sees only itself (no empty softmax row)
  RoPE                   at each sample's own positions (0, 1, ... per sample), as THD does
  routes  [1, S, L, K]   packed by the same index as the tokens, filler ids on padding

The mask carries all the separation: a plain causal mask leaks across samples. Log-probs come
back per sample (`unpack`), so losses see `[n, T]` rows as without packing and use the same
global token counts. Megatron's local attention applies a given mask as is (the CPU path). On GPU
(model.transformer_engine) the same row runs in THD format instead: no mask, `PackedSeqParams`
with the samples' `cu_seqlens` (`thd_params`; the row's tail padding is one more sequence), and
megatron applies RoPE per sequence from them.

Every rank runs the same number of bins per mini-batch (data-parallel ranks finish their passes
together; a multiple of the pipeline size under the interleaved schedule); under pipeline
parallel bins keep their own lengths (megatron's `variable_seq_lengths`: stages send shapes first;
one length under the interleaved schedule).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.compat.megatron_model import rotary_at_positions
from moe_rl.routing.records import filler_row

PACKED_KEYS = ("routes",)
"""Per-token `extra` tensors packed like the tokens (replay consumes them per forward); every other
extra tensor stays per sample (the loss reads it next to the unpacked log-probs)."""


def check_packing_supported(config) -> None:
    """Refuse MoE settings under which a sample's result depends on what it is packed with: expert
    capacity drops tokens by the load of the whole forward, and per-sequence auxiliary losses would
    see one sequence per pack (Megatron-LM #6108)."""
    problems = []
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        problems.append(f"moe_expert_capacity_factor={config.moe_expert_capacity_factor} (token dropping)")
    balancing = getattr(config, "moe_router_load_balancing_type", "none")
    if "seq_aux_loss" in (balancing if isinstance(balancing, list) else [balancing]):
        problems.append("moe_router_load_balancing_type=seq_aux_loss")
    if problems:
        raise ValueError("actor.packing=true changes results with " + "; ".join(problems) + "; set actor.packing=false")


@dataclass
class Pack:
    """Where each sample of a bin sits in its packed row."""

    attn_mask: torch.Tensor | None  # [1, 1, S, S] bool, True = masked (None under THD)
    sample: torch.Tensor  # [S] row of the micro-batch's samples at each packed position (-1: padding)
    position: torch.Tensor  # [S] position within that sample
    gather: torch.Tensor  # [n, T] packed position of each sample token (0 where not `valid`)
    valid: torch.Tensor  # [n, T] bool: the sample has a token there
    cu_seqlens: torch.Tensor  # [segments + 1] int32 sample boundaries; the tail padding is one more segment
    thd: bool = False  # run as THD sequences through Transformer Engine (no mask) instead of with attn_mask


def balanced_bins(lengths: list[int], budget: int, min_bins: int = 1) -> list[list[int]]:
    """Indices of `lengths` in bins of at most `budget` tokens (a longer sample gets a bin alone),
    at least `min_bins`, balanced: longest first into the lightest bin (LPT). Deterministic."""
    if budget < 1:
        raise ValueError(f"actor.max_tokens_per_micro_batch={budget}: must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    over = sum(n >= budget for n in lengths)  # each fills a bin alone
    k = max(min_bins, over + math.ceil(sum(n for n in lengths if n < budget) / budget), 1)
    while True:
        bins: list[list[int]] = [[] for _ in range(k)]
        load = [0] * k
        for i in order:
            j = min(range(k), key=lambda b: (load[b], b))
            if load[j] and load[j] + lengths[i] > budget:
                break  # the lightest bin is full: one more bin, start over
            bins[j].append(i)
            load[j] += lengths[i]
        else:
            return [sorted(b) for b in bins]
        k += 1


@dataclass
class PackPlan:
    """The bins of a batch: per group of rows (a mini-batch), its bins of row indices, and each bin's
    packed row length. Computed once per batch (`plan_packing`), so the old-log-prob pass and the
    update run every sample in the same bin at the same length: pi_theta = pi_old bitwise on the
    first mini-batch, as without packing."""

    groups: list[list[list[int]]]
    lengths: list[list[int]]  # packed row length of each bin, per group
    thd: bool = False  # bins run as THD sequences (model.transformer_engine) instead of with a mask

    @property
    def bins(self) -> list[list[int]]:
        return [b for g in self.groups for b in g]

    @property
    def seq_lens(self) -> list[int]:
        return [n for g in self.lengths for n in g]

    def group(self, i: int, first_row: int) -> PackPlan:
        """Group i alone, its row indices counted from `first_row` (the rows of that mini-batch)."""
        return PackPlan([[[r - first_row for r in b] for b in self.groups[i]]], [self.lengths[i]], self.thd)


def plan_packing(
    lengths: list[int],
    budget: int,
    groups: int = 1,
    pad_multiple: int = 1,
    one_length: bool = False,
    agree=None,
    count_agree=None,
    count_multiple: int = 1,
    thd: bool = False,
) -> PackPlan:
    """Bins of at most `budget` tokens within each of `groups` equal, consecutive row groups, heaviest
    first, each padded to a multiple of `pad_multiple` (TP under sequence parallel).
    `agree` (a process group; collective over it): bin i of a group is as long on each of its ranks
    (the largest load), since expert-parallel token dispatchers exchange equal blocks per forward.
    `count_agree` (a process group, default `agree`): its ranks run the largest bin count per group,
    rounded up to a multiple of `count_multiple` (a bin beyond the sample count is one padding row).
    `one_length`: every bin as long as the longest. `thd`: the plan's bins run as THD sequences."""

    if len(lengths) % groups:
        raise ValueError(f"{len(lengths)} samples do not split into {groups} equal groups")
    per = len(lengths) // groups
    parts = [lengths[g * per : (g + 1) * per] for g in range(groups)]
    counts = _group_max([len(balanced_bins(part, budget)) for part in parts], count_agree or agree)
    counts = [c + (-c) % count_multiple for c in counts]
    plan = []
    for g, (part, count) in enumerate(zip(parts, counts, strict=True)):
        bins = balanced_bins(part, budget, count)
        bins.sort(key=lambda b: -sum(part[i] for i in b))  # bin i pairs with the i-th heaviest elsewhere
        plan.append([[g * per + i for i in b] for b in bins])
    loads = _group_max([max(1, sum(lengths[i] for i in b)) for g in plan for b in g], agree)
    if one_length:
        loads = [max(loads)] * len(loads)
    loads = iter(n + (-n) % pad_multiple for n in loads)
    return PackPlan(plan, [[next(loads) for _ in g] for g in plan], thd)


def _group_max(values: list[int], group) -> list[int]:
    t = torch.tensor(values, dtype=torch.long)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def pack_bin(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    rows: list[int],
    seq_len: int,
    extra: dict[str, torch.Tensor],
    thd: bool = False,
) -> tuple[torch.Tensor, Pack, dict[str, torch.Tensor]]:
    """One bin's packed row ([1, seq_len] ids), its Pack, and its extra tensors (routes packed,
    the rest the bin's sample rows)."""
    t = input_ids.shape[1]
    idx = torch.as_tensor(rows, dtype=torch.long)
    n = lengths[idx].tolist()
    if sum(n) > seq_len:
        raise ValueError(f"a bin of {sum(n)} tokens does not fit a packed row of {seq_len}")
    sample = torch.full((seq_len,), -1, dtype=torch.long)
    position = torch.arange(seq_len)
    gather = torch.zeros(len(rows), t, dtype=torch.long)
    offset = 0
    for r, m in enumerate(n):
        sample[offset : offset + m] = r
        position[offset : offset + m] = torch.arange(m)
        gather[r, :m] = torch.arange(offset, offset + m)
        offset += m
    valid = torch.arange(t)[None, :] < torch.tensor(n)[:, None]
    attn_mask = None if thd else _block_causal_mask(sample)
    bounds = [0, *itertools.accumulate(m for m in n if m)]
    if bounds[-1] < seq_len:
        bounds.append(seq_len)  # the tail padding: a sequence of its own under THD
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    pack = Pack(attn_mask, sample, position, gather, valid, cu_seqlens, thd)
    ids = torch.zeros(1, seq_len, dtype=input_ids.dtype)
    ids[0, :offset] = input_ids[idx][valid]
    out = {}
    for key, value in extra.items():
        if key in PACKED_KEYS:
            out[key] = _pack_routes(value[idx], valid, seq_len)
        else:
            out[key] = value[idx]
    return ids, pack, out


def _block_causal_mask(sample: torch.Tensor) -> torch.Tensor:
    """[1, 1, S, S] (True = masked): causal within each sample; a padding position (-1) sees only itself."""
    s = sample.shape[0]
    segment = torch.where(sample >= 0, sample, sample.max() + 1 + torch.arange(s))
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    return ~allowed[None, None]


def _pack_routes(routes: torch.Tensor, valid: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[n, T, L, K] per-sample routes -> [1, seq_len, L, K] in packed order, filler ids (distinct,
    valid expert ids) on padding. Zero-width routes (held by another rank: actor/replay.py) stay zero-width."""
    _, width, layers, k = routes.shape
    if width == 0:
        return routes[:1]
    filler = torch.from_numpy(filler_row(layers, k, routes.numpy().dtype))
    out = filler.expand(seq_len, layers, k).clone()
    real = routes[valid[:, : routes.shape[1]]]
    out[: real.shape[0]] = real
    return out[None]


@contextmanager
def sample_positions(model: torch.nn.Module, position: torch.Tensor) -> Iterator[None]:
    """RoPE at each sample's own positions inside a pack (what THD does with cu_seqlens): attention
    only depends on distances, but fp32 angles at pack offsets of thousands lose ~1e-4 rad, so the
    rotary table is gathered at `position` ([S]: 0.. per sample) instead of the row index."""
    # heavy: megatron-core, imported on first use
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    # The model's table, or each MLA layer's own (YarnRotaryEmbedding, a subclass, returns (table, mscale)).
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    with rotary_at_positions(ropes, position):
        yield


def thd_params(pack: Pack, device: torch.device | str = "cpu"):
    """megatron's PackedSeqParams for one packed row in THD format (Transformer Engine attention): each
    sample a sequence of its own, causal within; the row's tail padding one more sequence. No per-sample
    padding (context parallel, which would need it, is refused with packing)."""
    # heavy: megatron-core, imported on first use
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((pack.cu_seqlens[1:] - pack.cu_seqlens[:-1]).max())
    cu = pack.cu_seqlens.to(device)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def unpack(values: torch.Tensor, pack: Pack, t: int) -> torch.Tensor:
    """[1, S] per packed position -> [n, t] per sample token (0 where the sample has no token).
    Differentiable (a gather)."""
    return torch.where(pack.valid[:, :t], values[0][pack.gather[:, :t]], values.new_zeros(()))
