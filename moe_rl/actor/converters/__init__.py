"""One converter per HF architecture family; `get_converter` picks it by `config.model_type`."""

from typing import Any

from moe_rl.actor.converters.base import Converter
from moe_rl.actor.converters.deepseek_v3 import DeepseekV3Converter
from moe_rl.actor.converters.glm4_moe import Glm4MoeConverter
from moe_rl.actor.converters.gpt_oss import GptOssConverter
from moe_rl.actor.converters.mixtral import MixtralConverter
from moe_rl.actor.converters.olmoe import OlmoeConverter
from moe_rl.actor.converters.qwen3_moe import Qwen3MoeConverter

CONVERTERS: dict[str, type[Converter]] = {
    c.model_type: c
    for c in (
        Qwen3MoeConverter,
        MixtralConverter,
        OlmoeConverter,
        Glm4MoeConverter,
        DeepseekV3Converter,
        GptOssConverter,
    )
}


def get_converter(hf_config: Any) -> Converter:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in CONVERTERS:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {sorted(CONVERTERS)}")
    return CONVERTERS[model_type](hf_config)


__all__ = ["CONVERTERS", "Converter", "get_converter"]
