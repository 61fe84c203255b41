"""Supervised fine-tuning of an MoE model: `torchrun --nproc-per-node=N launch/sft_moe.py [overrides]`.

Examples:
  torchrun --nproc-per-node=2 launch/sft_moe.py                               # tiny MoE, arithmetic task
  torchrun --nproc-per-node=2 launch/sft_moe.py parallel.ep=2 data.arithmetic.operands=2 trainer.steps=100
  torchrun --nproc-per-node=2 launch/sft_moe.py data.task=file data.path=sft.jsonl data.val_path=val.jsonl \\
      model.path=/models/Qwen3-30B-A3B
  python launch/sft_moe.py --help                                             # every key with its default
  python launch/sft_moe.py --keys data                                        # data.* with defaults and comments

The run writes metrics.jsonl, checkpoints/ and, at the end, hf/ (a Hugging Face folder):
  torchrun --nproc-per-node=2 launch/train_moe.py model.path=<run dir>/hf data.task=arithmetic
Defaults: SFTConfig in moe_rl/config/schema.py.
"""

from __future__ import annotations

import logging
import os
import sys

import hydra

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _check_command_line() -> None:
    """A misspelled key fails here with the closest valid key, and a value outside a key's fixed set with the valid
    ones."""
    from moe_rl.config import ConfigError, SFTConfig
    from moe_rl.config.describe import check_overrides
    from moe_rl.tools.launcher import refuse

    try:
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")], SFTConfig)
    except ConfigError as e:
        refuse(e)


@hydra.main(config_path="../conf", config_name="sft_moe", version_base="1.3")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from moe_rl.config import ConfigError
    from moe_rl.data.prompts import DataError
    from moe_rl.tools.launcher import refuse
    from moe_rl.trainer.sft import sft

    sft_cfg = OmegaConf.to_object(cfg)  # an SFTConfig
    try:
        sft(sft_cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError) as e:  # a setting, or a data row, refused before training
        refuse(e)


if __name__ == "__main__":
    from moe_rl.common.gc_startup import defer_full_collections

    defer_full_collections()  # until the trainer is built: its imports and model make objects that all stay alive
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # The libraries' Python warnings go through logging as well: all to the run's log, to the console less those the
    # console filter (trainer/logger.py: QuietCpuEngineNotes) leaves out.
    logging.captureWarnings(True)
    from moe_rl.config import SFTConfig
    from moe_rl.config.store import register_configs
    from moe_rl.tools.launcher import print_keys
    from moe_rl.trainer.run_dir import register_run_stamp
    from moe_rl.trainer.signals import run_then_exit

    if sys.argv[1:2] == ["--keys"]:
        print_keys(sys.argv[2] if len(sys.argv) > 2 else "", SFTConfig)
        raise SystemExit(0)
    register_configs()
    register_run_stamp()
    _check_command_line()
    run_then_exit(main)
