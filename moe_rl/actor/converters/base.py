"""Hugging Face <-> megatron-core name and layout mapping, shared by the MoE families.

A converter works on *full* (unsharded) tensors with *global* layer and expert indices;
`moe_rl.actor.weights` does the TP/EP/PP slicing and gathering. An architecture file states
only what differs: HF module names, q/k norm style and config fields. A family with another
attention or router (DeepSeek-V3: MLA, sigmoid grouped routing, shared experts) overrides
`transformer_config_kwargs`, `hf_names` and `to_mcore`/`to_hf` in its own file.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from moe_rl.routing.model_layout import moe_layout

# megatron-core global parameter names (local layer spec, SequentialMLP experts).
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


class Converter:
    """Mapping for a decoder-only MoE with GQA attention, SwiGLU experts and RMSNorm."""

    model_type: str = ""
    moe_prefix: str = "mlp"  # HF module holding router + experts ("block_sparse_moe" for Mixtral)
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    qk_norm: str | None = None  # None | "per_head" | "full_width"
    multi_latent_attention: bool = False  # DeepSeek-V3 MLA (MLATransformerConfig, MLA layer spec)
    router_dtype: str | None = None  # router logits dtype unless ModelOptions.router_dtype is set (None: model dtype)

    def __init__(self, hf_config: Any):
        self.cfg = hf_config
        self.num_layers: int = hf_config.num_hidden_layers
        self.num_heads: int = hf_config.num_attention_heads
        self.num_kv: int = hf_config.num_key_value_heads
        self.head_dim: int = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.num_heads
        self.hidden: int = hf_config.hidden_size
        self.vocab_size: int = hf_config.vocab_size
        self.tie = bool(getattr(hf_config, "tie_word_embeddings", False))

    # ---- architecture facts -------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        raise NotImplementedError

    @property
    def moe_ffn_hidden_size(self) -> int:
        raise NotImplementedError

    @property
    def norm_topk_prob(self) -> bool:
        return bool(getattr(self.cfg, "norm_topk_prob", True))

    def moe_layer_pattern(self) -> list[int]:
        """1 for an MoE decoder layer, 0 for a dense one."""
        moe = set(moe_layout(self.cfg).moe_layers)
        return [int(i in moe) for i in range(self.num_layers)]

    def layout_problems(self, parallel) -> list[str]:
        """Why this architecture cannot run under `parallel` (a ParallelConfig); empty when it can."""
        return []

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """megatron-core TransformerConfig fields that follow from the HF config."""
        c = self.cfg
        pattern = self.moe_layer_pattern()
        return dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden,
            num_attention_heads=self.num_heads,
            num_query_groups=self.num_kv,
            kv_channels=self.head_dim,
            ffn_hidden_size=getattr(c, "intermediate_size", self.moe_ffn_hidden_size)
            if 0 in pattern
            else self.moe_ffn_hidden_size,
            moe_ffn_hidden_size=self.moe_ffn_hidden_size,
            num_moe_experts=self.num_experts,
            moe_router_topk=c.num_experts_per_tok,
            moe_layer_freq=pattern,
            # HF: softmax over all experts, top-k, optional renormalisation. Renormalised
            # softmax-then-topk equals megatron's topk-then-softmax; without it use pre-softmax.
            moe_router_pre_softmax=not self.norm_topk_prob,
            moe_router_score_function="softmax",
            normalization="RMSNorm",
            layernorm_epsilon=c.rms_norm_eps,
            qk_layernorm=self.qk_norm is not None,
            add_bias_linear=False,
            add_qkv_bias=bool(getattr(c, "attention_bias", False)),
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
        )

    @property
    def rope_theta(self) -> float:
        rp = getattr(self.cfg, "rope_parameters", None) or {}
        return float(rp.get("rope_theta", getattr(self.cfg, "rope_theta", 10000.0)))

    def rope(self) -> tuple[str, dict[str, Any]]:
        """megatron's position_embedding_type and the TransformerConfig attributes it reads (GPT-OSS: yarn)."""
        return "rope", {}

    @property
    def rotary_percent(self) -> float:
        """Share of each head's dims that RoPE rotates (GLM-4.5: the first half)."""
        rp = getattr(self.cfg, "rope_parameters", None) or {}
        return float(rp.get("partial_rotary_factor", getattr(self.cfg, "partial_rotary_factor", None) or 1.0))

    # ---- HF names -----------------------------------------------------------------------
    def _attn(self, layer: int, what: str) -> str:
        return f"model.layers.{layer}.self_attn.{what}.weight"

    def _expert(self, layer: int, expert: int, i: int) -> str:
        return f"model.layers.{layer}.{self.moe_prefix}.experts.{expert}.{self.expert_proj[i]}.weight"

    def _dense(self, layer: int, proj: str) -> str:
        return f"model.layers.{layer}.mlp.{proj}.weight"

    def hf_names(self, mcore_name: str) -> list[str]:
        """The HF tensors that make up one global megatron-core parameter."""
        if mcore_name == "embedding.word_embeddings.weight":
            return ["model.embed_tokens.weight"]
        if mcore_name == "output_layer.weight":
            return ["model.embed_tokens.weight" if self.tie else "lm_head.weight"]
        if mcore_name == "decoder.final_layernorm.weight":
            return ["model.norm.weight"]
        m = _LAYER.match(mcore_name)
        if not m:
            raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}")
        layer, rest = int(m.group(1)), m.group(2)
        simple = {
            "input_layernorm.weight": f"model.layers.{layer}.input_layernorm.weight",
            "pre_mlp_layernorm.weight": f"model.layers.{layer}.post_attention_layernorm.weight",
            "self_attention.linear_proj.weight": self._attn(layer, "o_proj"),
            "self_attention.q_layernorm.weight": self._attn(layer, "q_norm"),
            "self_attention.k_layernorm.weight": self._attn(layer, "k_norm"),
            "mlp.router.weight": f"model.layers.{layer}.{self.moe_prefix}.gate.weight",
            "mlp.linear_fc1.weight": None,
            "mlp.linear_fc2.weight": self._dense(layer, "down_proj"),
        }
        if rest == "self_attention.linear_qkv.weight":
            return [self._attn(layer, p) for p in ("q_proj", "k_proj", "v_proj")]
        if rest == "self_attention.linear_qkv.bias":
            return [self._attn(layer, p).removesuffix("weight") + "bias" for p in ("q_proj", "k_proj", "v_proj")]
        if rest == "mlp.linear_fc1.weight":
            return [self._dense(layer, "gate_proj"), self._dense(layer, "up_proj")]
        if rest in simple:
            return [simple[rest]]
        e = _EXPERT.match(rest)
        if e:
            expert = int(e.group(1))
            if e.group(2) == "linear_fc1":
                return [self._expert(layer, expert, 0), self._expert(layer, expert, 1)]
            return [self._expert(layer, expert, 2)]
        raise KeyError(f"no HF mapping for megatron parameter {mcore_name!r}")

    # ---- layouts ------------------------------------------------------------------------
    def to_mcore(self, mcore_name: str, get: Callable[[str], torch.Tensor], padded_vocab: int) -> torch.Tensor:
        """Full megatron tensor for `mcore_name`, built from HF tensors fetched with `get`."""
        names = self.hf_names(mcore_name)
        tensors = [get(n) for n in names]
        if mcore_name.endswith("linear_qkv.weight"):
            return self._interleave_qkv(*tensors)
        if mcore_name.endswith("linear_qkv.bias"):
            return self._interleave_qkv(*(t[:, None] for t in tensors))[:, 0]
        if mcore_name.endswith("linear_fc1.weight"):
            return torch.cat(tensors, dim=0)  # [gate; up]
        (t,) = tensors
        if mcore_name in ("embedding.word_embeddings.weight", "output_layer.weight") and padded_vocab > t.shape[0]:
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], t.shape[1])])
        return t

    def to_hf(self, mcore_name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """HF tensors for one full megatron tensor (inverse of `to_mcore`)."""
        names = self.hf_names(mcore_name)
        if mcore_name.endswith("linear_qkv.weight"):
            return dict(zip(names, self._split_qkv(full), strict=True))
        if mcore_name.endswith("linear_qkv.bias"):
            return dict(zip(names, (t[:, 0] for t in self._split_qkv(full[:, None])), strict=True))
        if mcore_name.endswith("linear_fc1.weight"):
            return dict(zip(names, full.chunk(2, dim=0), strict=True))
        if mcore_name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            full = full[: self.vocab_size]
        return {names[0]: full}

    def _interleave_qkv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # megatron groups rows per KV head: [q heads of group g, k_g, v_g] for g in groups.
        g, d, h = self.num_kv, self.head_dim, q.shape[-1]
        q = q.reshape(g, (self.num_heads // g) * d, h)
        return torch.cat([q, k.reshape(g, d, h), v.reshape(g, d, h)], dim=1).reshape(-1, h)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, d, h = self.num_kv, self.head_dim, qkv.shape[-1]
        qpg = (self.num_heads // g) * d
        grouped = qkv.reshape(g, qpg + 2 * d, h)
        q, k, v = grouped.split([qpg, d, d], dim=1)
        return q.reshape(-1, h).contiguous(), k.reshape(-1, h).contiguous(), v.reshape(-1, h).contiguous()
