"""Parameter counts of a ModelSpec: the whole model, the active share, the MTP layers, and what one rank holds
under a TP/PP/EP/ETP layout.

Each decoder layer's parameters are grouped by how a tensor-parallel layout splits them (megatron-core's
layers, and vLLM's alike): `tp_split` (query/output projections, MLA up-projections, dense MLP, shared experts,
biases), `kv` (key/value projections: GQA heads split over TP, replicated once TP exceeds the KV heads), `replicated`
(norms, router, MLA down-projections, which this repo's local spec and Transformer Engine both replicate) and
`experts` (routed experts: split over EP x ETP). The counts equal transformers' own for the same config.json
(tests/unit/test_plan.py builds each model on the meta device); buffers (the expert bias e_score_correction_bias) are
not parameters there, nor here.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_rl.actor.config import ParallelConfig, lora_kinds
from moe_rl.plan.spec import ModelSpec


@dataclass(frozen=True)
class LayerParams:
    """One decoder layer's parameters, grouped by how TP splits them."""

    tp_split: int
    kv: int
    replicated: int
    experts: int

    @property
    def total(self) -> int:
        return self.tp_split + self.kv + self.replicated + self.experts

    def per_rank(self, tp: int, expert_shards: int, num_kv_heads: int) -> int:
        """What one rank holds: expert_shards = EP x ETP (trainer) or the engine's TP (vLLM splits experts over TP)."""
        kv_heads_per_rank = max(1, num_kv_heads // tp)  # vLLM replicates KV heads when TP exceeds them
        kv = self.kv * kv_heads_per_rank // num_kv_heads if num_kv_heads else self.kv // tp
        return self.tp_split // tp + kv + self.replicated + self.experts // expert_shards


@dataclass(frozen=True)
class ParamCounts:
    layers: tuple[LayerParams, ...]  # decoder layers, in order
    embedding: int  # vocab x hidden (unpadded, as the HF checkpoint)
    output: int  # the LM head (0 when tied to the embedding)
    final_norm: int
    mtp: int  # multi-token-prediction layers: never trained by moe-rl, counted in neither total nor active

    @property
    def total(self) -> int:
        return sum(layer.total for layer in self.layers) + self.embedding + self.output + self.final_norm

    @property
    def routed_experts(self) -> int:
        return sum(layer.experts for layer in self.layers)


def layer_params(spec: ModelSpec, layer: int) -> LayerParams:
    """Decoder layer `layer`'s parameters (MoE or dense by spec.moe_layers)."""
    h = spec.hidden
    tp_split = replicated = kv = 0
    if spec.mla:
        qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:  # q_a_proj (replicated) + q_a_layernorm, q_b_proj (split by heads)
            replicated += h * spec.q_lora_rank + spec.q_lora_rank
            tp_split += spec.q_lora_rank * spec.num_heads * qk_head
        else:
            tp_split += h * spec.num_heads * qk_head
        replicated += h * (spec.kv_lora_rank + spec.qk_rope_head_dim) + spec.kv_lora_rank  # kv_a_proj_with_mqa, norm
        tp_split += spec.kv_lora_rank * spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim)  # kv_b_proj
        tp_split += spec.num_heads * spec.v_head_dim * h  # o_proj
    else:
        q, k = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        tp_split += 2 * h * q + (q if spec.attention_bias else 0)  # q_proj, o_proj (+ q bias)
        kv += 2 * (h * k + (k if spec.attention_bias else 0))  # k_proj, v_proj (+ biases)
        replicated += {"per_head": 2 * spec.head_dim, "full_width": q + k, None: 0}[spec.qk_norm]
        replicated += h if spec.o_proj_bias else 0  # added after o_proj's TP reduction
        tp_split += spec.num_heads if spec.sinks else 0  # one sink per head
    replicated += 2 * h  # input_layernorm, post_attention_layernorm
    experts = 0
    if spec.is_moe(layer):
        replicated += spec.num_experts * (h + spec.expert_bias)  # router (+ bias)
        experts = spec.num_experts * 3 * h * spec.moe_ffn  # SwiGLU: gate, up, down
        experts += spec.num_experts * (2 * spec.moe_ffn + h) if spec.expert_bias else 0  # gate/up and down biases
        tp_split += 3 * h * spec.shared_ffn
    else:
        tp_split += 3 * h * spec.dense_ffn
    return LayerParams(tp_split, kv, replicated, experts)


def mtp_layer_params(spec: ModelSpec) -> int:
    """One MTP layer as DeepSeek-V3 and GLM-4.5 ship it: enorm, hnorm, eh_proj [h, 2h], a full MoE decoder layer and
    shared_head.norm; its embedding and output head are the main model's (DeepSeek-V3's checkpoint stores copies
    of them, which its 685B = 671B + 14B counts). Megatron's MTP block has the same parts."""
    moe_layer = spec.moe_layers[-1]
    return 3 * spec.hidden + 2 * spec.hidden * spec.hidden + layer_params(spec, moe_layer).total


def count(spec: ModelSpec) -> ParamCounts:
    layers = tuple(layer_params(spec, i) for i in range(spec.num_layers))
    embedding = spec.vocab_size * spec.hidden
    return ParamCounts(
        layers=layers,
        embedding=embedding,
        output=0 if spec.tie_embeddings else embedding,
        final_norm=spec.hidden,
        mtp=spec.num_mtp_layers * mtp_layer_params(spec),
    )


def active(counts: ParamCounts, spec: ModelSpec) -> int:
    """Parameters one token passes through: everything but the routed experts, plus top-k of the routed experts
    (non-expert + routed x top-k / num_experts; shared experts count in full). MTP layers excluded."""
    routed = counts.routed_experts
    return counts.total - routed + routed * spec.topk // spec.num_experts


def padded_vocab(vocab_size: int, tp: int) -> int:
    """megatron's padded vocabulary, as the actor pads it."""
    # heavy: the actor's model module (torch, megatron-core), imported on first use
    from moe_rl.actor.model import padded_vocab_size

    return padded_vocab_size(vocab_size, tp)


def balanced_ends(num_layers: int, pp: int, min_first: int = 1) -> tuple[int, int] | None:
    """parallel.first_stage_layers / last_stage_layers for pp stages where pp does not divide num_layers: the pp - 2
    middle stages m layers each, first + last the rest, first >= min_first (the first stage then reaches an MoE
    layer), both >= 1, chosen so that the largest stage is smallest; None when no such split exists."""
    options = []
    for m in range(1, -(-num_layers // pp) + 1):
        rest = num_layers - m * (pp - 2)
        for first in range(min_first, rest):
            options.append((max(m, first, rest - first), -first, first, rest - first))
    return min(options)[2:] if options else None


def stage_layers(
    num_layers: int, pp: int, vpp: int | None, stage: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Decoder layers held by pipeline rank `stage`, as the actor lays them out
    (moe_rl.actor.config.ParallelConfig.rank_layers: first / last are parallel.first_stage_layers /
    last_stage_layers)."""
    config = ParallelConfig(pp=pp, vpp=vpp, first_stage_layers=first, last_stage_layers=last)
    return config.rank_layers(num_layers)[stage]


@dataclass(frozen=True)
class RankParams:
    """What one trainer rank of a pipeline stage holds."""

    dense: int  # everything but the routed experts (sharded over data-parallel ranks by the distributed optimizer)
    experts: int  # routed experts (sharded over expert-data-parallel ranks)

    @property
    def total(self) -> int:
        return self.dense + self.experts


def trainer_rank_params(
    spec: ModelSpec,
    counts: ParamCounts,
    tp: int,
    pp: int,
    vpp: int | None,
    ep: int,
    etp: int,
    stage: int,
    first: int | None = None,
    last: int | None = None,
) -> RankParams:
    """Parameters of one megatron rank on pipeline stage `stage`: its layers' shares (dense over TP, experts over
    EP x ETP), the padded embedding (V_pad / TP) on the first stage, the output layer and final norm on the last. A
    tied embedding with pp > 1 is held on both ends (megatron keeps a copy on the last stage)."""
    dense = experts = 0
    for i in stage_layers(spec.num_layers, pp, vpp, stage, first, last):
        layer = counts.layers[i]
        dense += layer.per_rank(tp, 1, spec.num_kv_heads) - layer.experts
        experts += layer.experts // (ep * etp)
    vocab_shard = padded_vocab(spec.vocab_size, tp) * spec.hidden // tp
    if stage == 0:
        dense += vocab_shard
    if stage == pp - 1:
        dense += spec.hidden + (vocab_shard if (not spec.tie_embeddings or pp > 1) else 0)
    return RankParams(dense, experts)


def engine_rank_params(spec: ModelSpec, counts: ParamCounts, tp: int) -> int:
    """Parameters of one vLLM worker of an engine with tensor_parallel_size `tp`: every layer (no PP), experts split
    over TP (vLLM's FusedMoE without expert parallelism), embedding and LM head split over TP (vocab-parallel)."""
    layers = sum(layer.per_rank(tp, tp, spec.num_kv_heads) for layer in counts.layers)
    return layers + (counts.embedding + counts.output) // tp + counts.final_norm


def lora_rank_params(spec: ModelSpec, lora, layout_sizes: tuple[int, int, int], layers: list[int]) -> RankParams:
    """The LoRA factor elements (actor.lora: rank r, targets) one trainer rank holds for decoder layers `layers`,
    sharded as moe_rl/actor/lora.py shards them: a column-parallel linear's A whole (r x in) and B split (out / tp x
    r), a row-parallel one's A split (r x in / tp) and B whole; routed experts over EP x ETP; a router's both whole.
    `layout_sizes`: (tp, ep, etp). MLA: the q and kv up-projections (the down-projections are not adapted)."""
    if not lora.enabled:
        return RankParams(0, 0)
    tp, ep, etp = layout_sizes
    r, h = lora.rank, spec.hidden
    wanted = lora_kinds(list(lora.targets))

    def column(n_in: int, n_out: int, split: int) -> int:
        return r * n_in + r * n_out // split

    def row(n_in: int, n_out: int, split: int) -> int:
        return r * n_in // split + r * n_out

    dense = experts = 0
    for i in layers:
        if "attention" in wanted:
            if spec.mla:
                qk_head = spec.qk_nope_head_dim + spec.qk_rope_head_dim
                dense += column(spec.q_lora_rank or h, spec.num_heads * qk_head, tp)
                dense += column(spec.kv_lora_rank, spec.num_heads * (spec.qk_nope_head_dim + spec.v_head_dim), tp)
                dense += row(spec.num_heads * spec.v_head_dim, h, tp)
            else:
                qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                dense += column(h, qkv, tp) + row(spec.num_heads * spec.head_dim, h, tp)
        if spec.is_moe(i):
            if "experts" in wanted:
                per_expert = column(h, 2 * spec.moe_ffn, etp) + row(spec.moe_ffn, h, etp)
                experts += spec.num_experts // ep * per_expert
            if "shared_experts" in wanted and spec.shared_ffn:
                dense += column(h, 2 * spec.shared_ffn, tp) + row(spec.shared_ffn, h, tp)
            if "router" in wanted:  # replicated: A (r x h) and B (experts x r) on every rank
                dense += r * h + spec.num_experts * r
        elif "mlp" in wanted:
            dense += column(h, 2 * spec.dense_ffn, tp) + row(spec.dense_ffn, h, tp)
    return RankParams(dense, experts)
