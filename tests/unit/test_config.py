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
        (
            ["data.task=file", "data.path=/no/such/file.jsonl"],
            1,
            "config data.path: '/no/such/file.jsonl' does not exist",
        ),
        (
            ["data.reward=no_such_module:f"],
            1,
            "config data.reward: .*cannot be loaded: No module named 'no_such_module'",
        ),
        (["data.reward=moe_rl.data.rewards:TOY_HORIZON"], 1, "config data.reward: .*not a function"),
        (["data.overlong_prompts=truncate"], 1, "config data.overlong_prompts"),
        (["logging.wandb_mode=on"], 1, "config logging.wandb_mode"),
        (["sampling.n=1"], 1, "config sampling.n: 1: algorithm.advantage=grpo compares samples within a group"),
        (["sampling.n=1", "algorithm.advantage=rloo"], 1, "config sampling.n: 1: algorithm.advantage=rloo"),
        (["sampling.n=0", "algorithm.advantage=reinforce"], 1, "config sampling.n: must be >= 1"),
        (["sampling.temperature=0"], 1, "config sampling.temperature: 0.0: training needs sampling"),
        (["sampling.max_tokens=0"], 1, "config sampling.max_tokens: 0: must be >= 1"),
        (["actor.micro_batch_size=0"], 1, "config actor.micro_batch_size: 0: must be >= 1"),
        (["actor.mini_batches=0"], 1, "config actor.mini_batches: 0: must be >= 1"),
        (["trainer.max_skipped_steps=0"], 1, "config trainer.max_skipped_steps"),
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


def test_group_free_advantage_accepts_one_sample_per_prompt():
    obj = OmegaConf.to_object(_compose(["sampling.n=1", "algorithm.advantage=reinforce", "actor.mini_batches=1"]))
    validate(obj, world_size=1)


@pytest.mark.parametrize(
    "override,key",
    [
        ("sampling.n=1", "sampling.n"),
        ("sampling.temperature=0", "sampling.temperature"),
        ("actor.micro_batch_size=0", "actor.micro_batch_size"),
        ("sampling.max_tokens=0", "sampling.max_tokens"),
        ("data.path=/no/such.jsonl", "data.path"),
        ("data.reward=no_such_module:f", "data.reward"),
    ],
)
def test_settings_that_cannot_learn_fail_fast_before_any_engine(override, key, tmp_path):
    """The trainer's own entry point: non-zero exit, the key named, no model and no engine built."""
    import time

    extra = ["data.task=file"] if key == "data.path" else []
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "launch/train_moe.py", override, *extra, f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=Path(CONF).parent,
        timeout=120,
    )
    seconds = time.perf_counter() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0 and f"config {key}" in text, text[-3000:]
    assert "vLLM" not in text and not (tmp_path / "tiny_model").exists()  # nothing was built
    assert seconds < 60, seconds
