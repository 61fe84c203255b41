"""bench/vs_trl.py (moe-rl against TRL's GRPOTrainer): what the TRL side is given is what moe-rl trains with —
its composed defaults plus MOE_RL_OVERRIDES, which the trainer accepts — the toy size is the trainer's own
built-in model, and the large size has at least 100M parameters, as #54 asks."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from megatron.core.optimizer import OptimizerConfig
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from moe_rl.common.machine import MACHINE_KEYS
from moe_rl.config import TrainConfig
from moe_rl.config.store import register_configs
from moe_rl.config.validate import validate
from moe_rl.data.prompts import PromptSource
from moe_rl.models.tiny import SIZES, TinySpec, build_tokenizer, hf_config
from tests.unit.test_config import _flat

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("vs_trl", REPO / "bench" / "vs_trl.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["vs_trl"] = bench
_spec.loader.exec_module(bench)


def test_the_trl_side_gets_the_settings_moe_rl_trains_with():
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train_moe", overrides=bench.MOE_RL_OVERRIDES))
    validate(cfg, world_size=2)
    # MOE_RL_OVERRIDES change the precision (both sides follow model.dtype) and the bookkeeping the TRL side does not
    # do (wandb, checkpoints, the router-agreement diagnostic); never the algorithm, the batch, the clip, the learning
    # rate or synchronous sampling
    default = dict(_flat(OmegaConf.to_container(OmegaConf.structured(TrainConfig()))))
    changed = {k for k, v in _flat(OmegaConf.to_container(OmegaConf.structured(cfg))) if default[k] != v}
    bookkeeping = {"logging.wandb.mode", "trainer.checkpoint_every", "logging.router_agreement_every"}
    assert changed <= set(MACHINE_KEYS) | bookkeeping, changed  # the `auto` settings resolved, bf16 set
    assert cfg.trainer.max_staleness == 0 and str(cfg.rollout.dtype) == str(cfg.model.dtype)
    settings = bench.moe_rl_settings()
    default = TrainConfig()
    assert settings["prompts_per_step"] * settings["samples_per_prompt"] == 64 == 2 * 4 * default.sampling.n
    assert (settings["lr"], settings["grad_clip"], settings["mini_batches"]) == (
        cfg.actor.lr,
        cfg.actor.grad_clip,
        cfg.actor.mini_batches,
    )
    assert (settings["clip_low"], settings["clip_high"]) == (cfg.algorithm.loss.clip_low, cfg.algorithm.loss.clip_high)
    adam = OptimizerConfig()
    assert settings["adam_betas"] == [adam.adam_beta1, adam.adam_beta2] and settings["adam_eps"] == adam.adam_eps
    assert bench.toy_prompts(settings["seed"]) == [p.text for p in PromptSource("toy", seed=cfg.trainer.seed).items]


def _parameters(spec: TinySpec) -> int:
    tokenizer = build_tokenizer(spec.vocab_size)
    config = hf_config(spec, max(spec.vocab_size, len(tokenizer)), {})
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_the_toy_size_is_the_built_in_model_and_the_large_one_has_over_100m_parameters():
    toy = TinySpec(seed=1234, **bench.SIZES["toy"]["model"])
    assert toy == TinySpec(arch=TrainConfig().model.tiny_arch, seed=1234, **SIZES[TrainConfig().model.tiny_size])
    assert bench.SIZES["toy"]["max_tokens"] == TrainConfig().sampling.max_tokens
    large = TinySpec(**bench.SIZES["107m"]["model"])
    large.validate()
    assert 100e6 <= _parameters(large) < 110e6 and bench.SIZES["107m"]["max_tokens"] >= 128


def test_repeated_rounds_alternate_sides_use_a_run_folder_each_and_report_the_median(monkeypatch, tmp_path):
    calls = []

    def run(step, whole):
        return {"step_seconds": [9.0, step, step], "rewards": [0.5, 0.5, 0.5], "whole_seconds": whole}

    ours = iter([(1.0, 40.0), (2.0, 50.0), (1.5, 45.0)])
    theirs = iter([(1.0, 20.0), (1.0, 50.0), (1.0, 30.0)])

    def moe_rl_run(size, model, steps, run_dir):
        calls.append(("moe_rl", str(run_dir)))
        return run(*next(ours))

    def trl_run(python, spec, work):
        calls.append(("trl", spec["out_dir"]))
        return {**run(*next(theirs)), "parameters": 7}

    monkeypatch.setattr(bench, "moe_rl_run", moe_rl_run)
    monkeypatch.setattr(bench, "trl_run", trl_run)
    monkeypatch.setattr(bench, "build_model", lambda size, out, seed: out)
    monkeypatch.setattr(bench, "toy_prompts", lambda seed: ["p"])
    out = bench.compare("toy", 3, Path("python"), tmp_path, {"seed": 1}, repeats=3)
    assert [side for side, _ in calls] == ["moe_rl", "trl", "trl", "moe_rl", "moe_rl", "trl"]
    assert len({folder for _, folder in calls}) == 6  # a folder reused by moe-rl would resume its checkpoint
    assert [r["step_ratio"] for r in out["rounds"]] == [1.0, 2.0, 1.5] and out["step_ratio"] == 1.5
    assert [r["whole_ratio"] for r in out["rounds"]] == [2.0, 1.0, 1.5] and out["whole_ratio"] == 1.5
    # outside the steps: the whole command less every step (the first one included)
    assert [r["moe_rl_outside_steps_seconds"] for r in out["rounds"]] == [29.0, 37.0, 33.0]
    assert [r["trl_outside_steps_seconds"] for r in out["rounds"]] == [9.0, 39.0, 19.0]
    assert out["moe_rl_outside_steps_seconds"] == 33.0 and out["trl_outside_steps_seconds"] == 19.0
    assert out["moe_rl"]["mean_step_seconds"] == 1.0 and out["trl"]["whole_seconds"] == 20.0  # round 1 in full


def test_import_seconds_times_the_imports_in_a_fresh_process():
    slow_import = "import time as t2\nt2.sleep(0.3)"
    assert 0.3 <= bench.import_seconds(sys.executable, slow_import) < 0.3 + 2.0
    with pytest.raises(subprocess.CalledProcessError):  # a side whose imports fail stops the bench
        bench.import_seconds(sys.executable, "import no_such_module_here")
