"""GLM-4.5 (`glm4_moe`): GQA attention with q/k/v bias, optional per-head q/k norm, partial RoPE,
and the DeepSeek-V3 router — sigmoid scores, an expert bias that only selects, group-limited top-k,
gates renormalised and scaled — with shared experts and a leading block of dense layers.

megatron-core implements the same router (`moe_router_score_function="sigmoid"` with
`moe_router_enable_expert_bias`) with two differences that we refuse rather than approximate:
its sigmoid gates are always renormalised over the top-k, and it scores a group by the sum of
its top (k / topk_group) experts where transformers and vLLM sum the top 2.
"""

from __future__ import annotations

from typing import Any

from moe_rl.actor.converters.base import Converter


class SigmoidRouterConverter(Converter):
    """Shared by the families with DeepSeek-V3 routing: the router, shared experts and checks."""

    router_dtype = "fp32"  # transformers and vLLM compute these routers' logits in fp32

    @property
    def num_experts(self) -> int:
        return self.cfg.n_routed_experts

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.cfg.moe_intermediate_size

    def check_router(self) -> None:
        """Refuse router settings megatron-core cannot reproduce, naming the config.json keys."""
        c = self.cfg
        k, groups, keep = c.num_experts_per_tok, c.n_group or 1, c.topk_group or 1
        if not c.norm_topk_prob and k > 1:
            raise ValueError(
                f"config.json norm_topk_prob=false (num_experts_per_tok={k}): megatron-core always "
                "renormalises sigmoid gates over the top-k, so the actor cannot match this model"
            )
        if 1 < groups and keep < groups and k // keep != 2:
            raise ValueError(
                f"config.json n_group={groups}, topk_group={keep}, num_experts_per_tok={k}: transformers "
                f"and vLLM score a group by its top-2 experts, megatron-core by its top "
                f"num_experts_per_tok // topk_group = {k // keep}; they agree only when that is 2"
            )
        if getattr(c, "scoring_func", "sigmoid") != "sigmoid":
            raise ValueError(f"config.json scoring_func={c.scoring_func!r}: only 'sigmoid' is supported")

    def transformer_config_kwargs(self) -> dict[str, Any]:
        self.check_router()
        c = self.cfg
        grouped = (c.n_group or 1) > 1 and (c.topk_group or 1) < c.n_group
        shared = getattr(c, "n_shared_experts", None) or 0
        return {
            **super().transformer_config_kwargs(),
            "moe_router_score_function": "sigmoid",
            "moe_router_pre_softmax": False,
            "moe_router_enable_expert_bias": True,
            # The bias only picks experts; megatron would nudge it after each step towards balanced
            # load (DeepSeek-V3's aux-loss-free balancing). In RL that would move routing away from the
            # checkpoint the engine serves for no reward reason, so it stays fixed unless
            # actor.expert_bias_update_rate is set.
            "moe_router_bias_update_rate": 0.0,
            "moe_router_num_groups": c.n_group if grouped else None,
            "moe_router_group_topk": c.topk_group if grouped else None,
            "moe_router_topk_scaling_factor": float(c.routed_scaling_factor or 1.0),
            "moe_shared_expert_intermediate_size": shared * self.moe_ffn_hidden_size if shared else None,
        }

    def hf_names(self, mcore_name: str) -> list[str]:
        m = _shared_or_bias(mcore_name)
        if m is None:
            return super().hf_names(mcore_name)
        layer, rest = m
        mlp = f"model.layers.{layer}.mlp"
        if rest == "mlp.router.expert_bias":
            return [f"{mlp}.gate.e_score_correction_bias"]
        if rest == "mlp.shared_experts.linear_fc1.weight":
            return [f"{mlp}.shared_experts.gate_proj.weight", f"{mlp}.shared_experts.up_proj.weight"]
        return [f"{mlp}.shared_experts.down_proj.weight"]


def _shared_or_bias(mcore_name: str) -> tuple[int, str] | None:
    parts = mcore_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and parts[3] in _SIGMOID_ROUTER_NAMES:
        return int(parts[2]), parts[3]
    return None


_SIGMOID_ROUTER_NAMES = (
    "mlp.router.expert_bias",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc2.weight",
)


class Glm4MoeConverter(SigmoidRouterConverter):
    model_type = "glm4_moe"

    def __init__(self, hf_config: Any):
        super().__init__(hf_config)
        self.qk_norm = "per_head" if getattr(hf_config, "use_qk_norm", False) else None
