"""The settings whose right value depends on the machine, and the one place `auto` becomes a value: the trainer
resolves them for the machine it runs on (moe_rl.common.platform.this_machine), the planner for a CUDA machine with
Transformer Engine, by the same function. Torch-free: the machine is an argument, probed elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO = "auto"

MACHINE_KEYS = ("model.transformer_engine", "model.dtype", "rollout.dtype")
"""The keys that default to `auto`: on CUDA (with Transformer Engine installed) Transformer Engine on and 16-bit
weights in the actor and the engine; on CPU megatron's local layer spec and float32 (bf16 GEMMs need AVX-512 there,
and the tests compare float32 runs against references)."""


@dataclass(frozen=True)
class Machine:
    """What the `auto` settings depend on."""

    cuda: bool
    transformer_engine: bool  # the transformer_engine package is installed (read only with CUDA)

    def describe(self) -> str:
        if not self.cuda:
            return "CPU"
        return "CUDA, Transformer Engine" if self.transformer_engine else "CUDA, no Transformer Engine"


CUDA_WITH_TE = Machine(cuda=True, transformer_engine=True)
"""The machine a plan is made for (moe-rl-plan, wherever it runs)."""


def resolve_model(model: Any, machine: Machine) -> None:
    """model.transformer_engine and model.dtype, where `auto`, set for `machine` (in place)."""
    if model.transformer_engine == AUTO:
        model.transformer_engine = machine.cuda and machine.transformer_engine
    if model.dtype == AUTO:
        model.dtype = "bfloat16" if machine.cuda else "float32"


def resolve(cfg: Any, machine: Machine) -> None:
    """Every `auto` of MACHINE_KEYS in a run's config (TrainConfig, or SFTConfig, which has no rollout section) set
    for `machine`, in place; set keys are left as they are."""
    resolve_model(cfg.model, machine)
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and rollout.dtype == AUTO:
        rollout.dtype = "bfloat16" if machine.cuda else "float32"


def machine_settings(cfg: Any) -> dict[str, Any]:
    """{key: value} of MACHINE_KEYS in a (resolved) config, as an override writes them (true, bfloat16)."""
    out = {}
    for key in MACHINE_KEYS:
        section, name = key.split(".")
        if hasattr(cfg, section):
            value = getattr(getattr(cfg, section), name)
            out[key] = value if isinstance(value, bool) else str(value)
    return out


def settings_line(cfg: Any, machine: Machine) -> str:
    """The run header's line (and the plan's) of the machine settings."""
    shown = ", ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in machine_settings(cfg).items())
    return f"machine settings ({machine.describe()}; `auto` resolves here): {shown}"
