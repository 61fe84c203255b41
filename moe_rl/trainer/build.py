"""The RL trainer's parts, each built from its own config sections: the prompts, the engines and the rollout source
over them, the validator (trainer/loop.py holds the parts and runs the step). Built once, in the order the trainer
needs them; the choices a mode makes (from_dump, sampling ahead, the replay buffer, multi-turn agents) are made
here, never inside a step."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from moe_rl.actor.replay import holds_routes
from moe_rl.data.config import validation_sets
from moe_rl.data.prompts import PromptSource
from moe_rl.plan.kv import cpu_kv_cache_gib
from moe_rl.plan.spec import load_spec
from moe_rl.reward import RewardSet
from moe_rl.rollout import dump, placement
from moe_rl.rollout.ahead import AheadSource
from moe_rl.rollout.buffer import BufferSource, ReplayBuffer
from moe_rl.rollout.engine import RolloutEngine
from moe_rl.rollout.engine_groups import EngineGroups, engine_groups
from moe_rl.rollout.inflight_source import InflightSource
from moe_rl.rollout.multi_turn.builtin_envs import env_class
from moe_rl.rollout.multi_turn.loop import AgentLoop
from moe_rl.rollout.source import DumpSource, EngineSource
from moe_rl.routing.records import filler_row, route_dtype
from moe_rl.trainer.checkpoint import load_part, save_part
from moe_rl.trainer.logger import say
from moe_rl.trainer.run import data_parallel
from moe_rl.trainer.validation import ValidationSets, Validator


def answers_needed(cfg, rewards: RewardSet, training: bool) -> str | None:
    """What scores the prompts against their reference answers (so every prompt needs one): the multi-turn
    environment in training, else the reward functions; None when neither needs answers."""
    env = cfg.rollout.multi_turn.env
    if training and env != "none":  # the environment scores; the reward function is not called
        needs = getattr(env_class(env), "needs_answer", False)  # an optional attribute of an environment class
        return f"rollout.multi_turn.env={env}" if needs else None
    return rewards.needs_answer


def scored_by_rewards(cfg, training: bool) -> bool:
    """Whether the reward functions score these prompts (in training a multi-turn environment scores instead)."""
    return not training or cfg.rollout.multi_turn.env == "none"


def training_prompts(cfg, tokenizer, context: int, rewards: RewardSet, rank: int) -> PromptSource:
    """This data-parallel rank's shard of the training prompts (data.*), for responses of sampling.max_tokens in
    the engines' `context` (context-parallel ranks share their samples)."""
    d = cfg.data
    dp_rank, dp = data_parallel()
    data = PromptSource.from_config(
        d,
        seed=cfg.trainer.seed,
        dp_rank=dp_rank,
        dp_size=dp,
        tokenizer=tokenizer,
        context_limit=context - cfg.sampling.max_tokens,
        answers_for=answers_needed(cfg, rewards, training=True),
        problems=_task(d, "train"),
    )
    if scored_by_rewards(cfg, training=True):  # a data_source no reward knows: refused before the model is built
        rewards.check_prompts(data.items, d.path or d.task)
    if rank == 0 and (line := data.describe(str(d.path))):
        say(line)
    if data.dropped and rank == 0:
        say(
            f"[moe-rl] data: dropped {data.dropped} prompts of {d.path or d.task} longer than "
            f"{data.token_limit} tokens ({data.limit_name}; data.overlong_prompts=drop)"
        )
    return data


BUILT_IN_SPLITS = ("arithmetic", "reasoning_gym", "humaneval")  # built-in tasks with a val split of their own


def _task(d, split: str) -> tuple:
    """A built-in task's settings, split and size (PromptSource's `problems`)."""
    if d.task == "reasoning_gym":
        size = d.reasoning_gym.train_size if split == "train" else d.reasoning_gym.val_size
        return d.reasoning_gym, split, size
    if d.task == "humaneval":
        return d.humaneval, split, 0  # the split's problems (data.humaneval.holdout), all of them
    return d.arithmetic, split, d.problems if split == "train" else d.val_problems


def validation_prompts(cfg, tokenizer, context: int, rewards: RewardSet, rank: int) -> dict[str, PromptSource]:
    """Every validation prompt, the same on every rank, one PromptSource per set: each of data.val_path's sets under
    its name (moe_rl.data.config.validation_sets: "val" for a single path), else the built-in task's val split
    as "val"."""
    d = cfg.data
    max_tokens = cfg.val.max_tokens or cfg.sampling.max_tokens
    sets = validation_sets(d.val_path) if d.val_path or d.task not in BUILT_IN_SPLITS else {"val": None}
    out = {}
    for name, path in sets.items():
        val = PromptSource.from_config(
            d,
            path=path or "",
            task="file" if path is not None else d.task,
            seed=cfg.trainer.seed,
            tokenizer=tokenizer,
            context_limit=context - max_tokens,
            answers_for=answers_needed(cfg, rewards, training=False),
            problems=None if path is not None else _task(d, "val"),
            split=d.val_split,
        )
        rewards.check_prompts(val.items, f"validation {path or f'the {d.task} val split'}")
        if rank == 0:
            dropped = f", {val.dropped} dropped as too long" if val.dropped else ""
            where = path or f"the {d.task} val split"
            named = "" if len(sets) == 1 else f" {name!r}"
            if line := val.describe(str(path)):
                say(line)
            say(f"[moe-rl] validation{named}: {len(val.items)} prompts of {where}{dropped}")
        out[name] = val
    return out


@dataclass
class Engines:
    """This rank's view of the rollout engines: its engine group, its engine (leaders) and agent loop, the cores
    the trainer and the engine run on (rollout.placement=separate)."""

    groups: EngineGroups
    engine: RolloutEngine | None
    agent: AgentLoop | None
    engine_cores: list[int] | None


def start_engines(cfg, layout, model_path: str, tokenizer, context: int, kv_need, rank: int) -> Engines:
    """The engine groups (rollout.engines) and, on their leaders, a vLLM engine (rollout.*) with the multi-turn agent
    loop over it (rollout.multi_turn.env). `kv_need(served, engines)` -> the CPU KV cache (GiB) an engine serving
    `served` data-parallel ranks needs when rollout.kv_cache_gib is null. Collective."""
    r = cfg.rollout
    groups = engine_groups(r.engines, *data_parallel())
    kv = r.kv_cache_gib
    if kv is None and not torch.cuda.is_available():
        kv = kv_need(len(groups.served), len(groups.leaders))
    rollout_cfg = replace(r, model=model_path, seed=cfg.trainer.seed, kv_cache_gib=kv)
    engine, trainer_cores, engine_cores, agent = None, None, None, None
    if groups.is_leader:
        if r.placement == "separate":
            local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            trainer_cores, engine_cores = placement.split_cores(*local)
            placement.bind_engine(engine_cores)
        engine = RolloutEngine(rollout_cfg, layout.moe_layers, layout.num_experts, layout.topk)
        if r.multi_turn.env != "none":
            agent = AgentLoop(engine, r.multi_turn, tokenizer, context)
    if trainer_cores is not None:  # after the engine's processes started
        placement.pin(trainer_cores, engine_cores)
        if rank == 0:
            say(f"[moe-rl] placement: trainer on cores {trainer_cores}, engine on {engine_cores}")
    return Engines(groups, engine, agent, engine_cores)


def kv_cache_gib(cfg, model_path: str, context: int, data: PromptSource, val: dict[str, PromptSource] | None):
    """rollout.kv_cache_gib left null, CPU: `(served, engines)` -> what an engine serving `served` data-parallel ranks
    of `engines` holds at most at once, at full length, its share of a step's samples or of a validation set's pass
    (the sets run one after another), whichever takes more (plan/kv.py cpu_kv_cache_gib)."""

    def longest(prompts: PromptSource, max_tokens: int) -> int:  # a multi-turn sample grows to the context
        single = cfg.rollout.multi_turn.env == "none"  # token_limit: the prompt sources always get a context limit
        return min(context, prompts.token_limit + max_tokens) if single else context

    def need(served: int, engines: int) -> float:
        n = [(cfg.data.prompts_per_step * served * cfg.sampling.n, longest(data, cfg.sampling.max_tokens))]
        for one in (val or {}).values():
            share = -(-len(one.items) // engines)
            n.append((share * cfg.val.n, longest(one, cfg.val.max_tokens or cfg.sampling.max_tokens)))
        spec, r = load_spec(model_path), cfg.rollout
        return max(cpu_kv_cache_gib(spec, r.tensor_parallel_size, r.dtype, s, tokens) for s, tokens in n)

    return need


def dump_source(cfg, actor) -> DumpSource:
    """trainer.mode=from_dump: the dumps of an earlier run, checked against this actor."""
    fingerprint = dump.model_fingerprint(actor.hf_config, actor.layout)
    return DumpSource(
        Path(cfg.trainer.dump_dir),
        fingerprint,
        cfg.sampling.n,
        cfg.actor.mini_batches,
        cfg.actor.router_replay,
        route_layers=actor.route_layers,
        holds_routes=holds_routes(),
    )


def engine_source(cfg, engines: Engines, actor, data, tokenizer, may_stop):
    """The engines' samples of `data` (sampling one batch ahead under trainer.max_staleness, in flight under
    rollout.inflight)."""
    source = EngineSource(
        engines.engine,
        engines.groups,
        data,
        tokenizer,
        cfg.sampling,
        cfg.data.prompts_per_step,
        cfg.parallel.seq_multiple,
        may_stop,
        engines.agent,
        route_layers=actor.route_layers,
        holds_routes=holds_routes(),
    )
    if cfg.rollout.inflight:
        source = InflightSource(source, cfg.trainer.max_staleness, engines.engine_cores, cfg.rollout.partial)
    elif cfg.trainer.max_staleness:
        source = AheadSource(source, cfg.trainer.max_staleness, cfg.trainer.steps, engines.engine_cores)
    return source


def buffer_source(cfg, inner, actor, tokenizer, rewarder, objective, warn) -> BufferSource:
    """The replay buffer (buffer.*) over the engine's batches; its draws seeded per data-parallel rank, so ranks that
    share samples (TP, PP) draw alike."""
    b, layout = cfg.buffer, actor.layout
    seed = cfg.trainer.seed + 7919 * (1 + data_parallel()[0])
    buffer = ReplayBuffer(b.capacity, b.max_age, b.priority, b.alpha, b.eps, b.fresh_fraction, seed)
    filler = filler_row(len(actor.route_layers), layout.topk, route_dtype(layout.num_experts))
    return BufferSource(
        inner,
        buffer,
        b,
        rewarder,
        objective.advantages,
        group_size=cfg.sampling.n,
        prompts_per_step=cfg.data.prompts_per_step,
        mini_batches=cfg.actor.mini_batches,
        pad_id=tokenizer.pad_token_id or 0,
        pad_multiple=cfg.parallel.seq_multiple,
        filler=torch.from_numpy(np.ascontiguousarray(filler)),
        warn=warn,
    )


def validator(
    cfg, sets: dict[str, PromptSource], groups, engine, tokenizer, rewards: RewardSet, may_stop
) -> ValidationSets:
    """Validation by generation over every engine (trainer.val_every, val.*) of each validation set, scored by the
    run's rewards."""
    args = (groups, engine, tokenizer, rewards, cfg.val, cfg.sampling, may_stop)
    return ValidationSets({name: Validator(s.items, *args) for name, s in sets.items()})


class BufferState:
    """The replay buffer's part of a checkpoint: each rank's buffer in its own file."""

    def __init__(self, buffer: ReplayBuffer, rank: int):
        self.buffer, self.rank = buffer, rank

    def _file(self, folder: Path) -> Path:
        return folder / f"rank_{self.rank:05d}.safetensors"

    def save(self, folder: Path) -> None:
        self.buffer.save(self._file(folder))

    def load(self, folder: Path) -> None:
        self.buffer.load(self._file(folder))


class CriticState:
    """The critic's part of a checkpoint: its model chunks and optimizer."""

    def __init__(self, critic):
        self.critic = critic

    def save(self, folder: Path) -> None:
        save_part(folder, self.critic.chunks, self.critic.optimizer)

    def load(self, folder: Path) -> None:
        load_part(folder, self.critic.chunks, self.critic.optimizer)
