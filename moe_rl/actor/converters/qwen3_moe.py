"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k with `norm_topk_prob`, dense `mlp_only_layers`."""

from moe_rl.actor.converters.base import Converter


class Qwen3MoeConverter(Converter):
    model_type = "qwen3_moe"
    qk_norm = "per_head"

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.cfg.moe_intermediate_size
