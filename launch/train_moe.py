"""Train an MoE model with RL: `torchrun --nproc-per-node=N launch/train_moe.py [overrides]`.

Examples:
  torchrun --nproc-per-node=2 launch/train_moe.py                          # tiny MoE, toy task, R3+GSPO+IcePop
  torchrun --nproc-per-node=2 launch/train_moe.py parallel.ep=2 actor.router_replay=r2 algorithm/correction=tis
  torchrun --nproc-per-node=2 launch/train_moe.py algorithm=ppo_tis algorithm.loss.clip_high=0.28
  python launch/train_moe.py trainer.steps=3 logging.wandb.mode=disabled    # world of 1
  python launch/train_moe.py --help                                         # every key with its default
  python launch/train_moe.py --keys rollout                                 # rollout.* with defaults and comments

Defaults: the dataclasses of moe_rl/config/ (schema.py, and each part's config.py); conf/ picks groups
(algorithm=gspo_icepop | ppo_tis | grpo).
"""

from __future__ import annotations

import logging
import os
import sys

import hydra

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The top level imports hydra only: a process that multiprocessing's spawn starts from a rank imports this script
# again (megatron's checkpoint writer starts one at the first save) and needs none of moe-rl or torch for that.


def _check_command_line() -> None:
    """A misspelled key fails here with the closest valid key, and a value outside a key's fixed set with the valid
    ones, not in Hydra's words."""
    from moe_rl.config import ConfigError
    from moe_rl.config.describe import check_overrides
    from moe_rl.tools.launcher import refuse

    try:
        check_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except ConfigError as e:
        refuse(e)


@hydra.main(config_path="../conf", config_name="train_moe", version_base="1.3")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from moe_rl.config import ConfigError, TrainConfig
    from moe_rl.data.prompts import DataError
    from moe_rl.tools.launcher import refuse
    from moe_rl.trainer.loop import train

    train_cfg: TrainConfig = OmegaConf.to_object(cfg)
    try:
        train(train_cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError) as e:  # a setting, or a prompt file (every rank reads it whole), refused early
        refuse(e)


if __name__ == "__main__":
    from moe_rl.common.gc_startup import defer_full_collections

    defer_full_collections()  # until the trainer is built: its imports and model make objects that all stay alive
    # vLLM logs through the root logger that Hydra configures (the run's train_moe.log; WARNING and above on the
    # console) instead of its own handler on stdout.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # The libraries' Python warnings go through logging as well: all to the run's log, to the console less those the
    # console filter (trainer/logger.py: QuietCpuEngineNotes) leaves out.
    logging.captureWarnings(True)
    from moe_rl.config.store import register_configs
    from moe_rl.tools.launcher import print_keys
    from moe_rl.trainer.run_dir import register_run_stamp
    from moe_rl.trainer.signals import run_then_exit

    if sys.argv[1:2] == ["--keys"]:
        print_keys(sys.argv[2] if len(sys.argv) > 2 else "")
        raise SystemExit(0)
    register_configs()
    register_run_stamp()  # conf/train_moe.yaml's run directory
    _check_command_line()
    run_then_exit(main)
