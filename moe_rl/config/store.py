"""Hydra's side of the schema: `register_configs` stores the train and SFT schemas and one option of the
`algorithm/loss` and `algorithm/correction` groups per registered loss and correction (their names and config
dataclasses as moe_rl/objectives/config.py lists them), so `conf/` only picks groups."""

from __future__ import annotations

from moe_rl.config.schema import SFTConfig, TrainConfig
from moe_rl.objectives.config import CORRECTION_NAMES, POLICY_LOSS_NAMES

GROUPS = {"algorithm/loss": POLICY_LOSS_NAMES, "algorithm/correction": CORRECTION_NAMES}
"""Config groups whose options are registered config dataclasses."""


def register_configs() -> None:
    """The schemas (`train_moe_schema`, `sft_moe_schema`) and one group option per registered loss and correction."""
    # heavy: hydra and omegaconf, imported on first use
    from hydra.core.config_store import ConfigStore
    from omegaconf import MISSING, OmegaConf

    cs = ConfigStore.instance()
    schema = OmegaConf.structured(TrainConfig)
    # Filled by the algorithm preset (conf/algorithm/): a typed slot could not take another
    # loss's dataclass; the Python default (GSPO + IcePop) is the preset's.
    schema.algorithm.loss = MISSING
    schema.algorithm.correction = MISSING
    cs.store(name="train_moe_schema", node=schema)
    cs.store(name="sft_moe_schema", node=OmegaConf.structured(SFTConfig))
    for group, names in GROUPS.items():
        for name, cls in names.configs().items():
            cs.store(group=group, name=name, node=cls)
