"""Where a step's samples come from: the vLLM engine (`EngineSource`; sampling one batch ahead under
trainer.max_staleness: `rollout/ahead.py`) or the dumps of an earlier run (`DumpSource`,
trainer.mode=from_dump), or a replay buffer over the engine's batches (`rollout/buffer.py`). Chosen once
when the trainer is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.common.batch import PaddedBatch, cat_or_none
from moe_rl.common.distributed import world_max
from moe_rl.rollout import dump
from moe_rl.rollout.multi_turn.metrics import multi_turn_metrics
from moe_rl.routing.layout import layer_columns


class StepAbandoned(Exception):
    """A stop signal cut the step short before it changed the actor (the engine died with it)."""


@dataclass
class Rollout:
    """One step's samples on this rank: padded tokens with mu's log-probs and routes, plus what
    the reward needs. `rewards` is filled by the source when it already has them (dumps)."""

    padded: PaddedBatch
    policy_version: torch.Tensor  # [B] the actor step whose weights sampled each sample
    response_lengths: torch.Tensor  # [B]
    prompts: list | None = None  # data.prompts.Prompt of each prompt index (engine source)
    prompt_index: list[int] | None = None  # prompt of each sample
    response_ids: list[list[int]] | None = None
    rewards: torch.Tensor | None = None
    truncated: torch.Tensor | None = None  # [B] bool: stopped by sampling.max_tokens (engine source)
    turn_index: torch.Tensor | None = None  # [B, T] multi-turn: the turn that sampled each token, -1 elsewhere
    versions: torch.Tensor | None = None  # [B, T] in-flight: the version that sampled each response token, -1 elsewhere
    dropped: int = 0  # in-flight: samples of this data-parallel rank's prompts dropped as too stale since its last step
    metrics: dict[str, float] = field(default_factory=dict)  # the source's own (multi_turn/*, routes/*)

    SAMPLE_TENSORS = ("policy_version", "response_lengths", "rewards", "truncated")  # [B]

    def __len__(self) -> int:
        return self.padded.input_ids.shape[0]

    def select(self, rows: Sequence[int]) -> Rollout:
        """The samples `rows`, in that order; their prompts re-indexed from 0 in order of first appearance."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        prompts, prompt_index = self.prompts, self.prompt_index
        if prompt_index is not None:
            order = list(dict.fromkeys(prompt_index[i] for i in rows))
            prompts = None if prompts is None else [prompts[i] for i in order]
            prompt_index = [order.index(prompt_index[i]) for i in rows]
        return replace(
            self,
            padded=self.padded.select(idx),
            prompts=prompts,
            prompt_index=prompt_index,
            response_ids=None if self.response_ids is None else [self.response_ids[i] for i in rows],
            turn_index=None if self.turn_index is None else self.turn_index[idx],
            versions=None if self.versions is None else self.versions[idx],
            **{k: None if getattr(self, k) is None else getattr(self, k)[idx] for k in self.SAMPLE_TENSORS},
        )

    @staticmethod
    def cat(parts: Sequence[Rollout]) -> Rollout:
        """The parts' samples back to back (padded to one length), each part's prompts after the previous part's;
        the first part's metrics (a source's metrics cover the whole step)."""

        def join(values):
            return None if values[0] is None else [x for v in values for x in v]

        prompt_index = None
        if parts[0].prompt_index is not None:
            offsets = [0]
            for p in parts:
                offsets.append(offsets[-1] + len(set(p.prompt_index)))
            prompt_index = [i + off for p, off in zip(parts, offsets, strict=False) for i in p.prompt_index]
        return Rollout(
            PaddedBatch.cat([p.padded for p in parts]),
            prompts=join([p.prompts for p in parts]),
            prompt_index=prompt_index,
            response_ids=join([p.response_ids for p in parts]),
            turn_index=cat_or_none([p.turn_index for p in parts]),
            versions=cat_or_none([p.versions for p in parts]),
            metrics=parts[0].metrics,
            **{k: cat_or_none([getattr(p, k) for p in parts]) for k in Rollout.SAMPLE_TENSORS},
        )


class RolloutSource(Protocol):
    """What the trainer asks of a source of rollouts (the engine, the engine sampling ahead, the replay buffer,
    an earlier run's dumps): it calls these and nothing else."""

    phase: str  # its time metric: time/<phase> (rollout | load_dump)
    live: bool  # samples of this run's engine: their policy versions and the engine's idle time mean something
    buffer: Any  # state a checkpoint keeps beside the actor (the replay buffer), or None

    def next(self, step: int) -> Rollout:
        """Step `step`'s samples (0-based); the source's own metrics ride in `Rollout.metrics`."""
        ...

    @property
    def position(self) -> int | None:
        """Prompts consumed by the steps handed out so far (what a checkpoint saves); None: it reads no prompts."""
        ...

    def update_weights(self, sync: Callable[[], dict], version: int) -> dict:
        """Run `sync()` (the weight sync into the engines, collective; its stats are returned) when the engine may
        take actor version `version`'s weights: once sampling ahead ended, or with in-flight requests paused."""
        ...

    def idle_times(self, rollout_s: float, step_s: float) -> dict[str, float]:
        """time/trainer_idle and time/rollout_idle of the step, which spent `rollout_s` of its `step_s` in next()."""
        ...

    def close(self) -> None: ...


def waiting_times(rollout_s: float, step_s: float) -> dict[str, float]:
    """Synchronous sampling: the trainer waits the whole rollout, the engine the rest of the step."""
    return {"time/trainer_idle": rollout_s, "time/rollout_idle": step_s - rollout_s}


class EngineSource:
    """Prompts from this data-parallel rank's data shard, sampled by the engine that serves it (on this
    rank or on its engine group's leader: rollout/engine_groups.py), routes captured."""

    phase = "rollout"
    live = True
    buffer = None

    def __init__(
        self,
        engine,
        groups,
        data,
        tokenizer,
        sampling,
        prompts_per_step: int,
        pad_multiple: int,
        may_stop,
        agent=None,
        route_layers: list[int] | None = None,
        holds_routes: bool = True,
    ):
        """`engine`: the RolloutEngine on an engine leader, None elsewhere; `groups`: EngineGroups;
        `may_stop`: context manager under which an engine failure during a stop signal ends the step
        instead of the run (StopFlag.engine_may_stop, bound to the run logger); `agent`: the multi-turn AgentLoop
        on a leader (rollout.multi_turn.env), which then samples instead of `engine.generate`; `route_layers`: the MoE
        layers whose routes this rank replays (its pipeline stage's; None: all), the only ones the leader sends it;
        `holds_routes`: whether this rank holds its tensor/context-parallel group's routes (actor.replay.holds_routes),
        the only ranks the leader sends routes to."""
        if groups.is_leader != (engine is not None):
            raise ValueError(f"rank {dist.get_rank()}: an engine belongs on the engine leaders only ({groups})")
        self.engine, self.groups, self.data, self.tokenizer = engine, groups, data, tokenizer
        self.sampling, self.prompts_per_step, self.pad_multiple = sampling, prompts_per_step, pad_multiple
        self.may_stop, self.agent, self.route_layers = may_stop, agent, route_layers
        self.holds_routes = holds_routes

    def next(self, step: int) -> Rollout:
        prompts = self.data.next(self.prompts_per_step)
        return self.finish(step, prompts, self.sample(step, prompts), version=step)

    def finish(self, step: int, prompts: list, batch, version: int) -> Rollout:
        """The Rollout of `prompts`' sampled `batch` (None: the engine stopped with a signal) by the engine
        weights of actor step `version`. Collective."""
        # One all-reduce: whether any rank lost its engine (ranks leave the step together) and
        # the padded length (EP ranks must agree on it).
        pairs = [] if batch is None else zip(batch.prompt_ids, batch.response_ids, strict=True)
        abandoned, longest = world_max(batch is None, max((len(p) + len(r) for p, r in pairs), default=0))
        if abandoned:
            raise StepAbandoned(f"step {step + 1}: the rollout engine stopped with the signal")
        padded = batch.to_padded(
            pad_id=self.tokenizer.pad_token_id or 0, pad_to_multiple=self.pad_multiple, min_length=longest
        )
        turn_index, metrics = None, {}
        if batch.turn_index is not None:  # multi-turn
            turn_index = per_token(padded, batch.prompt_ids, batch.turn_index)
            metrics = multi_turn_metrics(batch.info)
        versions, policy_version = None, torch.full((len(batch),), version, dtype=torch.long)
        if batch.versions is not None:  # in-flight: a version per token; a sample's is its oldest token's
            versions = per_token(padded, batch.prompt_ids, batch.versions)
            policy_version = torch.tensor([int(v.min()) if len(v) else version for v in batch.versions])
        return Rollout(
            padded,
            policy_version=policy_version,
            response_lengths=padded.loss_mask.sum(-1).long(),  # sampled tokens (multi-turn: without observations)
            prompts=prompts,
            prompt_index=[int(i) for i in batch.prompt_index],
            response_ids=batch.response_ids,
            truncated=torch.tensor([r == "length" for r in batch.finish_reasons]),
            rewards=None if batch.rewards is None else torch.from_numpy(batch.rewards),
            turn_index=turn_index,
            versions=versions,
            metrics=metrics,
        )

    def sample(self, step: int, prompts: list):  # data.prompts.Prompt, tokenized once by the PromptSource
        """This data-parallel rank's samples (None if the engine stopped with a signal): the leader
        gathers the prompts of every data-parallel rank it serves, samples them in one call and
        sends each rank its data-parallel rank's share, with the routes of that rank's MoE layers only, and only
        to the rank that holds them for its tensor/context-parallel group (the others get zero-width routes)."""
        g = self.groups
        # Whole Prompts travel, not token ids: only the leader knows whether an agent samples them, and its
        # environments need every served rank's answers.
        request = (g.dp_rank, prompts, self.route_layers, self.holds_routes)
        asked = [request]
        if g.group is not None:
            asked = [None] * len(g.group_ranks) if g.is_leader else None
            dist.gather_object(request, asked, dst=g.leader, group=g.group)
        shares = None
        if g.is_leader:
            by_dp = {d: p for d, p, _, _ in asked}
            prompts = [p if self.agent is not None else p.ids for d in g.served for p in by_dp[d]]
            sampling = self.sampling
            if sampling.seed is not None:  # per step and data-parallel rank: reproducible after a resume
                seed = sampling.seed + g.sampling_stream(step) * self.prompts_per_step
                sampling = type(sampling)(**{**sampling.__dict__, "seed": seed})
            full = None
            with self.may_stop():
                full = self.engine.generate(prompts, sampling) if self.agent is None else self.agent(prompts, sampling)
                self.engine.sleep()  # rollout.sleep_while_training: the actor gets the device until the next sync
            parts = (
                None if full is None else dict(zip(g.served, full.split_by_prompt(self.prompts_per_step), strict=True))
            )
            shares = [None if parts is None else share_of(parts[d], layers, holds) for d, _, layers, holds in asked]
        if g.group is None:
            return shares[0]
        mine = [None]
        dist.scatter_object_list(mine, shares, src=g.leader, group=g.group)
        return mine[0]

    @property
    def position(self) -> int:
        return self.data.position

    def update_weights(self, sync: Callable[[], dict], version: int) -> dict:
        return sync()  # sampling ends inside next()

    def idle_times(self, rollout_s: float, step_s: float) -> dict[str, float]:
        return waiting_times(rollout_s, step_s)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def per_token(padded: PaddedBatch, prompt_ids: list[list[int]], values: list) -> torch.Tensor:
    """[B, T] long: each sample's per-response-token `values` at its response positions, -1 elsewhere."""
    out = torch.full(padded.input_ids.shape, -1, dtype=torch.long)
    for i, (p, v) in enumerate(zip(prompt_ids, values, strict=True)):
        out[i, len(p) : len(p) + len(v)] = torch.from_numpy(np.asarray(v, dtype=np.int64))
    return out


def share_of(part, layers: list[int] | None, holds_routes: bool):
    """A data-parallel rank's samples as one rank of it gets them: its stage's MoE `layers` (None: all), and routes
    only if it holds them for its tensor/context-parallel group."""
    part = part.only_layers(part.moe_layers if layers is None else layers)
    return part if holds_routes else part.routes_held_elsewhere()


class DumpSource:
    """The dumped steps of an earlier run, cycled through (trainer.mode=from_dump; no engine)."""

    phase = "load_dump"
    live = False  # an earlier run's samples: no engine here
    buffer = None
    position = None

    def __init__(
        self,
        dump_dir: Path,
        fingerprint: dict,
        group_size: int,
        mini_batches: int,
        router_replay: str,
        route_layers: list[int] | None = None,
        holds_routes: bool = True,
    ):
        """`route_layers`: the MoE layers this rank replays (its pipeline stage's; None: all); a dump holds every
        MoE layer's routes, the rank keeps these. `holds_routes`: whether this rank holds its group's routes
        (actor.replay.holds_routes); the others get theirs from it."""
        self.holds_routes = holds_routes
        self.steps = dump.step_folders(dump_dir)
        self.fingerprint, self.group_size = fingerprint, group_size
        self.mini_batches, self.router_replay = mini_batches, router_replay
        layers = fingerprint["moe_layers"]
        self.route_cols = None if route_layers in (None, layers) else layer_columns(route_layers, layers)

    def next(self, step: int) -> Rollout:
        folder = self.steps[step % len(self.steps)]
        rank, world = dist.get_rank(), dist.get_world_size()
        tensors, meta = dump.read(folder / f"rank_{rank:05d}.safetensors")
        if meta["model"] != self.fingerprint:
            raise dump.DumpError(f"{folder}: dump is from model {meta['model']}, the actor is {self.fingerprint}")
        if meta["world_size"] != world:
            raise dump.DumpError(f"{folder}: written by {meta['world_size']} ranks, this run has {world}")
        if meta.get("n") != self.group_size:
            raise dump.DumpError(
                f"{folder}: sampled {meta.get('n')} responses per prompt, sampling.n={self.group_size}: the GRPO "
                "groups would mix prompts; set sampling.n to the dump's"
            )
        if "rewards" not in tensors:
            raise dump.DumpError(f"{folder}: has no rewards (written by moe-rl-diagnose, not a training run?)")
        routes = tensors.get("routes")
        if self.router_replay == "r3" and routes is None:
            raise dump.DumpError(f"{folder}: actor.router_replay=r3 needs engine routes; the dump has none")
        if routes is not None and self.route_cols is not None:
            routes = routes[:, :, self.route_cols]
        if routes is not None and not self.holds_routes:  # its group's route holder sends this rank its positions
            routes = routes[:, :0].clone()
        b = tensors["input_ids"].shape[0]
        if b % self.mini_batches:
            raise dump.DumpError(
                f"{folder}: {b} samples on rank {rank} are not divisible into actor.mini_batches={self.mini_batches}"
            )
        padded = PaddedBatch(
            tensors["input_ids"], tensors["attention_mask"], tensors["loss_mask"], tensors["rollout_logprobs"], routes
        )
        return Rollout(
            padded,
            # dumps before policy versions were written: the step's own (synchronous) version
            policy_version=tensors.get("policy_version", torch.full((b,), int(meta["step"]), dtype=torch.long)),
            response_lengths=padded.loss_mask.sum(-1).long(),
            rewards=tensors["rewards"],
        )

    def update_weights(self, sync: Callable[[], dict], version: int) -> dict:
        return sync()  # (no engine: the trainer has no weight sync)

    def idle_times(self, rollout_s: float, step_s: float) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
