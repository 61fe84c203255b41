"""GPT-OSS (`gpt_oss`): GQA attention with biases and a learnable sink per head (megatron-core's
`softmax_type="learnable"`), sliding-window attention on the layers `layer_types` names, YaRN RoPE, a router
with a bias (top-k of the logits, softmax over the k), and experts with biases and a clamped SwiGLU with an
offset: `(clamp(up, ±limit) + 1) * g * sigmoid(1.702 g)`, `g = min(gate, limit)` — megatron-core's
`quick_gelu` with `glu_linear_offset=1` and `activation_func_clamp_value=limit`.

HF stores a layer's experts stacked (`experts.gate_up_proj` [E, hidden, 2 * ffn] with gate and up columns
interleaved, `experts.down_proj` [E, ffn, hidden], their biases [E, ...]); megatron holds one MLP per expert.
Each expert parameter maps to its slice of the stacked tensor (`expert_slice`); `ExpertStacker` puts the slices
back together wherever whole HF tensors are needed (export, weight sync into vLLM).
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from moe_rl.actor.converters.base import Converter
from moe_rl.common.hf_names import expert_slice

_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.(weight|bias)$")
QUICK_GELU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's `quick_gelu`, not compiled: megatron wraps its own in torch.compile (`jit_fuser`), so the
    first forward compiled it with Inductor on the CPU (2 s) and left Inductor's compile workers behind, with which
    about one rank exit in ten hung for good. megatron compares the function only on its fused paths, which moe-rl
    turns off (bias_activation_fusion=False)."""
    return x * torch.sigmoid(QUICK_GELU_ALPHA * x)


class GptOssConverter(Converter):
    model_type = "gpt_oss"

    def __init__(self, hf_config: Any):
        super().__init__(hf_config)
        c = hf_config
        alpha = float(getattr(c, "swiglu_alpha", QUICK_GELU_ALPHA))
        if not math.isclose(alpha, QUICK_GELU_ALPHA):
            raise ValueError(
                f"config.json swiglu_alpha={alpha}: megatron-core's quick_gelu has 1.702 built in, so the actor "
                "cannot match this model"
            )
        q = getattr(c, "quantization_config", None)
        quant = q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)
        if quant:
            raise ValueError(
                f"config.json quantization_config.quant_method={quant!r}: the actor trains 16-bit weights. Dequantize "
                "the release once (transformers: from_pretrained(path, quantization_config=Mxfp4Config(dequantize="
                "True), dtype=torch.bfloat16).save_pretrained(out)) and train from that folder "
                "(docs: reference/families)"
            )
        if not getattr(c, "attention_bias", True):
            raise ValueError("config.json attention_bias=false: GPT-OSS's converter expects biased projections")

    @property
    def num_experts(self) -> int:
        return self.cfg.num_local_experts

    @property
    def moe_ffn_hidden_size(self) -> int:
        return self.cfg.intermediate_size

    @property
    def norm_topk_prob(self) -> bool:
        return True  # softmax over the top-k logits, as megatron's topk-then-softmax

    def sliding_layers(self) -> list[int]:
        """1 for a decoder layer with sliding-window attention, 0 for a full one."""
        types = getattr(self.cfg, "layer_types", None) or ["full_attention"] * self.num_layers
        return [int(t == "sliding_attention") for t in types]

    @property
    def sliding_window(self) -> int | None:
        """Keys a query sees on a sliding layer, itself included (HF: q - k < window)."""
        w = getattr(self.cfg, "sliding_window", None)
        return int(w) if w and any(self.sliding_layers()) else None

    def layout_problems(self, parallel) -> list[str]:
        problems = []
        if parallel.cp > 1:
            problems.append(
                f"parallel.cp={parallel.cp}: moe-rl's context-parallel attention has no attention sinks or sliding "
                "window (and Transformer Engine's has not been run with them here)"
            )
        if parallel.etp > 1:
            problems.append(f"parallel.etp={parallel.etp}: megatron-core supports expert biases only with etp=1")
        return problems

    def transformer_config_kwargs(self) -> dict[str, Any]:
        kwargs = super().transformer_config_kwargs()
        kwargs.update(
            add_bias_linear=True,  # o_proj, the router and every expert
            add_qkv_bias=True,
            activation_func=quick_gelu,
            glu_linear_offset=1.0,
            activation_func_clamp_value=float(self.cfg.swiglu_limit),
            softmax_type="learnable",  # the sinks
        )
        if self.sliding_window:
            # megatron masks i - j > window_size[0]; HF and vLLM keep `sliding_window` keys, the query's own included
            kwargs.update(window_size=(self.sliding_window - 1, 0), window_attn_skip_freq=self.sliding_layers())
        return kwargs

    def rope(self) -> tuple[str, dict[str, Any]]:
        rp = getattr(self.cfg, "rope_parameters", None) or {}
        if rp.get("rope_type", "default") == "default":
            return "rope", {}
        if rp["rope_type"] != "yarn":
            raise ValueError(f"config.json rope_parameters.rope_type={rp['rope_type']!r}: only default and yarn")
        return "yarn", {
            # read by megatron's YarnRotaryEmbedding and its attention's concentration factor
            "yarn_rotary_scaling_factor": float(rp["factor"]),
            "yarn_original_max_position_embeddings": int(rp["original_max_position_embeddings"]),
            "yarn_beta_fast": float(rp.get("beta_fast", 32.0)),
            "yarn_beta_slow": float(rp.get("beta_slow", 1.0)),
            "yarn_mscale": None,  # HF's attention factor: 0.1 ln(factor) + 1
            "yarn_mscale_all_dim": None,
            "yarn_correction_range_round_to_int": bool(rp.get("truncate", True)),
        }

    def hf_names(self, mcore_name: str) -> list[str]:
        parts = mcore_name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["decoder", "layers"]:
            return super().hf_names(mcore_name)
        layer, rest = int(parts[2]), parts[3]
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        named = {
            "self_attention.core_attention.softmax_offset": f"{attn}.sinks",
            "self_attention.linear_proj.bias": f"{attn}.o_proj.bias",
            "mlp.router.weight": f"{mlp}.router.weight",
            "mlp.router.bias": f"{mlp}.router.bias",
        }
        if rest in named:
            return [named[rest]]
        e = _EXPERT.match(rest)
        if e:
            stacked = {
                ("linear_fc1", "weight"): "gate_up_proj",
                ("linear_fc1", "bias"): "gate_up_proj_bias",
                ("linear_fc2", "weight"): "down_proj",
                ("linear_fc2", "bias"): "down_proj_bias",
            }[e.group(2), e.group(3)]
            return [expert_slice(f"{mlp}.experts.{stacked}", int(e.group(1)), self.num_experts)]
        return super().hf_names(mcore_name)

    def to_mcore(self, mcore_name: str, get, padded_vocab: int) -> torch.Tensor:
        if ".local_experts." not in mcore_name:
            return super().to_mcore(mcore_name, get, padded_vocab)
        (t,) = (get(n) for n in self.hf_names(mcore_name))
        if mcore_name.endswith("linear_fc1.weight"):  # [hidden, 2 ffn] interleaved -> [gate; up] x hidden
            return torch.cat([t[:, 0::2].t(), t[:, 1::2].t()]).contiguous()
        if mcore_name.endswith("linear_fc1.bias"):
            return torch.cat([t[0::2], t[1::2]])
        if mcore_name.endswith("linear_fc2.weight"):  # [ffn, hidden] -> [hidden, ffn]
            return t.t().contiguous()
        return t

    def to_hf(self, mcore_name: str, full: torch.Tensor) -> dict[str, torch.Tensor]:
        if ".local_experts." not in mcore_name:
            return super().to_hf(mcore_name, full)
        (name,) = self.hf_names(mcore_name)
        if mcore_name.endswith("linear_fc1.weight"):
            gate, up = full.chunk(2, dim=0)
            return {name: torch.stack([gate.t(), up.t()], dim=-1).reshape(gate.shape[1], -1)}
        if mcore_name.endswith("linear_fc1.bias"):
            gate, up = full.chunk(2)
            return {name: torch.stack([gate, up], dim=-1).reshape(-1)}
        if mcore_name.endswith("linear_fc2.weight"):
            return {name: full.t().contiguous()}
        return {name: full}
