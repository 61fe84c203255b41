"""Mixtral: no q/k norm, experts under `block_sparse_moe` with w1/w3/w2, top-k renormalised."""

from moe_rl.actor.converters.base import Converter


class MixtralConverter(Converter):
    model_type = "mixtral"
    moe_prefix = "block_sparse_moe"
    expert_proj = ("w1", "w3", "w2")

    @property
    def num_experts(self) -> int:
        return self.cfg.num_local_experts

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.cfg.intermediate_size

    @property
    def norm_topk_prob(self) -> bool:
        return True  # Mixtral's router is softmax over the top-k logits.

    def transformer_config_kwargs(self):
        if getattr(self.cfg, "sliding_window", None):
            raise ValueError(
                f"mixtral: sliding_window={self.cfg.sliding_window} is not supported by the Megatron actor"
            )
        return super().transformer_config_kwargs()
