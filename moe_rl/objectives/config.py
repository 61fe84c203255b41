"""`algorithm.*` choices as data: the config dataclasses of the registered losses and corrections, the KL and
pi_prox choices, the loss aggregations, and the names the registries offer (torch-free, so the config schema knows
them without importing the tensor functions that moe_rl/objectives/registry.py maps them to).

A loss, correction or advantage estimator is registered under a name listed here (`POLICY_LOSS_NAMES`,
`CORRECTION_NAMES`, `ADVANTAGE_NAMES`) and, for a loss or a correction, with the config dataclass listed with it;
the registry refuses any other (docs/extending/loss.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""algorithm.loss.agg: the loss aggregations (moe_rl/kernels/aggregation.py computes them; a unit test keeps the two
lists equal)."""


class KLType(StrEnum):
    """KL estimators (algorithm.kl_type)."""

    k1 = "k1"
    k3 = "k3"
    low_var_kl = "low_var_kl"


KL_KINDS = tuple(m.value for m in KLType)


class ProxLogp(StrEnum):
    """How pi_prox is formed (algorithm.prox_logp)."""

    recompute = "recompute"
    loglinear = "loglinear"


PROX_LOGP = tuple(m.value for m in ProxLogp)
"""algorithm.prox_logp: recompute (the old-log-prob pass) | loglinear (this module)."""


@dataclass
class GSPOConfig:
    """Sequence-level GSPO (algorithm/loss=gspo)."""

    clip_low: float = 3e-4
    """Ratio clip below 1 (the GSPO paper's 3e-4)."""
    clip_high: float = 4e-4
    """Ratio clip above 1 (the GSPO paper's 4e-4)."""
    agg: str = "seq-mean-token-mean"
    """Loss aggregation (objectives/aggregation.py): token-mean | seq-mean-token-mean | seq-mean-token-sum |
    seq-mean-token-sum-norm."""


@dataclass
class PPOConfig:
    """Token-level clipped PPO (algorithm/loss=ppo)."""

    clip_low: float = 0.2
    """Token ratio clip below 1: the ratio is clipped at 1 - clip_low."""
    clip_high: float = 0.2
    """Token ratio clip above 1: at 1 + clip_high (DAPO's clip-higher raises it, e.g. 0.28)."""
    dual_clip: float | None = 3.0
    """Bound the loss at -A * dual_clip for A < 0 (> 1; null = off); verl's clip_ratio_c."""
    agg: str = "token-mean"
    """Loss aggregation, as for GSPO."""


@dataclass
class NoCorrectionConfig:
    """No correction (algorithm/correction=none): the mismatch is only measured."""


@dataclass
class IcePopConfig:
    """IcePop token masking (algorithm/correction=icepop)."""

    low: float = 0.5
    """Tokens with k = pi_old / mu below this get weight 0."""
    high: float = 5.0
    """Tokens with k above this get weight 0."""


@dataclass
class TISConfig:
    """Token-level truncated importance sampling (algorithm/correction=tis)."""

    cap: float = 2.0
    """Weights are min(k, cap)."""


@dataclass
class SeqTISConfig:
    """Sequence-level truncated importance sampling (algorithm/correction=seq-tis)."""

    cap: float = 2.0
    """Weights are min(rho_i, cap), rho_i = prod_t k_t."""


@dataclass
class SeqMaskConfig:
    """Sequence rejection on the sequence ratio (algorithm/correction=seq-mask)."""

    low: float = 0.5
    """Sequences whose ratio prod_t pi_old / mu is below this are dropped from the loss."""
    high: float = 2.0
    """Sequences whose ratio is above this are dropped."""


@dataclass
class GeoMaskConfig:
    """Sequence rejection on the geometric mean of the token ratios (algorithm/correction=geo-mask):
    a per-token band, hence much narrower than seq-mask's."""

    low: float = 0.999
    """Sequences whose geometric-mean token ratio is below this are dropped from the loss."""
    high: float = 1.001
    """Sequences whose geometric-mean token ratio is above this are dropped."""


class Choices:
    """The names a registry offers, as the config schema sees them: each name with its config dataclass (losses and
    corrections) or None (advantage estimators), and the facts config validation reads (`needs_groups`: compares
    the samples of one prompt; `needs_values`: takes the critic's values)."""

    def __init__(self, kind: str, configs: dict[str, type | None], facts: dict[str, dict[str, bool]] | None = None):
        self.kind = kind
        self._configs = dict(configs)
        self._facts = {name: dict((facts or {}).get(name, {})) for name in configs}

    def configs(self) -> dict[str, type]:
        """name -> config dataclass of every entry that has one."""
        return {name: cls for name, cls in self._configs.items() if cls is not None}

    def config_of(self, name: str) -> type | None:
        """The config dataclass an entry is registered with (None: it takes none)."""
        return self._configs[name]

    def facts(self, name: str) -> dict[str, bool]:
        return dict(self._facts[name])

    def name_of(self, config: object) -> str:
        """The name whose config dataclass `config` is an instance of."""
        for name, cls in self._configs.items():
            if cls is not None and type(config) is cls:
                return name
        raise ValueError(
            f"{type(config).__name__} is not the config of any registered {self.kind} "
            f"(registered: {sorted(self.configs())})"
        )

    def names(self) -> list[str]:
        return sorted(self._configs)

    def __contains__(self, name: str) -> bool:
        return name in self._configs


POLICY_LOSS_NAMES = Choices("policy loss", {"gspo": GSPOConfig, "ppo": PPOConfig})
"""algorithm/loss: the policy losses (moe_rl/objectives/policy_loss.py)."""
CORRECTION_NAMES = Choices(
    "mismatch correction",
    {
        "none": NoCorrectionConfig,
        "icepop": IcePopConfig,
        "tis": TISConfig,
        "seq-tis": SeqTISConfig,
        "seq-mask": SeqMaskConfig,
        "geo-mask": GeoMaskConfig,
    },
)
"""algorithm/correction: the mismatch corrections (moe_rl/objectives/corrections.py)."""
ADVANTAGE_NAMES = Choices(
    "advantage estimator",
    {"grpo": None, "drgrpo": None, "rloo": None, "reinforce": None, "gae": None},
    facts={
        "grpo": {"needs_groups": True},  # all-zero with groups of one
        "drgrpo": {"needs_groups": True},
        "rloo": {"needs_groups": True},
        "gae": {"needs_values": True},
    },
)
"""algorithm.advantage: the advantage estimators (moe_rl/objectives/advantages.py, value.py)."""
