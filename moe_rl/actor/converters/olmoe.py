"""OLMoE: q/k RMSNorm over the full projection width (not per head), softmax top-k."""

from moe_rl.actor.converters.base import Converter


class OlmoeConverter(Converter):
    model_type = "olmoe"
    qk_norm = "full_width"

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.cfg.intermediate_size

    def transformer_config_kwargs(self):
        if getattr(self.cfg, "clip_qkv", None):
            raise ValueError(f"olmoe: clip_qkv={self.cfg.clip_qkv} is not supported by the Megatron actor")
        return super().transformer_config_kwargs()
