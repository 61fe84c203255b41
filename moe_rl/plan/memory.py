"""Memory rows per rank: trainer ranks by pipeline stage, engine GPUs, and the verdict for each kind of GPU.

Exact rows (parameters, gradients, optimizer states, KV bytes per token, route records, buckets) follow the code
that allocates them. Estimates (activations, engine workspace) state their formula:

- Optimizer, CPU-path actor (actor.distributed_optimizer=false; moe_rl/actor/optimizer.py), nothing sharded: fp32
  parameters: torch AdamW inside megatron's FP32Optimizer on the parameters themselves, fp32 gradients and
  exp_avg/exp_avg_sq (12 B per parameter with the parameter); bf16 parameters: megatron's
  Float16OptimizerWithFloat16Params, fp32 main gradients (the bf16 ones are freed as they are copied), fp32 master
  weights and Adam moments (2 + 4 + 12 B per parameter).
- Optimizer, distributed (actor.distributed_optimizer=true; megatron/core/optimizer/distrib_optimizer.py and
  Megatron-LM's theoretical_memory_usage.compute_weight_and_optimizer_memory, "6 + 12 / data_parallel_size" bytes per
  parameter in bf16): 16-bit parameters (2 B) + fp32 main gradients (4 B: DDP grad_reduce_in_fp32=True,
  moe_rl/actor/optimizer.py) on every rank; fp32 master weights + two fp32 Adam moments (12 B; 8 B for fp32
  parameters, which are their own master) sharded over the data-parallel x context-parallel ranks for dense parameters
  and over the expert-data-parallel ranks (world / (pp x ep x etp)) for expert parameters.
- Activations of one micro-batch (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Table 2, as Megatron-LM's compute_activation_memory writes it: s*b*h*(18 + 4*ffn/h) bytes per layer with
  16-bit activations and sequence parallelism dividing by TP), per rank with T tokens per micro-batch split over CP:
    attention + norms   18 * h * T/(cp*tp)                      (x dtype/2)
    MLP (dense layer)    4 * ffn * T/(cp*tp)                     (x dtype/2)
    MLP (MoE layer)      4 * (topk * moe_ffn / etp + shared_ffn) * T/(cp*tp)  (x dtype/2)
    dispatch buffers     2 * topk * h * T/(cp*tp) * dtype        (tokens x top-k x hidden, permuted in and out)
    attention scores     5 * heads/tp * seq^2/cp * samples       (x dtype/2; only without Transformer Engine's flash
                                                                  attention and without recompute)
  model.recompute=selective (core attention and MoE recomputed here) keeps the attention + dense MLP terms only;
  full keeps each layer's input (h * T/(cp*tp) * dtype) plus one layer's full activations. Pipeline stage s holds
  min(pp - s, micro-batches) micro-batches in flight (1F1B), times Megatron's interleaving penalty
  1 + (pp-1)/(pp*vpp) with vpp.
- Log-probs (last stage): the fused linear -> log-prob op holds at most 1 GiB of fp32 logits per chunk on GPU
  (actor.fused_logprob); without it the whole [T/cp, vocab/tp] fp32 logits and their log-softmax.
- Engine workspace: vLLM's profiled peak, estimated as one forward of max_num_batched_tokens (default 8192) tokens,
  tokens * (4*h + 2*topk*h + 4*topk*moe_ffn/tp) * dtype, plus max_num_seqs (256) rows of fp32 logits, plus
  ENGINE_OVERHEAD for the CUDA context and graphs (an assumption, not measured).
- Optimizer offload (actor.optimizer_offload.fraction f, with the distributed optimizer; megatron's
  HybridDeviceOptimizer built with use_precision_aware_optimizer, megatron/core/optimizer/cpu_offloading): (1 - f) of
  the optimizer-state row stays on the GPU; f of the rank's state elements live on the host as fp32 master + Adam
  moments (12 B) and a pinned fp32 gradient copy (4 B). The fp32 main grads (DDP buffer) stay on the GPU.
- What-if features (`--assume`, moe_rl.plan.assume): trainer-offload: a GPU shared by a trainer rank and an engine
  worker holds at most the larger of the engine's budget (generating, the trainer's states on the host) and the
  trainer's total + ENGINE_OVERHEAD (training, the engine asleep).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moe_rl.plan.kv import DTYPE_BYTES, engine_dtype_bytes, kv_bytes_per_token
from moe_rl.plan.layout import Layout
from moe_rl.plan.params import (
    ParamCounts,
    RankParams,
    engine_rank_params,
    lora_rank_params,
    padded_vocab,
    stage_layers,
    trainer_rank_params,
)
from moe_rl.plan.spec import ModelSpec
from moe_rl.routing.records import route_dtype

GIB = 2**30
FUSED_LOGITS_CHUNK = GIB  # kernels/linear_logprob.py on GPU: token chunks of at most 1 GiB of logits
ENGINE_OVERHEAD = GIB  # CUDA context, CUDA graphs, NCCL buffers of a vLLM worker: an assumption
ENGINE_BATCHED_TOKENS = 8192  # vLLM's offline max_num_batched_tokens below 70 GiB (x2 at or above, A100s aside)
ENGINE_MAX_SEQS = 256  # vLLM's offline max_num_seqs below 70 GiB (x4 at or above, A100s aside)


@dataclass
class Row:
    name: str
    bytes: int
    note: str = ""
    host: bool = False  # held in host memory (the route records): shown, not in the GPU's total


@dataclass
class RankTable:
    """One kind of rank: its rows (summed into `total`), how many GPUs are like it."""

    kind: str  # "trainer" | "engine"
    label: str
    count: int
    rows: list[Row]
    parameters_per_rank: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """GPU bytes: the rows not in host memory."""
        return sum(r.bytes for r in self.rows if not r.host)

    @property
    def host_total(self) -> int:
        """Host bytes: the rows in host memory (route records, offloaded optimizer states)."""
        return sum(r.bytes for r in self.rows if r.host)

    def as_dict(self) -> dict[str, Any]:
        out = {
            "kind": self.kind,
            "label": self.label,
            "count": self.count,
            "rows": {r.name: r.bytes for r in self.rows},
        }
        out["total_bytes"] = self.total
        out["host_bytes"] = self.host_total
        if self.parameters_per_rank is not None:
            out["parameters_per_rank"] = self.parameters_per_rank
        return out | self.extra


@dataclass
class GpuVerdict:
    """One kind of GPU: what it holds at its fullest, and whether that fits."""

    label: str
    count: int
    peak: int
    fits: bool
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Lengths:
    prompt: int
    response: int

    @property
    def sequence(self) -> int:
        return self.prompt + self.response


def lengths(cfg: Any, spec: ModelSpec) -> Lengths:
    """Prompt and response lengths of the config: sampling.max_tokens, and data.max_prompt_tokens or (as the
    trainer's default) what the engine's context leaves (rollout.max_model_len or max_position_embeddings)."""
    context = cfg.rollout.max_model_len or spec.max_position
    response = cfg.sampling.max_tokens
    prompt = cfg.data.max_prompt_tokens or max(1, context - response)
    return Lengths(prompt, response)


def _microbatch_tokens(cfg: Any, seq: int) -> int:
    a = cfg.actor
    return max(a.max_tokens_per_micro_batch, seq) if a.packing else a.micro_batch_size * seq


def _in_flight(cfg: Any, layout: Layout, stage: int, seq: int, tokens: int) -> float:
    samples = cfg.data.prompts_per_step * cfg.sampling.n // cfg.actor.mini_batches
    micro = math.ceil(samples * seq / tokens) if cfg.actor.packing else math.ceil(samples / cfg.actor.micro_batch_size)
    flight = min(layout.pp - stage, max(micro, 1))
    if layout.vpp:
        flight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return flight


def layer_activations(spec: ModelSpec, cfg: Any, layout: Layout, layer: int, tokens: int, seq: int) -> int:
    """Activation bytes one decoder layer keeps for one micro-batch of `tokens` tokens (formula in the docstring)."""
    a = DTYPE_BYTES[str(cfg.model.dtype)]
    t = tokens / (layout.cp * layout.tp)
    recompute = cfg.model.recompute
    h = spec.hidden
    attention = 18 * h * t * a / 2
    if spec.is_moe(layer):
        mlp = 4 * (spec.topk * spec.moe_ffn / layout.etp + spec.shared_ffn) * t * a / 2
        dispatch = 2 * spec.topk * h * t * a
    else:
        mlp, dispatch = 4 * spec.dense_ffn * t * a / 2, 0
    scores = 0
    if not cfg.model.transformer_engine and recompute is None:
        scores = 5 * spec.num_heads / layout.tp * seq * seq / layout.cp * (tokens / seq) * a / 2
    if recompute == "selective":
        return int(attention + (0 if spec.is_moe(layer) else mlp))
    return int(attention + mlp + dispatch + scores)


def activations(spec: ModelSpec, cfg: Any, layout: Layout, layers: list[int], stage: int, seq: int) -> int:
    tokens = _microbatch_tokens(cfg, seq)
    per = [layer_activations(spec, cfg, layout, i, tokens, seq) for i in layers]
    flight = _in_flight(cfg, layout, stage, seq, tokens)
    if cfg.model.recompute == "full":
        inputs = spec.hidden * tokens / (layout.cp * layout.tp) * DTYPE_BYTES[str(cfg.model.dtype)]
        return int(flight * inputs * len(layers) + max(per, default=0))
    return int(flight * sum(per))


def _optimizer_rows(rp: RankParams, cfg: Any, layout: Layout, what: str, distributed: bool) -> list[Row]:
    rows = _optimizer_rows_on_gpu(rp, cfg, layout, what, distributed)
    fraction = cfg.actor.optimizer_offload.fraction if distributed and not what else 0.0  # the actor's optimizer
    if fraction > 0:
        state, elements = rows[-1], _state_elements(rp, layout)
        on_gpu = int(state.bytes * (1 - fraction))
        note = f"{1 - fraction:g} of: {state.note} (actor.optimizer_offload.fraction={fraction:g} on the host)"
        offloaded = int(elements * fraction)
        rows[-1] = Row(state.name, on_gpu, note)
        rows.append(
            Row(
                "optimizer state (host)",
                offloaded * 12,
                f"host memory: {fraction:g} of the {elements / 1e9:.2f}B state elements x (fp32 master + Adam moments)",
                host=True,
            )
        )
        rows.append(
            Row("gradient copies (host)", offloaded * 4, "host memory: pinned fp32 grads of that share", host=True)
        )
    return rows


def _state_elements(rp: RankParams, layout: Layout) -> int:
    """Parameters whose optimizer state this rank holds under the distributed optimizer (its shards)."""
    expert_dp = layout.expert_dp if layout.ep > 1 else layout.dp * layout.cp
    return rp.dense // (layout.dp * layout.cp) + rp.experts // expert_dp


def _optimizer_rows_on_gpu(rp: RankParams, cfg: Any, layout: Layout, what: str, distributed: bool) -> list[Row]:
    pb = DTYPE_BYTES[str(cfg.model.dtype)]
    if distributed:
        state = 12 if pb == 2 else 8  # fp32 master (16-bit params only) + exp_avg + exp_avg_sq
        # megatron marks expert parameters as expert-parallel only when EP > 1 (tensor_parallel/layers.py: allreduce
        # = not expert_model_parallel_size > 1); with EP = 1 they sit in the dense buffer, sharded over dp*cp
        expert_dp = layout.expert_dp if layout.ep > 1 else layout.dp * layout.cp
        sharded = rp.dense * state // (layout.dp * layout.cp) + rp.experts * state // expert_dp
        return [
            Row(f"{what}gradients", rp.total * 4, "fp32 main grads (megatron DDP, grad_reduce_in_fp32)"),
            Row(
                f"{what}optimizer state",
                sharded,
                f"fp32 {'master + ' if pb == 2 else ''}Adam moments, dense / (dp*cp)={layout.dp * layout.cp}, experts "
                f"/ {'expert-dp' if layout.ep > 1 else 'dp*cp (EP=1: in the dense buffer)'}={expert_dp}",
            ),
        ]
    if pb == 2:  # megatron's Float16OptimizerWithFloat16Params
        return [
            Row(f"{what}gradients", rp.total * 4, "fp32 main grads (the 16-bit grads are freed as they are copied)"),
            Row(f"{what}optimizer state", rp.total * 12, "fp32 master + Adam moments, unsharded"),
        ]
    return [
        Row(f"{what}gradients", rp.total * 4, "fp32 grads"),
        Row(f"{what}optimizer state", rp.total * 8, "AdamW exp_avg + exp_avg_sq in fp32, unsharded"),
    ]


def trainer_table(spec: ModelSpec, counts: ParamCounts, cfg: Any, layout: Layout, stage: int) -> RankTable:
    """The rows of one trainer rank of pipeline stage `stage`."""
    pb = DTYPE_BYTES[str(cfg.model.dtype)]
    lay = layout
    ends = (lay.first_stage_layers, lay.last_stage_layers)
    rp = trainer_rank_params(spec, counts, lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp, stage, *ends)
    layers = stage_layers(spec.num_layers, lay.pp, lay.vpp, stage, *ends)
    seq = lengths(cfg, spec).sequence
    rows = [Row("parameters", rp.total * pb, f"{rp.total / 1e9:.2f}B x {cfg.model.dtype}")]
    lora = cfg.actor.lora
    if lora.enabled:  # the base frozen (no gradients, no optimizer state); fp32 adapters train (CPU-path optimizer)
        ad = lora_rank_params(spec, lora, (lay.tp, lay.ep, lay.etp), layers)
        rows[0] = Row("parameters", rp.total * pb, f"{rp.total / 1e9:.2f}B x {cfg.model.dtype}, frozen (actor.lora)")
        rows += [
            Row("LoRA adapters", ad.total * 4, f"{ad.total / 1e6:.1f}M x float32, rank {lora.rank}"),
            Row("gradients", ad.total * 4, "the adapters' fp32 grads (the base has none)"),
            Row("optimizer state", ad.total * 8, "the adapters' AdamW exp_avg + exp_avg_sq in fp32, unsharded"),
        ]
    else:
        rows += _optimizer_rows(rp, cfg, layout, "", cfg.actor.distributed_optimizer)
    if cfg.algorithm.kl_coef > 0 and not lora.enabled:  # LoRA's reference: the actor with its adapters off
        rows.append(Row("reference model", rp.total * pb, "algorithm.kl_coef > 0: a frozen copy, no grads"))
    if cfg.algorithm.advantage == "gae":
        last = stage == layout.pp - 1
        head = padded_vocab(spec.vocab_size, layout.tp) * spec.hidden // layout.tp if last else 0
        critic = RankParams(rp.dense - head + (spec.hidden if last else 0), rp.experts)
        rows.append(Row("critic parameters", critic.total * pb, "algorithm.advantage=gae: the actor's layout"))
        rows += _optimizer_rows(critic, cfg, layout, "critic ", False)  # the critic's own FP32Optimizer, no DDP
    rows.append(
        Row("activations", activations(spec, cfg, layout, layers, stage, seq), f"{len(layers)} layers, estimate")
    )
    if stage == layout.pp - 1:
        t = _microbatch_tokens(cfg, seq) // layout.cp
        full = t * padded_vocab(spec.vocab_size, layout.tp) // layout.tp * 4
        fused = cfg.actor.fused_logprob and not cfg.trainer.true_on_policy  # true on-policy on GPU: full log_softmax
        logits = min(full, FUSED_LOGITS_CHUNK) if fused else 2 * full
        how = "fused log-prob chunk" if fused else "full [tokens, vocab/tp] fp32 logits + log-softmax"
        rows.append(Row("log-prob logits", logits, how))
    if cfg.actor.router_replay != "off":
        moe_here = sum(spec.is_moe(i) for i in layers)
        samples = cfg.data.prompts_per_step * cfg.sampling.n
        size = route_dtype(spec.num_experts).itemsize
        rows.append(
            Row(
                "route records",
                samples * seq * moe_here * spec.topk * size,
                f"host memory, not in the total: {samples} samples x {seq} tokens x {moe_here} MoE layers x "
                f"top-{spec.topk} x {size} B",
                host=True,
            )
        )
    rows.append(Row("weight-sync bucket", cfg.rollout.weight_sync_bucket_mb * 2**20, "rollout.weight_sync_bucket_mb"))
    label = f"trainer, PP stage {stage}" if layout.pp > 1 else "trainer"
    return RankTable("trainer", label, layout.gpus // layout.pp, rows, parameters_per_rank=rp.total)


def engine_table(spec: ModelSpec, counts: ParamCounts, cfg: Any, layout: Layout, gpu_bytes: int) -> RankTable:
    """The rows of one engine GPU (one vLLM worker): weights, workspace, and the KV cache that
    rollout.gpu_memory_utilization leaves; `extra` holds what the step's samples need."""
    r = cfg.rollout
    size = engine_dtype_bytes(r.dtype)
    tp = layout.engine_tp
    weights = engine_rank_params(spec, counts, tp) * size
    # vLLM's offline defaults (engine/arg_utils.py): 16384 batched tokens and 1024 sequences on GPUs of >= 70 GiB
    # (an 80 GiB A100 keeps the smaller ones; the plan does not know the GPU's name)
    big = gpu_bytes >= 70 * GIB
    batched = r.max_num_batched_tokens or (2 if big else 1) * ENGINE_BATCHED_TOKENS
    seqs = (4 if big else 1) * ENGINE_MAX_SEQS
    h = spec.hidden
    workspace = int(batched * (4 * h + 2 * spec.topk * h + 4 * spec.topk * spec.moe_ffn / tp) * size)
    workspace += seqs * spec.vocab_size * 4 + ENGINE_OVERHEAD  # logits all-gathered to the whole vocabulary
    budget = int(r.gpu_memory_utilization * gpu_bytes)
    kv = budget - weights - workspace
    per_token = kv_bytes_per_token(spec, tp, str(r.dtype))
    ln = lengths(cfg, spec)
    samples = cfg.data.prompts_per_step * cfg.sampling.n * layout.dp // layout.engines
    context = r.max_model_len or spec.max_position
    rows = [
        Row("weights", weights, f"{r.dtype}, tp={tp}"),
        Row("workspace", workspace, f"estimate: {batched} batched tokens, logits, CUDA context"),
        Row("KV cache", max(kv, 0), f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} x GPU - the rest"),
    ]
    extra = {
        "kv_available_bytes": kv,
        "kv_bytes_per_token": per_token,
        "kv_needed_bytes": samples * ln.sequence * per_token,
        "kv_min_bytes": context * per_token,
        "samples": samples,
        "budget_bytes": budget,
    }
    return RankTable("engine", f"engine GPU (tp={tp})", layout.engines * tp, rows, extra=extra)


def static_bytes(table: RankTable) -> int:
    """What a trainer rank holds between its passes (everything but activations and logits)."""
    return sum(r.bytes for r in table.rows if r.name not in ("activations", "log-prob logits") and not r.host)


def verdicts(
    trainers: list[RankTable], engine: RankTable, cfg: Any, layout: Layout, gpu_bytes: int
) -> list[GpuVerdict]:
    """Each kind of GPU and whether it fits. Engines sit on PP stage 0's GPUs (an engine's workers take its leader's
    GPU and the next tensor_parallel_size - 1; leaders are the lowest rank of the data-parallel ranks they serve)."""
    out = []
    first = trainers[0]
    hosts = engine.count
    for i, t in enumerate(trainers):
        count = t.count - (hosts if i == 0 else 0)
        if count:
            out.append(GpuVerdict(t.label, count, t.total, t.total <= gpu_bytes))
    e = engine.extra
    notes = []
    kv = e["kv_available_bytes"]
    engine_ok = kv >= e["kv_min_bytes"]
    if not engine_ok:
        notes.append(
            f"the engine's KV cache ({kv / GIB:.1f} GiB) cannot hold one {e['kv_min_bytes'] // e['kv_bytes_per_token']}"
            "-token sequence (vLLM refuses to start): raise rollout.gpu_memory_utilization or engine TP, or lower "
            "rollout.max_model_len"
        )
    elif kv < e["kv_needed_bytes"]:
        waves = math.ceil(e["kv_needed_bytes"] / kv)
        notes.append(f"the step's {e['samples']} samples need {waves}x the KV cache: they run in about {waves} waves")
    awake = first.total + e["budget_bytes"]
    asleep = max(static_bytes(first) + e["budget_bytes"], first.total + ENGINE_OVERHEAD)
    sleep = cfg.rollout.sleep_while_training
    peak = asleep if sleep else awake
    if "trainer-offload" in layout.assumed:  # generating: the engine alone; training: the trainer, the engine asleep
        peak = max(e["budget_bytes"], first.total + ENGINE_OVERHEAD)
    elif not sleep and awake > gpu_bytes and asleep <= gpu_bytes:
        notes.append("trainer and engine fit together only with rollout.sleep_while_training=true")
    if static_bytes(first) + e["budget_bytes"] > gpu_bytes and "trainer-offload" not in layout.assumed:
        room = (gpu_bytes - static_bytes(first)) / gpu_bytes
        notes.append(
            f"the trainer's states leave {max(room, 0):.2f} of the GPU for the engine: lower "
            "rollout.gpu_memory_utilization or spread the model over more ranks"
        )
    label = f"{first.label} + engine"
    out.append(GpuVerdict(label, hosts, peak, engine_ok and peak <= gpu_bytes, notes))
    return out
