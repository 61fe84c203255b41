"""Train an MoE model with RL: `torchrun --nproc-per-node=N launch/train_moe.py [overrides]`.

Examples:
  torchrun --nproc-per-node=2 launch/train_moe.py                          # tiny MoE, toy task, R3+GSPO+IcePop
  torchrun --nproc-per-node=2 launch/train_moe.py parallel.ep=2 actor.router_replay=r2 algorithm.correction=tis
  python launch/train_moe.py trainer.steps=3 logging.wandb_mode=disabled    # world of 1
  python launch/train_moe.py --help                                         # every key with its default
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import OmegaConf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from moe_rl.config import TrainConfig, register_configs  # noqa: E402

register_configs()


@hydra.main(config_path="../conf", config_name="train_moe", version_base="1.3")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from moe_rl.trainer.loop import train

    train_cfg: TrainConfig = OmegaConf.to_object(cfg)
    train(train_cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
