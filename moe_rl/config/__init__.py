"""Structured training config: the one source of defaults (each field's docstring is its comment).

The schema is data (torch-free; `python -c "import moe_rl.config"` imports no torch, vLLM or megatron): each part's
section beside the part (ParallelConfig in actor/config.py, RolloutConfig and SamplingConfig in rollout/config.py,
the loss and correction configs in objectives/config.py, ArithmeticConfig in data/config.py, MultiTurnConfig in
rollout/multi_turn/config.py), composed here (schema.py: TrainConfig, SFTConfig). Beside it, each in a module of its
own: `validate.validate` / `validate_sft` (the checks before anything is built, the cross-section rules among
them), `store.register_configs` (the schemas and the `algorithm/loss` / `algorithm/correction` groups in Hydra's
ConfigStore; `conf/` only picks groups) and `describe` (`describe_keys` for `--keys` / `--help`, `check_overrides`:
a command-line typo fails with the closest valid key).
"""

from moe_rl.actor.config import ParallelConfig, Recompute
from moe_rl.common.errors import ConfigError
from moe_rl.config.describe import ConfigKeyError
from moe_rl.config.schema import (
    TASK_REWARDS,
    ActorConfig,
    AlgorithmConfig,
    BufferConfig,
    CriticConfig,
    CriticReplay,
    DataConfig,
    Dtype,
    LoggingConfig,
    LRDecay,
    Mode,
    ModelConfig,
    RouterReplay,
    SaveFailure,
    SFTConfig,
    SFTDataConfig,
    SFTTask,
    SFTTrainerConfig,
    SFTValConfig,
    Task,
    TrainConfig,
    TrainerConfig,
    ValConfig,
    WandbConfig,
    WandbMode,
)
from moe_rl.data.config import ArithmeticConfig, Overlong
from moe_rl.models.config import Arch, Size
from moe_rl.objectives.config import GSPOConfig, IcePopConfig, KLType, ProxLogp
from moe_rl.rollout.config import Priority, RolloutConfig, SamplingConfig
from moe_rl.rollout.multi_turn.config import MultiTurnConfig

__all__ = [
    "TASK_REWARDS",
    "ActorConfig",
    "AlgorithmConfig",
    "Arch",
    "ArithmeticConfig",
    "BufferConfig",
    "ConfigError",
    "ConfigKeyError",
    "CriticConfig",
    "CriticReplay",
    "DataConfig",
    "Dtype",
    "GSPOConfig",
    "IcePopConfig",
    "KLType",
    "LoggingConfig",
    "LRDecay",
    "Mode",
    "ModelConfig",
    "MultiTurnConfig",
    "Overlong",
    "ParallelConfig",
    "Priority",
    "ProxLogp",
    "Recompute",
    "RolloutConfig",
    "RouterReplay",
    "SFTConfig",
    "SFTDataConfig",
    "SFTTask",
    "SFTTrainerConfig",
    "SFTValConfig",
    "SamplingConfig",
    "SaveFailure",
    "Size",
    "Task",
    "TrainConfig",
    "TrainerConfig",
    "ValConfig",
    "WandbConfig",
    "WandbMode",
]
