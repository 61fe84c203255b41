"""What model.tiny_arch and model.tiny_size take: the built-in model's architectures and sizes (moe_rl/models/tiny.py
builds them)."""

from __future__ import annotations

from enum import StrEnum


class Arch(StrEnum):
    """The tiny model's architectures (HF model_type)."""

    qwen3_moe = "qwen3_moe"
    mixtral = "mixtral"
    olmoe = "olmoe"
    glm4_moe = "glm4_moe"
    deepseek_v3 = "deepseek_v3"
    gpt_oss = "gpt_oss"


ARCHS = tuple(m.value for m in Arch)


class Size(StrEnum):
    """The built-in model's sizes (model.tiny_size, the tool's --size)."""

    tiny = "tiny"  # 1.1M parameters (qwen3_moe): the toy task, the tests
    small = "small"  # 10.9M (qwen3_moe): learns arithmetic on 2 CPU cores in minutes (docs/guides/sft.md)
    deep = "deep"  # 12.0M (qwen3_moe): 12 narrower layers; routing differences cascade over depth (docs/stability.md)
