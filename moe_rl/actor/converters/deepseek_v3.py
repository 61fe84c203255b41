"""DeepSeek-V3 (and Moonlight / Kimi-K2-style checkpoints with `model_type: deepseek_v3`): multi-head
latent attention and the sigmoid grouped router with expert bias, shared experts and leading dense
layers (router, shared experts and checks shared with GLM-4.5 in `glm4_moe.py`).

MLA maps one to one: q_proj (no q LoRA) or q_a_proj / q_a_layernorm / q_b_proj, kv_a_proj_with_mqa /
kv_a_layernorm / kv_b_proj, o_proj. transformers' `rope_interleave=True` RoPE (pairs de-interleaved
before rotate-half) is megatron-core MLA's own; vLLM's DeepSeek attention uses the same (GPT-J style).
HF's `head_dim` for this family is the RoPE dim, not the attention head width: never use it here.
Multi-token-prediction layers (`num_nextn_predict_layers`) are not part of the actor.
"""

from __future__ import annotations

from typing import Any

from moe_rl.actor.converters.glm4_moe import SigmoidRouterConverter

# megatron MLA name (under decoder.layers.N.self_attention.) -> HF name (under model.layers.N.self_attn.)
_MLA = {
    "linear_q_proj.weight": "q_proj.weight",
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
}


class DeepseekV3Converter(SigmoidRouterConverter):
    model_type = "deepseek_v3"
    multi_latent_attention = True

    def __init__(self, hf_config: Any):
        super().__init__(hf_config)
        c = hf_config
        self.head_dim = c.v_head_dim  # the attention output width per head (megatron kv_channels)
        self.num_kv = self.num_heads  # MLA: every head has its own key and value

    def rope_kwargs(self) -> dict[str, Any]:
        """megatron MLA rope settings from HF `rope_parameters` (default RoPE or YaRN)."""
        rp = dict(getattr(self.cfg, "rope_parameters", None) or {})
        kind = rp.get("rope_type", "default")
        if kind == "default":
            return {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        if kind != "yarn":
            raise ValueError(f"config.json rope_parameters.rope_type={kind!r}: supported are 'default' and 'yarn'")
        return {
            "rope_type": "yarn",
            "rotary_scaling_factor": float(rp["factor"]),
            "original_max_position_embeddings": int(rp["original_max_position_embeddings"]),
            "beta_fast": float(rp.get("beta_fast", 32)),
            "beta_slow": float(rp.get("beta_slow", 1)),
            "mscale": float(rp.get("mscale", 1.0)),
            "mscale_all_dim": float(rp.get("mscale_all_dim", 0.0)),
        }

    def transformer_config_kwargs(self) -> dict[str, Any]:
        c = self.cfg
        if getattr(c, "attention_bias", False):
            raise ValueError("config.json attention_bias=true: DeepSeek-V3 MLA projections have no bias here")
        if not getattr(c, "rope_interleave", True):
            raise ValueError(
                "config.json rope_interleave=false: megatron-core MLA and vLLM rotate de-interleaved pairs "
                "(rope_interleave=true, as DeepSeek-V3 checkpoints do)"
            )
        out = super().transformer_config_kwargs()
        out.update(
            multi_latent_attention=True,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_head_dim=c.qk_nope_head_dim,
            qk_pos_emb_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            rotary_base=self.rope_theta,
            qk_layernorm=True,  # q_a_layernorm and kv_a_layernorm
            **self.rope_kwargs(),
        )
        return out

    def hf_names(self, mcore_name: str) -> list[str]:
        parts = mcore_name.split(".", 4)
        if len(parts) == 5 and parts[:2] == ["decoder", "layers"] and parts[3] == "self_attention":
            if parts[4] in _MLA:
                return [f"model.layers.{parts[2]}.self_attn.{_MLA[parts[4]]}"]
        return super().hf_names(mcore_name)
