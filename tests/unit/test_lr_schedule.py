"""The learning-rate schedules (actor.lr_*, critic.lr_*): megatron-core's scheduler against the closed forms, on the
actor's own optimizer, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from moe_rl.actor.lr_schedule import LRSchedule
from moe_rl.actor.model import build_model, load_hf_config
from moe_rl.actor.optimizer import build_optimizer
from moe_rl.config import ActorConfig, ConfigError, CriticConfig, LRDecay


def _closed_form(decay: str, lr: float, min_lr: float, warmup: int, end: int, s: int) -> float:
    """The issue's formulas, written out on their own (not megatron's code)."""
    if warmup and s <= warmup:
        return lr * s / warmup
    if decay == "constant":
        return lr
    if s > end:
        return min_lr
    ratio = (s - warmup) / (end - warmup)
    coeff = (1 + math.cos(math.pi * ratio)) / 2 if decay == "cosine" else 1 - ratio
    return min_lr + (lr - min_lr) * coeff


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=lr)


@pytest.mark.parametrize("decay", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 4])
def test_each_step_trains_at_the_closed_form(decay, warmup):
    lr, min_lr, end, steps = 2e-3, 1e-4, 10, 14
    cfg = ActorConfig(lr=lr, lr_warmup_steps=warmup, lr_decay=LRDecay(decay), lr_decay_steps=end, min_lr=min_lr)
    opt = _optimizer(lr)
    schedule = LRSchedule(opt, cfg, steps, weight_decay=0.0)
    for s in [*range(1, steps + 1), 3, 1]:  # in order, then back (a resumed run moves it to its own step)
        got = schedule.at(s)
        assert got == opt.param_groups[0]["lr"]
        assert got == pytest.approx(_closed_form(decay, lr, min_lr, warmup, end, s), rel=1e-12, abs=0), s
    assert schedule.state_dict()["num_steps"] == 1


def test_the_default_schedule_leaves_the_rate_and_weight_decay_bit_for_bit():
    cfg = ActorConfig()
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=cfg.lr, weight_decay=0.01)
    schedule = LRSchedule(opt, cfg, steps=30, weight_decay=0.01)
    for s in (1, 17, 30, 31):
        assert schedule.at(s) == cfg.lr and opt.param_groups[0]["weight_decay"] == 0.01


def test_decay_ends_at_trainer_steps_when_lr_decay_steps_is_null():
    cfg = ActorConfig(lr=1e-3, lr_warmup_steps=2, lr_decay=LRDecay.linear, min_lr=0.0)
    schedule = LRSchedule(_optimizer(1e-3), cfg, steps=6, weight_decay=0.0)
    assert [schedule.at(s) for s in range(1, 7)] == pytest.approx([5e-4, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])


def test_every_parameter_group_of_the_actor_optimizer_gets_the_rate(tiny_models, world1):
    """The actor's optimizer (megatron's ChainedOptimizer of a dense and an expert AdamW) trains every group at it."""
    from moe_rl.actor.config import ParallelConfig

    chunks, _ = build_model(load_hf_config(tiny_models["qwen3_moe"]), ParallelConfig())
    opt = build_optimizer(chunks, lr=1e-3)
    cfg = ActorConfig(lr=1e-3, lr_warmup_steps=4)
    rate = LRSchedule(opt, cfg, steps=8, weight_decay=0.0).at(1)
    inner = [g["lr"] for o in opt.chained_optimizers for g in o.optimizer.param_groups]
    assert rate == 2.5e-4 and len(inner) == 2 and set(inner) == {2.5e-4}


@pytest.mark.parametrize(
    ("section", "kwargs", "message"),
    [
        (ActorConfig, {"lr_warmup_steps": -1}, "actor.lr_warmup_steps: -1: must be >= 0"),
        (ActorConfig, {"lr_warmup_steps": 5, "lr_decay_steps": 5}, "actor.lr_decay_steps: 5: must be above"),
        (ActorConfig, {"lr": 1e-3, "min_lr": 2e-3}, "actor.min_lr: 0.002: must be between 0 and actor.lr"),
        (CriticConfig, {"lr_warmup_steps": 3, "lr_decay_steps": 2}, "critic.lr_decay_steps: 2: must be above"),
    ],
)
def test_bad_schedules_are_refused_naming_the_key(section, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        section(**kwargs).check()
