"""One policy update of the Megatron actor: micro-batched forward+backward with the configured
loss and correction, gradient sync over data-parallel groups, clipping, optimizer step.

CPU path: explicit gradient all-reduces, then megatron-core's optimizer (actor/optimizer.py:
clipping by the joint norm, Adam). Gradient sync follows megatron's DDP: dense parameters over
the data-parallel group, experts over the expert-data-parallel group, sequence-parallel norms
additionally over TP.

Non-finite updates never reach the weights: a NaN/inf loss on any micro-batch or a non-finite
gradient on any rank makes every rank skip the optimizer step (megatron's found_inf contract:
`optimizer.step()` reports success False), and the mini-batch reports `skipped`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moe_rl.actor.context_parallel import seq_multiple
from moe_rl.actor.engine_ops import exact_values
from moe_rl.actor.forward import LogprobHead, run_schedule, split_microbatches
from moe_rl.actor.optimizer import is_expert
from moe_rl.actor.packing import PackPlan
from moe_rl.common.distributed import buckets, global_mean
from moe_rl.compat.megatron_model import update_router_expert_bias
from moe_rl.objectives.policy_loss import LossInputs, PackedRows


def _tp_reduction(name: str, p: torch.nn.Parameter) -> str | None:
    """How a parameter replicated over TP combines its ranks' gradients (megatron's
    _allreduce_non_tensor_model_parallel_grads): each rank saw only its sequence slice (sequence
    parallel) or its own attention heads (QK layernorm; MLA's q/kv latent norms) -> sum; a module asking for
    it -> mean."""
    if getattr(p, "average_gradients_across_tp_domain", False):
        return "mean"
    if getattr(p, "sequence_parallel", False) or any(n in name for n in ("q_layernorm", "k_layernorm", "kv_layernorm")):
        return "sum"
    return None


def sync_gradients(chunks: list[torch.nn.Module]) -> None:
    """Sum gradients like megatron DDP + finalize_model_grads (losses are pre-scaled by the global count): the
    TP reductions first, then data-parallel, each as one all-reduce per group and dtype over flat buckets of at
    most SYNC_BUCKET_BYTES (DDP's buckets). One gloo all-reduce per tensor cost 4-8x as much on the tiny
    models (latency, not bytes: docs/performance.md); elementwise, the sums are the same."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    sets: dict[str, list[torch.Tensor]] = {"tp_sum": [], "tp_mean": [], "dp": [], "edp": []}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:  # frozen (LoRA's base weights)
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            how = _tp_reduction(name, p) if tp > 1 else None
            if how is not None:
                sets[f"tp_{how}"].append(p.grad)
            sets["edp" if is_expert(name) else "dp"].append(p.grad)
    groups = {
        "tp_sum": ps.get_tensor_model_parallel_group(),
        "tp_mean": ps.get_tensor_model_parallel_group(),
        "dp": ps.get_data_parallel_group(with_context_parallel=True),
        "edp": ps.get_expert_data_parallel_group(),
    }
    for key, grads in sets.items():  # dict order: every TP reduction before the data-parallel ones
        if grads and dist.get_world_size(groups[key]) > 1:
            _all_reduce_flat(grads, groups[key], divide=tp if key == "tp_mean" else 1)


SYNC_BUCKET_BYTES = 64 * 2**20


def _all_reduce_flat(tensors: list[torch.Tensor], group, divide: int = 1) -> None:
    """Sum `tensors` in place over `group` (then divide by `divide`), one all-reduce per bucket of one dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        for bucket in buckets(same, SYNC_BUCKET_BYTES, lambda t: t.numel() * t.element_size()):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=group)
            if divide != 1:
                flat /= divide
            for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                t.copy_(synced)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor is finite on every rank (one all-reduce over the world). One fused check per device
    and dtype (the op GradScaler and megatron's found_inf use, scaling by exactly 1): a check per tensor cost 6.6 ms
    for the tiny model's 95 gradients on CPU (0.5 ms fused), and on a GPU it would wait for the device per tensor."""
    bad = torch.zeros(1, dtype=torch.float32)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for x in tensors:
        by_kind.setdefault((x.device, x.dtype), []).append(x.detach())
    for (device, _), same in by_kind.items():
        found = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(same, found, torch.ones(1, device=device))
        bad = torch.maximum(bad, found.cpu())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad)


LossFn = Callable[[torch.Tensor, LossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def train_minibatch(
    chunks: list[torch.nn.Module],
    optimizer,
    batch: LossInputs,
    loss_fn: LossFn,
    micro_batch_size: int,
    replay=None,
    fused_logprob: bool | str = True,
    with_entropy: bool = False,
    pack: PackPlan | None = None,
    head=None,
    ddp: list | None = None,
    keep: dict[str, torch.Tensor] | None = None,
) -> dict[str, float]:
    """Forward+backward over one mini-batch and one optimizer step (`optimizer`: a megatron
    optimizer from `moe_rl.actor.optimizer.build_optimizer`).

    batch: input_ids/attention_mask [b, T] plus the per-token tensors the loss needs (and `routes` when `replay` is
    given), with the mini-batch's counts. loss_fn(logp [mb, T] aligned to tokens, the micro-batch's LossInputs) ->
    (loss share of this micro-batch in the global mini-batch loss, metrics). `batch.exact_logp` (true on-policy):
    the loss sees those values of logp, with megatron's gradients.
    fused_logprob: log-probs through the fused linear -> log-prob kernel (`LogprobHead`).
    with_entropy: the loss also gets pi_theta's per-token entropy (differentiable) as `entropy`.
    pack: run the plan's bins as packed micro-batches (actor.packing); the loss still sees per-sample rows.
    head: per-token scores other than log-probs for loss_fn (the critic's values); default LogprobHead.
    ddp: megatron DDP wrappers of `chunks` (GPU, actor.distributed_optimizer): gradients live in their buffers
    and megatron's finalize_model_grads reduces them instead of sync_gradients (the expert bias still moves only
    after a step that was taken: a skipped step leaves it as it was).
    keep: {"logprobs", "entropy"} [b, T] tensors that get the forward's detached values the loss saw (last stage).
    """
    _zero_grads(chunks, optimizer, ddp)
    mbs = split_microbatches(
        batch.input_ids,
        batch.attention_mask,
        micro_batch_size,
        pad_multiple=seq_multiple(),
        extra=batch.tensors(),
        pack=pack,
    )
    head = LogprobHead(chunks, fused_logprob) if head is None else head
    step = _LossStep(batch, loss_fn, head, len(mbs), with_entropy, keep)
    routing = replay.replay(mbs) if replay is not None else nullcontext()
    with head, routing:
        results = run_schedule(chunks, mbs, step, forward_only=False)
    ok, norm = _optimizer_step(chunks, optimizer, step.losses, ddp)
    update_expert_bias(chunks, apply=ok)
    out = {"actor/grad_norm": float(norm) if ok else float("nan"), "skipped": 0.0 if ok else 1.0}
    return out | _from_last_stage(_weighted_means([r for r in results if r]))


def _zero_grads(chunks: list[torch.nn.Module], optimizer, ddp: list | None) -> None:
    for c in chunks:
        c.train()
        c.zero_grad(set_to_none=True)
    if ddp is None:  # bf16 parameters: the fp32 main gradients the previous step left go too
        optimizer.zero_grad(set_to_none=True)
    for m in ddp or ():
        m.zero_grad_buffer()


class _LossStep:
    """The schedule's per-micro-batch step: the head's scores, the micro-batch's LossInputs, the loss."""

    def __init__(self, batch: LossInputs, loss_fn: LossFn, head, n_mb: int, with_entropy: bool, keep):
        self.batch, self.loss_fn, self.head, self.n_mb = batch, loss_fn, head, n_mb
        self.with_entropy, self.keep = with_entropy, keep
        self.t = batch.input_ids.shape[1]
        self.losses: list[torch.Tensor] = []

    def __call__(self, output, mb):
        if len(mb.index) == 0:  # a bin left empty so that every rank runs as many forwards
            return output.sum() * 0.0, {}
        t = self.t
        lp, ent = self.head(output, mb.input_ids, with_entropy=self.with_entropy)
        logp = mb.aligned(lp, t)  # entry t scores token t of each sample
        # the loss's tensors where the log-probs are (the batch stays on the host; routes go to the replay hooks)
        moved = {
            k: (v[:, :t] if v.dim() >= 2 and v.shape[1] >= t else v).to(logp.device)
            for k, v in mb.extra.items()
            if k != "routes"
        }
        x = replace(self.batch, input_ids=None, attention_mask=None, routes=None, **moved)
        if ent is not None:
            x.entropy = mb.aligned(ent, t)
        if mb.pack is not None:  # a loss over sequences runs over the packed row itself
            p = mb.pack
            x.packed = PackedRows(p.gather, p.valid, p.cu_seqlens, p.sample.shape[0])
        if x.exact_logp is not None:  # pi_theta == pi_old here: the engine-op values, bit for bit
            logp = exact_values(logp, x.exact_logp, x.mask > 0)
        if self.keep is not None:
            rows = mb.index.cpu()
            self.keep["logprobs"][rows] = logp.detach().float().cpu()
            self.keep["entropy"][rows] = x.entropy.detach().float().cpu()
        loss, metrics = self.loss_fn(logp, x)
        self.losses.append(loss.detach())
        mask = x.mask if x.mask is not None else torch.ones(len(mb.index), 1, device=logp.device)
        weights = {TOKENS: mask.sum().detach(), SEQS: (mask.sum(-1) > 0).sum().detach()}
        # megatron's schedule divides each micro-batch loss by the number of micro-batches
        return loss * self.n_mb, {k: v.detach() for k, v in metrics.items()} | weights


def _optimizer_step(chunks: list[torch.nn.Module], optimizer, losses: list[torch.Tensor], ddp) -> tuple[bool, float]:
    """Gradient sync, then the optimizer step when every loss and gradient is finite on every rank: (taken, norm)."""
    if ddp is None:
        sync_gradients(chunks)
        grads = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
    else:
        # heavy: megatron-core, imported on first use
        from megatron.core.distributed import finalize_model_grads

        config = chunks[0].config  # the one megatron reads through the DDP wrapper
        enabled, config.moe_router_enable_expert_bias = config.moe_router_enable_expert_bias, False
        try:  # the expert bias moves below, after the step and only if it was taken, as without DDP
            finalize_model_grads(ddp)
        finally:
            config.moe_router_enable_expert_bias = enabled
        grads = [p.main_grad for c in chunks for p in c.parameters() if getattr(p, "main_grad", None) is not None]
    finite = all_finite([*losses, *grads])
    if finite:
        ok, norm, _ = optimizer.step()  # megatron-core: joint grad norm, clipping, Adam
    else:
        ok, norm = False, float("nan")
    if not ok:  # this rank's or another's loss/gradients are not finite (or megatron found inf)
        for c in chunks:
            c.zero_grad(set_to_none=True)
    return ok, norm


TOKENS, SEQS = "_tokens", "_sequences"


def update_expert_bias(chunks: list[torch.nn.Module], apply: bool = True) -> None:
    """After an optimizer step, move each router's expert bias towards balanced load as megatron's
    finalize_model_grads does (token counts summed over TP x CP x DP), when
    `moe_router_bias_update_rate` > 0; the counts restart every mini-batch either way."""
    config = chunks[0].config
    if not config.moe_router_enable_expert_bias:
        return
    if apply and config.moe_router_bias_update_rate > 0:
        update_router_expert_bias(chunks, config)
    for c in chunks:
        for m in c.modules():
            if getattr(m, "local_tokens_per_expert", None) is not None:
                m.local_tokens_per_expert.zero_()


def _weighted_means(results: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Each loss metric over the global mini-batch: the micro-batches' values of every data-parallel rank
    weighted by their loss tokens (by their sequences for `seq_*` and `*_seq_*` metrics), so a token mean
    (ppo_kl, clipfrac, kl_ref) or a sequence mean (seq_ratio_mean) depends neither on how the samples were split or
    packed nor on which rank holds them (0 where there are none). Collective over the data-parallel group
    (last stage only)."""
    keys = [k for k in (results[0] if results else ()) if k not in (TOKENS, SEQS)]
    if not keys:
        return {}
    by = {k: SEQS if k.startswith("seq_") or "_seq_" in k else TOKENS for k in keys}
    weights = {k: sum(float(r[by[k]]) for r in results) for k in keys}
    sums = {k: sum(float(r[k]) * float(r[by[k]]) for r in results) for k in keys}
    return global_mean({k: sums[k] / weights[k] if weights[k] > 0 else 0.0 for k in keys}, weights)


def _from_last_stage(metrics: dict[str, float]) -> dict[str, float]:
    """The loss metrics, which only the last pipeline stage computes, on every stage (the step's
    metric reductions need the same keys on every rank)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    box = [metrics]
    group = ps.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group)
    return box[0]
