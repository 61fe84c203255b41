"""Micro-batched forward (and backward) passes of the Megatron actor, and per-token log-probs.

Batches are padded `[B, T]` with right padding. Every rank of a TP/PP/CP group passes the same
batch; data-parallel ranks pass their own. Under context parallel each rank runs its zig-zag
slice of the positions and per-token scores are gathered back whole (actor/context_parallel.py).
The pipeline schedule comes from megatron-core, so the same code runs at PP = 1 and PP > 1
(results are broadcast from the last stage).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.actor.context_parallel import cp_size, gather_sequence, seq_multiple, slice_sequence
from moe_rl.actor.packing import Pack, PackPlan, pack_bin, sample_positions, thd_params, unpack
from moe_rl.common import progress
from moe_rl.compat.megatron_model import output_layers_return_hidden, restore_forwards

# step_fn(logits [b, s, V/TP], micro_batch) -> (loss scalar, outputs dict of [b, s] tensors)
StepFn = Callable[[torch.Tensor, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class MicroBatch:
    """One forward's inputs; `index` selects its samples in the full batch. Packed (`pack` set): the
    samples run back to back in one row (actor/packing.py)."""

    input_ids: torch.Tensor  # [b, s], packed: [1, S]
    attention_mask: torch.Tensor  # [b, s] 1 = real token (packed: [1, S])
    index: torch.Tensor  # [b] samples of the full batch
    extra: dict  # per-sample [b, T, ...] tensors; packed: routes as [1, S, L, K]
    pack: Pack | None = None

    def aligned(self, values: torch.Tensor, t: int) -> torch.Tensor:
        """Per-position scores of the next token ([rows, s-1], LogprobHead) -> [samples, t] where entry j
        scores token j of each sample (column 0 is 0)."""
        full = torch.nn.functional.pad(values, (1, 0))
        return full[:, :t] if self.pack is None else unpack(full, self.pack, t)


def split_microbatches(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    pad_multiple: int = 1,
    extra: dict[str, torch.Tensor] | None = None,
    pack: PackPlan | None = None,
) -> list[MicroBatch]:
    """Split a padded batch into micro-batches of equal sequence length.

    The length is padded to a multiple of `pad_multiple` (TP for sequence parallel, x 2*CP). Tensors in
    `extra` with a leading batch dim are split alongside. `pack` (actor.packing): one packed
    micro-batch per bin of the plan instead (`micro_batch_size` and `pad_multiple` unused).
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must have the same shape"
        )
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    if pack is not None:
        return _packed_microbatches(input_ids, attention_mask, pack, extra or {})
    b, t = input_ids.shape
    pad = (-t) % pad_multiple
    if pad:
        input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        attention_mask = torch.nn.functional.pad(attention_mask, (0, pad))
    extra = extra or {}
    out = []
    for start in range(0, b, micro_batch_size):
        idx = torch.arange(start, min(start + micro_batch_size, b))
        out.append(MicroBatch(input_ids[idx], attention_mask[idx], idx, {k: v[idx] for k, v in extra.items()}))
    return out


def _packed_microbatches(input_ids, attention_mask, plan: PackPlan, extra) -> list[MicroBatch]:
    lengths = attention_mask.sum(-1)
    if (attention_mask != (torch.arange(attention_mask.shape[1]) < lengths[:, None]).long()).any():
        raise ValueError("packing needs right-padded rows (attention_mask = 1 then 0)")
    out = []
    for rows, seq_len in zip(plan.bins, plan.seq_lens, strict=True):
        ids, pack, mb_extra = pack_bin(input_ids, lengths, rows, seq_len, extra, plan.thd)
        mask = (pack.sample >= 0).long()[None]
        out.append(MicroBatch(ids, mask, torch.as_tensor(rows, dtype=torch.long), mb_extra, pack))
    return out


def _causal_mask(s: int) -> torch.Tensor:
    # megatron convention: True = masked out. Explicit, because megatron's default mask is
    # allocated on "cuda" (get_default_causal_mask).
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)


def run_schedule(
    chunks: list[torch.nn.Module],
    microbatches: list[MicroBatch],
    step_fn: StepFn,
    forward_only: bool,
) -> list[dict[str, torch.Tensor]]:
    """Run megatron-core's forward(-backward) schedule; returns step_fn outputs on the last stage."""
    # heavy: megatron-core, imported on first use
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(chunks[0].parameters()).device
    seq_len = microbatches[0].input_ids.shape[1]
    causal = _causal_mask(seq_len).to(device) if microbatches[0].pack is None else None
    # context parallel: each rank runs its zig-zag positions; the attention takes the whole sequence's mask
    local = slice_sequence if cp_size() > 1 else lambda x: x

    def forward_step(data_iterator, model):
        progress.mark()  # the hang watchdog's sign of life in a long update
        mb: MicroBatch = next(data_iterator)
        ids = mb.input_ids.to(device)
        if mb.pack is None:
            pos = torch.arange(ids.shape[1], device=device).unsqueeze(0).expand_as(ids)
            output = model(local(ids), local(pos), causal)
        elif mb.pack.thd:  # Transformer Engine attention per sequence; RoPE per sequence from cu_seqlens
            params = thd_params(mb.pack, device)
            output = model(ids, mb.pack.position[None].to(device), None, packed_seq_params=params)
        else:  # rows of their own length, block-diagonal mask, RoPE at each sample's positions
            pos = local(mb.pack.position[None])
            with sample_positions(model, pos[0]):
                output = model(local(ids), pos.to(device), mb.pack.attn_mask.to(device))

        def loss_func(logits):
            return step_fn(logits, mb)

        return output, loss_func

    n_chunks = len(chunks)
    iters = [iter(microbatches) for _ in range(n_chunks)] if n_chunks > 1 else iter(microbatches)
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iters,
        model=chunks if n_chunks > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_len,
        micro_batch_size=microbatches[0].input_ids.shape[0],
        forward_only=forward_only,
    )


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits)[target] and entropy, with the vocab split over TP ranks.

    logits: [..., V/TP] (this rank's vocab slice), targets: [...] global ids.
    Cross-rank sums are all-reduced forward / identity backward (the loss is replicated on
    every TP rank, as in megatron's vocab_parallel_cross_entropy). Differentiable.
    """
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    lmax = logits.detach().max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        reduce = reduce_from_tensor_model_parallel_region
        start = ps.get_tensor_model_parallel_rank() * v_local
    else:

        def reduce(x):
            return x

        start = 0
    shifted = logits - lmax
    exp = shifted.exp()
    sum_exp = reduce(exp.sum(dim=-1))
    lse = sum_exp.log()
    local_t = targets - start
    in_range = (local_t >= 0) & (local_t < v_local)
    picked = shifted.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = reduce(torch.where(in_range, picked, torch.zeros_like(picked)))
    logprobs = target_logit - lse
    entropy = None
    if with_entropy:
        # H = lse - sum_v p_v * z_v (z shifted by the max; the shift cancels).
        p_z = reduce((exp * shifted).sum(dim=-1)) / sum_exp
        entropy = lse - p_z
    return logprobs, entropy


class LogprobHead:
    """Scores targets from the model output: per-token log-probs (and entropy).

    fused=False: the output is `[b, s, V/TP]` logits (`vocab_parallel_logprobs`).
    fused=True (or a kernel backend, "torch" | "triton"; True is the token-chunked torch backend, the faster one on
    GPU too): while the head is entered, the last stage's output layer returns its input
    hidden states (gathered over sequence parallel) instead of logits and records the weight it
    would have used (its own, or the tied embedding); `moe_rl.kernels.linear_logprob` then
    computes log-probs block by block, so the `[tokens, vocab]` logits never exist whole.
    Megatron's output layer still owns the weight; its gradient flows through the kernel.
    """

    def __init__(self, chunks: list[torch.nn.Module], fused: bool | str):
        if fused not in (True, False, "triton", "torch"):
            raise ValueError(f"fused={fused!r}: choose True, False, 'triton' or 'torch'")
        self.fused = fused
        self._layers = [c.output_layer for c in chunks if getattr(c, "post_process", False)] if fused else []
        self._weight: torch.Tensor | None = None

    def __enter__(self) -> LogprobHead:
        output_layers_return_hidden(self._layers, self._keep_weight)
        return self

    def _keep_weight(self, weight: torch.Tensor) -> None:
        self._weight = weight

    def __exit__(self, *exc) -> None:
        restore_forwards(self._layers)
        self._weight = None

    def __call__(
        self, output: torch.Tensor, ids: torch.Tensor, with_entropy: bool = True, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """output: [b, s, V/TP] logits or [b, s, H] hidden states; ids: [b, s]. Scores ids[:, 1:]
        from positions :-1 -> ([b, s-1] log-probs, entropy or None). Context parallel: `output` holds
        this rank's zig-zag positions, `ids` the whole sequences; the scores come back whole."""
        ids = ids.to(output.device)
        if cp_size() == 1:
            return self._score(output[:, :-1], ids[:, 1:], with_entropy, temperature)
        targets = slice_sequence(ids.roll(-1, dims=1))  # position p scores token p + 1 (the last wraps: dropped)
        lp, ent = self._score(output, targets, with_entropy, temperature)
        return gather_sequence(lp)[:, :-1], None if ent is None else gather_sequence(ent)[:, :-1]

    def _score(self, output: torch.Tensor, targets: torch.Tensor, with_entropy: bool, temperature: float):
        """output: [b, s, V/TP | H] at the positions that score `targets` [b, s]."""
        if not self.fused:
            return vocab_parallel_logprobs(output, targets, with_entropy, temperature)
        # heavy: megatron-core, imported on first use; optional: Triton (moe_rl.kernels)
        from megatron.core import parallel_state as ps

        from moe_rl.kernels.linear_logprob import fused_linear_logprob

        h = output
        if temperature != 1.0:  # no bias: W (h / T) = (W h) / T
            h = h / temperature
        b, s, d = h.shape
        group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        backend = self.fused if isinstance(self.fused, str) else "torch"
        lp, ent = fused_linear_logprob(
            h.reshape(b * s, d), self._weight, targets.reshape(-1), group=group, backend=backend
        )
        return lp.view(b, s), ent.view(b, s) if with_entropy else None


def broadcast_from_last_stage(t: torch.Tensor) -> torch.Tensor:
    """`t` as the last pipeline stage (the only one that computes log-probs) holds it, on every stage of its
    pipeline (in place; collective over the pipeline group when there is more than one stage)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return t
    ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    dist.broadcast(t, src=ranks[-1], group=ps.get_pipeline_model_parallel_group())
    return t


@torch.no_grad()
def compute_logprobs(
    chunks: list[torch.nn.Module],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int | None = None,
    with_entropy: bool = True,
    temperature: float = 1.0,
    routes: torch.Tensor | None = None,
    replay=None,
    record: bool = False,
    fused: bool | str = True,
    pack: PackPlan | None = None,
    head=None,
) -> dict[str, torch.Tensor]:
    """Per-token log pi(y_t | y_<t) and entropy for a right-padded batch.

    Returns {"logprobs": [B, T], "entropy": [B, T]}: entry t scores token t given tokens < t
    (column 0 and padding are 0). Available on every rank of the pipeline.
    fused=True: full-vocabulary logits never exist whole (`LogprobHead`); fused=False: they
    live inside one micro-batch's loss function. pack: run the plan's bins as packed micro-batches
    (actor.packing; `micro_batch_size` is then unused).

    Routing (`replay`: a `moe_rl.actor.replay.RouteReplay` bound to these chunks):
      routes=[B, T, L_moe, K] -> replay them (R3, or the update passes of R2);
      record=True             -> record this pass's routes, returned as out["routes"] (R2).
    `head`: scores other than log-probs from the model output, under the same key (the critic's values).
    """
    if (routes is not None or record) and replay is None:
        raise ValueError("routes/record need a RouteReplay bound to these chunks (replay=...)")
    if routes is not None and record:
        raise ValueError("replay and record are exclusive in one pass")
    for c in chunks:
        c.eval()
    b, t = input_ids.shape
    mbs = split_microbatches(
        input_ids,
        attention_mask,
        micro_batch_size or b,
        pad_multiple=seq_multiple(),
        extra=None if routes is None else {"routes": routes},
        pack=pack,
    )
    routing = _routing(replay, mbs, routes, record, b, t)
    head = LogprobHead(chunks, fused) if head is None else head

    def step(output, mb: MicroBatch):
        lp, ent = head(output, mb.input_ids, with_entropy, temperature)
        out = {"logprobs": mb.aligned(lp, t)}
        if ent is not None:
            out["entropy"] = mb.aligned(ent, t)
        return lp.new_zeros(()), out

    with head, routing as recorded:
        results = run_schedule(chunks, mbs, step, forward_only=True)
    keys = ["logprobs"] + (["entropy"] if with_entropy else [])
    out = {k: _gathered(mbs, results, k, (b, t), attention_mask) for k in keys}
    if record:
        out["routes"] = torch.from_numpy(recorded["routes"][:, :t])
    return out


def _routing(replay, mbs: list[MicroBatch], routes: torch.Tensor | None, record: bool, b: int, t: int):
    """The routing context of a forward pass over `mbs` (a [b, t] batch): replaying `routes`, recording this pass's
    routes, or neither (a context yielding {})."""
    if routes is not None:
        return replay.replay(mbs)
    if record:
        return replay.record(mbs, b, t)
    return nullcontext({})


def _gathered(
    mbs: list[MicroBatch],
    results: list[dict[str, torch.Tensor]],
    key: str,
    shape: tuple[int, int],
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """results[i][key] of every micro-batch, put back in its rows of a float32 `shape` = [B, T] tensor (as the last
    pipeline stage holds them, on every stage), zero at padding and at column 0. `attention_mask`: [B, T]."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    full = torch.zeros(*shape, dtype=torch.float32)
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for mb, r in zip(mbs, results, strict=True):
            full[mb.index] = r[key].float().cpu()
    full = broadcast_from_last_stage(full)
    return full * attention_mask.float() * _not_first(attention_mask)


def _not_first(mask: torch.Tensor) -> torch.Tensor:
    m = torch.ones_like(mask, dtype=torch.float32)
    m[:, 0] = 0
    return m


def routing_views(
    chunks: list[torch.nn.Module],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    micro_batch_size: int | None,
    replay,
    routes: torch.Tensor | None,
    replayed: torch.Tensor | None = None,
    live: dict[str, torch.Tensor] | None = None,
    fused: bool | str = True,
    pack: PackPlan | None = None,
) -> dict[str, torch.Tensor | None]:
    """pi_old two ways, for the mismatch diagnostics: with the engine's `routes` replayed and
    with the actor's own routing (plus the routes it chose). A caller whose old-log-prob pass
    already is one of the two passes it in (`replayed` log-probs, or `live` = a recording
    `compute_logprobs` output) and only the other runs."""
    args = (chunks, input_ids, attention_mask, micro_batch_size)
    kw = {"replay": replay, "fused": fused, "pack": pack}
    if live is None:
        live = compute_logprobs(*args, with_entropy=False, record=True, **kw)
    if replayed is None and routes is not None:
        replayed = compute_logprobs(*args, with_entropy=False, routes=routes, **kw)["logprobs"]
    return {"logprobs_replay": replayed, "logprobs_live": live["logprobs"], "routes_live": live["routes"]}
