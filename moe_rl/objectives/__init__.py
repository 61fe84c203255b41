"""RL objectives: advantages, policy losses, mismatch corrections, KL and mismatch metrics.

Pure tensor functions (torch only; no Megatron, vLLM, configs or processes). Cross-rank
reductions happen outside them, once. Registries select implementations by config name.

The package's names load on first use (`from moe_rl.objectives import gspo_loss`), all its modules at once, so every
loss, correction and estimator is registered by then: importing the package itself imports no torch, which lets the
config schema import `moe_rl.objectives.config` (the settings of the losses and corrections) without it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "drgrpo_advantages": "advantages",
    "grpo_advantages": "advantages",
    "reinforce_advantages": "advantages",
    "rloo_advantages": "advantages",
    "AGG_MODES": "aggregation",
    "aggregate": "aggregation",
    "masked_mean": "aggregation",
    "masked_sum": "aggregation",
    "Correction": "corrections",
    "icepop_weights": "corrections",
    "seq_reject_mask": "corrections",
    "seq_tis_weights": "corrections",
    "sequence_log_ratio": "corrections",
    "tis_weights": "corrections",
    "kl_penalty": "kl",
    "MISMATCH_KEYS": "metrics",
    "mismatch_metrics": "metrics",
    "Objective": "objective",
    "LossInputs": "policy_loss",
    "gspo_loss": "policy_loss",
    "gspo_sequence_log_ratio": "policy_loss",
    "ppo_loss": "policy_loss",
    "ADVANTAGES": "registry",
    "CORRECTIONS": "registry",
    "POLICY_LOSSES": "registry",
    "Registry": "registry",
    "gae": "value",
    "gae_advantages": "value",
    "masked_whiten": "value",
    "value_loss": "value",
    "value_stats": "value",
}
"""name -> the module of this package that defines it."""

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    """A name of the package: its modules are imported on the first one asked for (all of them: each registers its
    entries), and the name is kept here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for module in dict.fromkeys(_EXPORTS.values()):
        importlib.import_module(f"{__name__}.{module}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
