"""Hydra config: the YAML matches the schema, overrides work, malformed ones fail naming the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_rl.config import TrainConfig, register_configs, validate

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _compose(overrides=()):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="train_moe", overrides=list(overrides))


def test_yaml_sets_every_schema_key_and_defaults_validate():
    cfg = _compose()
    obj: TrainConfig = OmegaConf.to_object(cfg)
    validate(obj, world_size=2)
    yaml = OmegaConf.load(Path(CONF) / "train_moe.yaml")
    for f in dataclasses.fields(TrainConfig):
        group_fields = {g.name for g in dataclasses.fields(getattr(obj, f.name))}
        assert set(yaml[f.name].keys()) == group_fields, f"conf/train_moe.yaml {f.name}: keys differ from schema"


def test_overrides_from_the_issue_work():
    obj = OmegaConf.to_object(_compose(["parallel.ep=2", "actor.router_replay=r2", "algorithm.correction=tis"]))
    assert (obj.parallel.ep, obj.actor.router_replay, obj.algorithm.correction) == (2, "r2", "tis")
    validate(obj, world_size=2)


@pytest.mark.parametrize(
    "override,match",
    [
        ("actor.router_replayy=r2", "router_replayy"),  # unknown key
        ("actor.lr=fast", "lr"),  # wrong type
    ],
)
def test_schema_errors_name_the_key(override, match):
    with pytest.raises(Exception, match=match):
        _compose([override])


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (["algorithm.correction=mis"], 2, "config algorithm.correction: 'mis' is not one of"),
        (["actor.router_replay=r4"], 2, "config actor.router_replay"),
        (["rollout.capture=none"], 2, "r3 replays the rollout engine's routes"),
        (["parallel.ep=3"], 2, "config parallel: .*ep\\*etp = 3\\*1 must divide"),
        (["parallel.tp=2"], 2, "tp/pp/cp > 1 with rollout.topology=per_rank"),
        (["actor.mini_batches=5"], 2, "config actor.mini_batches: 5 does not divide the 32 samples"),
        (["data.task=file"], 1, "config data.path"),
        (["logging.wandb_mode=on"], 1, "config logging.wandb_mode"),
    ],
)
def test_inconsistent_configs_fail_before_heavy_work(overrides, world, match):
    obj = OmegaConf.to_object(_compose(overrides))
    with pytest.raises(ValueError, match=match):
        validate(obj, world_size=world)


def test_cli_help_shows_examples():
    out = subprocess.run(
        [sys.executable, "launch/train_moe.py", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(CONF).parent,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "router_replay" in out.stdout and "Powered by Hydra" in out.stdout
