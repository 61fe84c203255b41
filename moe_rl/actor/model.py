"""Build a megatron-core GPTModel (MoE) from a Hugging Face model folder.

CPU: local layer spec + `moe_rl.actor.norms` (sequence-parallel-capable RMSNorm), allgather
dispatcher, `moe_rl.actor.context_parallel`'s attention under CP. GPU: Transformer Engine spec
(`use_te=True`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe_rl.actor.batch_invariant import transformer_config_kwargs
from moe_rl.actor.config import ParallelConfig, Recompute
from moe_rl.actor.context_parallel import attention_class
from moe_rl.actor.converters import Converter, get_converter
from moe_rl.actor.norms import FullWidthKNorm, FullWidthQNorm, RMSNorm
from moe_rl.actor.packed_attention import packed_row_attention
from moe_rl.actor.weights import load_hf_weights
from moe_rl.common.errors import ConfigError
from moe_rl.routing.model_layout import moe_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ModelOptions:
    """Actor model options that are not in the HF config."""

    dtype: str = "float32"
    """Parameter and compute dtype: float32 | bfloat16."""
    use_te: bool = False
    """Transformer Engine layer spec (GPU only). The local spec is the CPU path."""
    router_dtype: str | None = None
    """Router logits dtype: None (model dtype, like HF and vLLM) | fp32 | fp64."""
    recompute: Recompute | None = None
    """Activation recompute: None | full | selective."""
    max_seq_len: int | None = None
    """RoPE table length; default: the HF config's max_position_embeddings."""
    expert_bias_update_rate: float = 0.0
    """Step of the expert-bias update after each optimizer step (models with an expert bias only)."""
    batch_invariant: bool = False
    """megatron-core's batch_invariant_mode (trainer.true_on_policy on GPU; see actor.batch_invariant)."""


def load_hf_config(hf_dir: str | Path) -> Any:
    """The transformers config of an HF folder, with clear errors for missing files."""
    # heavy: transformers, imported on first use
    from transformers import AutoConfig

    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise FileNotFoundError(f"model folder {hf_dir}: config.json not found")
    try:
        return AutoConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError) as e:
        model_type = json.loads((hf_dir / "config.json").read_text()).get("model_type")
        raise ValueError(f"{hf_dir}/config.json (model_type={model_type!r}) cannot be read: {e}") from e


def check_divisibility(conv: Converter, parallel: ParallelConfig) -> None:
    """Refuse parallel sizes that do not divide the model, or that its architecture cannot run, naming the key."""
    moe_layers = [i for i, moe in enumerate(conv.moe_layer_pattern()) if moe]
    check_sizes_divide(
        parallel, conv.num_heads, conv.num_kv, conv.num_experts, conv.moe_ffn_hidden_size, conv.num_layers, moe_layers
    )
    problems = conv.layout_problems(parallel)
    if problems:
        raise ConfigError(f"invalid parallel layout for model_type={conv.model_type!r}: " + "; ".join(problems))


def check_sizes_divide(
    parallel,
    num_heads: int,
    num_kv: int,
    num_experts: int,
    moe_ffn: int,
    num_layers: int,
    moe_layers: Sequence[int] = (),
) -> None:
    """check_divisibility on the model's sizes alone (the planner has no converter): one ConfigError naming every
    parallel.* key that does not divide its size, or a pipeline stage without any of `moe_layers`."""
    problems = []

    def need(ok: bool, msg: str):
        if not ok:
            problems.append(msg)

    t = parallel.tp
    need(num_heads % t == 0, f"parallel.tp={t} does not divide num_attention_heads={num_heads}")
    need(num_kv % t == 0, f"parallel.tp={t} does not divide num_key_value_heads={num_kv}")
    need(num_experts % parallel.ep == 0, f"parallel.ep={parallel.ep} does not divide num_experts={num_experts}")
    need(moe_ffn % parallel.etp == 0, f"parallel.etp={parallel.etp} does not divide the expert FFN size {moe_ffn}")
    try:
        parallel.rank_layers(num_layers, moe_layers)
    except ConfigError as e:
        problems.append(str(e))
    if problems:
        raise ConfigError("invalid parallel layout for this model: " + "; ".join(problems))


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocab padded so each TP rank holds an equal, aligned slice (megatron convention)."""
    m = multiple * tp
    return -(-vocab_size // m) * m


def transformer_config(conv: Converter, parallel: ParallelConfig, opts: ModelOptions):
    """The megatron-core (MLA)TransformerConfig of the converter's model under `parallel` and `opts`: the
    architecture's keys, the layout's, and the settings every moe-rl actor shares (no dropout, no fusions, no
    auxiliary loss, routes replayed through moe_rl.actor.replay)."""
    # heavy: megatron-core, imported on first use
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    dtype = DTYPES[opts.dtype]
    recompute = _recompute_kwargs(opts.recompute)
    arch = _architecture_kwargs(conv, opts)
    config_class = MLATransformerConfig if arch.get("multi_latent_attention") else TransformerConfig
    config = config_class(
        **arch,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        num_layers_in_first_pipeline_stage=parallel.first_stage_layers,
        num_layers_in_last_pipeline_stage=parallel.last_stage_layers,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=False,  # every parameter is loaded from the HF checkpoint
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype=opts.router_dtype or conv.router_dtype,
        moe_token_dispatcher_type="alltoall" if torch.cuda.is_available() else "allgather",
        # Replay hooks are bound per model by moe_rl.actor.replay, not through megatron's
        # process-global RouterReplay list (which a second model in the process would shift).
        moe_enable_routing_replay=False,
        moe_router_fusion=False,
        moe_grouped_gemm=False,
        **recompute,
    )
    for key, value in conv.rope()[1].items():  # YaRN's fields are MLATransformerConfig's; GPTModel reads them
        setattr(config, key, value)
    return config


def _recompute_kwargs(recompute: Recompute | None) -> dict[str, Any]:
    """megatron's recompute_* keys for model.recompute (none for null; a ValueError for another value)."""
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"])
    if recompute is not None:
        raise ValueError(f"model.recompute={recompute!r}: choose null, full or selective")
    return {}


def _architecture_kwargs(conv: Converter, opts: ModelOptions) -> dict[str, Any]:
    """The converter's model keys, with the expert-bias update rate (a ValueError when the model has no expert
    bias to update) and, with opts.batch_invariant, megatron's batch-invariant keys."""
    arch = conv.transformer_config_kwargs()
    if arch.get("moe_router_enable_expert_bias"):
        arch["moe_router_bias_update_rate"] = opts.expert_bias_update_rate
    elif opts.expert_bias_update_rate:
        raise ValueError(
            f"actor.expert_bias_update_rate={opts.expert_bias_update_rate}: model_type={conv.model_type!r} "
            "has no expert bias (e_score_correction_bias)"
        )
    if opts.batch_invariant:
        arch |= transformer_config_kwargs()
    return arch


def layer_spec(config, conv: Converter, use_te: bool, vp_stage: int | None = None):
    """Decoder block spec; on the local path the norms are swapped for SP-capable ones."""
    # heavy: megatron-core, imported on first use
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm", vp_stage=vp_stage)
    if use_te and conv.qk_norm != "full_width":
        return spec
    spec = copy.deepcopy(spec)
    mla = conv.multi_latent_attention
    cp_attention = None
    if config.context_parallel_size > 1 and not use_te:  # megatron's own is Transformer Engine's
        cp_attention = attention_class()
    if mla:
        # heavy: megatron-core (LocalMLACoreAttention subclasses its attention), imported on first use
        from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear

        from moe_rl.compat.megatron_cpu import LocalMLACoreAttention
    else:
        q_norm, k_norm = {
            "per_head": (RMSNorm, RMSNorm),
            "full_width": (FullWidthQNorm, FullWidthKNorm),
            None: (IdentityOp, IdentityOp),
        }[conv.qk_norm]
    for layer in spec.layer_specs:
        sub = layer.submodules
        attn = sub.self_attention.submodules
        if mla:  # q_a_layernorm and kv_a_layernorm
            attn.q_layernorm, attn.kv_layernorm = RMSNorm, RMSNorm
            if not use_te:
                attn.core_attention = LocalMLACoreAttention
                # The local spec splits the latent down-projections over TP and gathers their output; the
                # backward then leaves the RoPE key's gradient partial (each rank's heads only, never summed
                # over TP) and the update wrong. Replicate them, as the TE spec does ("duplicated" TELinear):
                # each rank projects its sequence slice, megatron gathers the RoPE key over SP (backward:
                # reduce-scatter) and the weights, marked sequence-parallel, get their gradients summed.
                attn.linear_q_down_proj = attn.linear_kv_down_proj = ReplicatedLinear
        else:
            attn.q_layernorm, attn.k_layernorm = q_norm, k_norm
        if cp_attention is not None:
            attn.core_attention = cp_attention
        elif not use_te:  # a packed row's attention per sample, not over the whole row
            attn.core_attention = packed_row_attention(attn.core_attention)
        if not use_te:
            sub.input_layernorm = RMSNorm
            sub.pre_mlp_layernorm = RMSNorm
            experts = getattr(sub.mlp.submodules, "experts", None)
            if config.add_bias_linear and experts is not None:
                # heavy: megatron-core (the class subclasses its linear), imported on first use
                from moe_rl.compat.megatron_cpu import ExpertRowParallelLinear

                experts.submodules.linear_fc2 = ExpertRowParallelLinear
    if not use_te:
        spec.layer_norm = RMSNorm
    return spec


def build_model(hf_config: Any, parallel: ParallelConfig, opts: ModelOptions | None = None):
    """Build this rank's model chunks (one per virtual pipeline stage) with unloaded weights.

    Returns (chunks, converter). Call after `init_distributed(parallel)`.
    """
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    opts = opts or ModelOptions()
    if opts.dtype not in DTYPES:
        raise ValueError(f"model.dtype={opts.dtype!r}: choose one of {sorted(DTYPES)}")
    conv = get_converter(hf_config)
    check_divisibility(conv, parallel)
    config = transformer_config(conv, parallel, opts)
    vocab = padded_vocab_size(conv.vocab_size, parallel.tp)
    max_len = opts.max_seq_len or getattr(hf_config, "max_position_embeddings", 4096)
    chunks = []
    for vp in range(parallel.vpp or 1):
        vp_stage = vp if parallel.vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(config, conv, opts.use_te, vp_stage),
            vocab_size=vocab,
            max_sequence_length=max_len,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=conv.tie,
            position_embedding_type=conv.rope()[0],
            rotary_percent=conv.rotary_percent,
            rotary_base=conv.rope_theta,
            vp_stage=vp_stage,
        )
        if torch.cuda.is_available():  # as megatron's get_model does: our own norms and routers are built on the host
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks, conv


@dataclass
class LoadedModel:
    """This rank's model chunks with HF weights loaded, and what describes them."""

    chunks: list[torch.nn.Module]
    conv: Converter
    hf_config: Any
    layout: Any  # moe_rl.routing.model_layout.MoELayout


def load_model(hf_dir: str | Path, parallel: ParallelConfig, opts: ModelOptions | None = None) -> LoadedModel:
    """The one model-building sequence (config -> megatron chunks -> HF weights) used by the
    trainer, the tools, the diagnostics and the benchmarks. Call after `init_distributed`."""
    hf_config = load_hf_config(hf_dir)
    layout = moe_layout(hf_config)
    chunks, conv = build_model(hf_config, parallel, opts)
    load_hf_weights(chunks, conv, hf_dir)
    return LoadedModel(chunks, conv, hf_config, layout)
