"""RL objectives: advantages, policy losses, mismatch corrections, KL and mismatch metrics.

Pure tensor functions (torch only; no Megatron, vLLM, configs or processes). Cross-rank
reductions happen outside them, once. Registries select implementations by config name.
"""

from moe_rl.objectives.advantages import (
    drgrpo_advantages,
    grpo_advantages,
    reinforce_advantages,
    rloo_advantages,
)
from moe_rl.objectives.aggregation import AGG_MODES, aggregate, masked_mean, masked_sum
from moe_rl.objectives.corrections import (
    Correction,
    icepop_weights,
    seq_reject_mask,
    seq_tis_weights,
    sequence_log_ratio,
    tis_weights,
)
from moe_rl.objectives.kl import kl_penalty
from moe_rl.objectives.metrics import MISMATCH_KEYS, mismatch_metrics
from moe_rl.objectives.objective import Objective
from moe_rl.objectives.policy_loss import LossInputs, gspo_loss, gspo_sequence_log_ratio, ppo_loss
from moe_rl.objectives.registry import ADVANTAGES, CORRECTIONS, POLICY_LOSSES, Registry
from moe_rl.objectives.value import gae, gae_advantages, masked_whiten, value_loss, value_stats

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "CORRECTIONS",
    "MISMATCH_KEYS",
    "POLICY_LOSSES",
    "Correction",
    "LossInputs",
    "Objective",
    "Registry",
    "aggregate",
    "drgrpo_advantages",
    "gae",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "gspo_sequence_log_ratio",
    "icepop_weights",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mismatch_metrics",
    "ppo_loss",
    "reinforce_advantages",
    "rloo_advantages",
    "seq_reject_mask",
    "seq_tis_weights",
    "sequence_log_ratio",
    "tis_weights",
    "value_loss",
    "value_stats",
]
