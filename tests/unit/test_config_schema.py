"""The config schema is data apart from the implementations: importing it loads no torch, vLLM or megatron, and
the names it offers for losses, corrections and advantage estimators are the registries' own."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from moe_rl.objectives.config import ADVANTAGE_NAMES, AGG_MODES, CORRECTION_NAMES, POLICY_LOSS_NAMES, Choices
from moe_rl.objectives.registry import Registry

HEAVY = ("torch", "vllm", "megatron", "transformers")


def test_the_schema_imports_without_torch_vllm_or_megatron():
    """A fresh interpreter: `import moe_rl.config` (every module on its path, package __init__ files included)."""
    code = (
        "import sys, moe_rl.config\n"
        f"heavy = {HEAVY!r}\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] in heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert not out.split(), f"import moe_rl.config loaded: {out.split()[:10]}"


def test_the_registries_offer_the_names_the_schema_lists():
    from moe_rl import objectives

    for registry, names in (
        (objectives.POLICY_LOSSES, POLICY_LOSS_NAMES),
        (objectives.CORRECTIONS, CORRECTION_NAMES),
        (objectives.ADVANTAGES, ADVANTAGE_NAMES),
    ):
        assert registry.choices is names
        assert registry.names() == names.names()
        assert registry.configs() == names.configs()  # same classes, in the same order (Hydra's group options)
        assert list(registry.configs()) == list(names.configs())
        for name in registry.names():
            facts = {k: v for k, v in registry.meta(name).items() if k.startswith("needs_")}
            assert facts == names.facts(name), name


def test_the_schema_lists_the_kernels_aggregations():
    from moe_rl.kernels.aggregation import AGG_MODES as KERNEL_AGG_MODES

    assert AGG_MODES == KERNEL_AGG_MODES


def test_a_registry_refuses_an_entry_its_list_does_not_name():
    @dataclass
    class AConfig:
        x: float = 1.0

    @dataclass
    class BConfig:
        x: float = 1.0

    registry = Registry("policy loss", Choices("policy loss", {"a": AConfig}))
    with pytest.raises(ValueError, match="'b' is not listed in moe_rl/objectives/config.py"):
        registry.register("b", config=BConfig)(lambda x, cfg: x)
    with pytest.raises(ValueError, match="'a': registered with config BConfig, but .* lists AConfig"):
        registry.register("a", config=BConfig)(lambda x, cfg: x)
    with pytest.raises(ValueError, match="registered with \\{'needs_groups': True\\}, but .* lists \\{\\}"):
        registry.register("a", config=AConfig, needs_groups=True)(lambda x, cfg: x)
    registry.register("a", config=AConfig)(lambda x, cfg: x)
    assert registry.name_of(AConfig()) == "a"
