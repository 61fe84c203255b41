"""A model's dimensions, read from an HF config.json (a folder, the file, or a preset name) without weights or
transformers: what the planner's counts, KV bytes and memory rows are computed from."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from moe_rl.common.errors import ConfigError
from moe_rl.routing.model_layout import MoELayout, moe_layout

PRESETS_DIR = Path(__file__).parent / "presets"
FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss")
"""The model families the trainer converts (moe_rl/actor/converters)."""


def preset_names() -> list[str]:
    """The presets: published configurations (no weights) under moe_rl/plan/presets/."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


@dataclass(frozen=True)
class ModelSpec:
    """The dimensions the planner needs. MLA models (DeepSeek-V3) have kv_lora_rank set; the others use GQA."""

    name: str
    model_type: str
    hidden: int
    num_layers: int
    vocab_size: int
    tie_embeddings: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool
    qk_norm: str | None  # None | "per_head" (qwen3_moe, glm4_moe use_qk_norm) | "full_width" (olmoe)
    dense_ffn: int  # FFN width of a dense decoder layer
    moe_ffn: int  # FFN width of one routed expert
    num_experts: int
    topk: int
    shared_ffn: int  # total FFN width of the shared experts of an MoE layer (0: none)
    moe_layers: tuple[int, ...]  # decoder layers with an MoE block (moe_rl.routing.model_layout)
    num_mtp_layers: int  # multi-token-prediction layers after the decoder (num_nextn_predict_layers)
    max_position: int
    o_proj_bias: bool = False  # gpt_oss: the output projection has a bias too
    sinks: bool = False  # gpt_oss: one learnable attention sink per head
    expert_bias: bool = False  # gpt_oss: biases on the router and on every expert's projections
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def mla(self) -> bool:
        """Multi-latent attention (DeepSeek-V3): the KV cache holds one latent per token and layer."""
        return self.kv_lora_rank is not None

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers


def load_spec(model: str) -> ModelSpec:
    """A preset name, an HF folder or a config.json path -> its ModelSpec (a ConfigError naming what is wrong)."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        if model in preset_names():
            path = PRESETS_DIR / f"{model}.json"
        else:
            raise ConfigError(
                f"--model {model!r}: neither a preset ({', '.join(preset_names())}) nor a folder or file with a "
                "config.json"
            )
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not JSON ({e})") from e
    return spec_from_config(raw, name=model)


def spec_from_config(c: dict[str, Any], name: str = "") -> ModelSpec:
    """The spec of a config.json's dict, refusing families the trainer does not convert and configs without MoE."""
    model_type = _checked_model_type(c)
    layout = _moe_layout(c, model_type)
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    # mixtral and olmoe name the expert FFN intermediate_size; every layer is MoE there
    moe_ffn = c["intermediate_size"] if model_type in ("mixtral", "olmoe", "gpt_oss") else c["moe_intermediate_size"]
    gpt_oss = model_type == "gpt_oss"
    shared = (c.get("n_shared_experts") or 0) * moe_ffn if model_type in ("glm4_moe", "deepseek_v3") else 0
    return ModelSpec(
        name=name or model_type,
        model_type=model_type,
        hidden=hidden,
        num_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or hidden // heads,
        attention_bias=bool(c.get("attention_bias", gpt_oss)),
        qk_norm=_qk_norm(c, model_type),
        dense_ffn=c.get("intermediate_size") or moe_ffn,
        moe_ffn=moe_ffn,
        num_experts=layout.num_experts,
        topk=layout.topk,
        shared_ffn=shared,
        moe_layers=tuple(layout.moe_layers),
        num_mtp_layers=c.get("num_nextn_predict_layers") or 0,
        max_position=c.get("max_position_embeddings") or 4096,
        o_proj_bias=gpt_oss and bool(c.get("attention_bias", True)),
        sinks=gpt_oss,
        expert_bias=gpt_oss,
        **_mla_dims(c, model_type),
    )


def _checked_model_type(c: dict[str, Any]) -> str:
    """The config's model_type, a ConfigError unless it is one of FAMILIES with the keys every family has."""
    model_type = c.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"config.json model_type={model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in c:
            raise ConfigError(f"config.json ({model_type}): {key} is missing")
    return model_type


def _moe_layout(c: dict[str, Any], model_type: str) -> MoELayout:
    """The config's MoE layers, expert count and top-k; a ConfigError for a config without MoE layers."""
    # the routed-expert count's spellings (transformers 5 saves qwen3_moe's as num_local_experts too)
    spellings = ("num_experts", "num_local_experts", "n_routed_experts")
    experts = next((c[k] for k in spellings if c.get(k)), 0)
    for key, value in (("/".join(spellings), experts), ("num_experts_per_tok", c.get("num_experts_per_tok"))):
        if not value:
            raise ConfigError(
                f"config.json (model_type={model_type!r}) has no MoE layers: {key} is missing or 0 (a dense model "
                "has nothing to plan here)"
            )
    try:  # the trainer's and the route capture's own map of MoE layers
        return moe_layout(SimpleNamespace(**{**c, "num_experts": experts}))
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _qk_norm(c: dict[str, Any], model_type: str) -> str | None:
    """ModelSpec.qk_norm: the family's q/k norm (glm4_moe's only with use_qk_norm)."""
    qk_norm = {"qwen3_moe": "per_head", "olmoe": "full_width"}.get(model_type)
    if model_type == "glm4_moe" and c.get("use_qk_norm"):
        qk_norm = "per_head"
    return qk_norm


def _mla_dims(c: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelSpec's multi-latent attention fields (DeepSeek-V3's); none for the GQA families."""
    if model_type != "deepseek_v3":
        return {}
    return dict(
        q_lora_rank=c.get("q_lora_rank"),
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
    )
