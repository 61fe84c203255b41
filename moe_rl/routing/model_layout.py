"""Which decoder layers of an HF MoE config are MoE layers, how many experts, top-k.

Shared by the rollout side (route capture) and the actor side (converters), so both agree on
the `moe_layers` map of the route contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MoELayout:
    moe_layers: list[int]  # decoder layer numbers of MoE layers, in order
    num_layers: int
    num_experts: int
    topk: int


def moe_layout(hf_config: Any) -> MoELayout:
    c = hf_config
    num_layers = c.num_hidden_layers
    num_experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if not num_experts:
        raise ValueError(
            f"config.json (model_type={getattr(c, 'model_type', None)!r}) has no MoE layers "
            "(num_experts / num_local_experts missing or 0)"
        )
    dense = set(getattr(c, "mlp_only_layers", None) or [])
    dense |= set(range(getattr(c, "first_k_dense_replace", None) or 0))  # DeepSeek-V3 / GLM-4.5
    step = getattr(c, "decoder_sparse_step", None) or 1
    moe = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    if not moe:
        raise ValueError(
            "config.json: every decoder layer is dense (mlp_only_layers / decoder_sparse_step / first_k_dense_replace)"
        )
    return MoELayout(moe, num_layers, int(num_experts), int(c.num_experts_per_tok))
