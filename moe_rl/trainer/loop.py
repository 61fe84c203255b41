"""The RL loop: rollout -> reward -> advantages -> old log-probs (with replay) -> update -> weight sync.

Departures from the textbook: the behaviour policy mu is the vLLM engine (not pi_old); the
training-inference mismatch is corrected by `algorithm.correction` (IcePop by default) on top
of routing replay (R3 by default), and GSPO's ratio is per sequence.

The trainer holds the parts (built once from their config sections, trainer/build.py) and runs `step()`; start-up,
resume, saves, signals and the loop of steps are the skeleton every trainer shares (trainer/run.py).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.actor import batch_invariant, engine_ops, lora
from moe_rl.actor.actor import Actor
from moe_rl.actor.lr_schedule import LRSchedule
from moe_rl.common import progress
from moe_rl.common.batch import ProxPolicy
from moe_rl.common.gc_startup import start_up_done
from moe_rl.config import TrainConfig
from moe_rl.config.validate import validate
from moe_rl.critic.critic import Critic, gae_targets
from moe_rl.diagnostics.step_hooks import StepDiagnostics
from moe_rl.objectives import Objective
from moe_rl.plan.preflight import preflight
from moe_rl.reward import RewardSet
from moe_rl.rollout.balance import balance_rollout
from moe_rl.trainer import build
from moe_rl.trainer.checkpoint import CheckpointError
from moe_rl.trainer.health import ExactCheck, HealthMonitor, SkipCounter
from moe_rl.trainer.logger import run_header, say
from moe_rl.trainer.metrics import PeakMemory, Timer, global_metrics, reward_metrics, staleness_metrics
from moe_rl.trainer.reward import Rewarder, reward_peers
from moe_rl.trainer.run import Checkpoints, NothingToTrain, StartUp, data_parallel, run_steps, start_up
from moe_rl.trainer.signals import StopFlag, stop_with_launcher
from moe_rl.weight_sync import WeightSync, sync_metrics

__all__ = ["NothingToTrain", "Trainer", "train"]


class Trainer:
    """The RL trainer: its parts, built once from the config (the mode picks the parts); `step()` runs one RL step."""

    def __init__(self, cfg: TrainConfig, start: StartUp):
        # heavy: transformers, imported on first use
        from transformers import AutoTokenizer

        self.cfg, self.start, self.run_dir, self.rank = cfg, start, start.run_dir, start.rank
        t, self.model_path = cfg.trainer, start.model_path
        notes = resume_notes(cfg, start)  # may refuse the resume: before the model is built
        # the engines' context: prompt limits, the agent loop's turns and the KV cache's size follow it
        self.context = cfg.rollout.max_model_len or start.hf_config.max_position_embeddings
        # Data and reward before the model and engines: a bad file fails in seconds.
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        rewards = RewardSet.from_config(cfg.data)  # worker processes start at the first score
        self.rewarder = Rewarder(rewards, self.tokenizer, reward_peers(data_parallel()[0]))
        self.data = build.training_prompts(cfg, self.tokenizer, self.context, rewards, self.rank)
        self.objective = Objective(cfg.algorithm, cfg.sampling.n)
        self.memory = PeakMemory()
        self.memory.reset()  # probes whether the peak can be reset per step
        announce(cfg, start, self.objective, self.memory.resettable, rewards.describe())
        self.actor = Actor(
            cfg.actor,
            cfg.model,
            cfg.parallel,
            self.model_path,
            record_routes=t.dump_every > 0 or t.mode == "rollout_only",  # the dumps' live routes
            reference=self.objective.needs_reference,
            true_on_policy=t.true_on_policy,
        )
        if self.actor.lora and self.rank == 0:
            say(f"[moe-rl] {lora.describe(self.actor.chunks, self.actor.lora)}")
        dump_every = 1 if t.mode == "rollout_only" else t.dump_every
        dump_meta = {"actor_dtype": cfg.model.dtype, "rollout_dtype": cfg.rollout.dtype, "n": cfg.sampling.n}
        dumps, agreement = Path(t.dump_dir or self.run_dir / "dumps"), cfg.logging.router_agreement_every
        self.diagnostics = StepDiagnostics(self.actor, dumps, dump_every, agreement, dump_meta)
        critic = None
        if self.objective.needs_values:
            critic = Critic(cfg.critic, cfg.model, cfg.parallel, cfg.actor, cfg.critic.model_path or self.model_path)
        self.critic, self.step_index = critic, start.step
        self.schedules = lr_schedules(cfg, self.actor, critic)
        self.skips = SkipCounter(t.max_skipped_steps)
        recomputed = cfg.algorithm.prox_logp != "loglinear"  # else pi_prox is interpolated: no check to make
        self.health = HealthMonitor(t.first_minibatch_tolerance if recomputed else None)
        self.logger = start.logger(cfg)
        start.say_resumed(notes)
        self.stop = StopFlag()
        self.may_stop = may_stop = functools.partial(self.stop.engine_may_stop, self.logger.warn_now)
        self.exact = ExactCheck(t.true_on_policy_strict, self.logger) if self.actor.exact_logprobs else None
        if t.true_on_policy:  # the engine's side of the mode, before it starts
            true_on_policy_engines(self.rank)
        self._build_rollout(cfg, rewards, may_stop)
        self.updates = t.mode != "rollout_only"
        parts = {"critic": build.CriticState(critic)} if critic is not None else {}
        if self.source.buffer is not None:
            parts["buffer"] = build.BufferState(self.source.buffer, self.rank)
        self.checkpoints = Checkpoints(start, t.checkpoint_keep, self.actor, parts)
        if start.resumed:
            self._resume()
        self.data_position = self.data.position  # prompts consumed by completed steps

    def _build_rollout(self, cfg: TrainConfig, rewards: RewardSet, may_stop) -> None:
        """The rollout source (trainer.mode), this rank's engine, the weight sync into the engines and the validator."""
        t, tok = cfg.trainer, self.tokenizer
        val = None
        if t.val_every or t.val_before_train:  # before the engines: they size KV for it
            val = build.validation_prompts(cfg, tok, self.context, rewards, self.rank)
        self.engine = self.weight_sync = self.validator = None
        if t.mode == "from_dump":
            self.source = build.dump_source(cfg, self.actor)
            return
        kv_need = build.kv_cache_gib(cfg, self.model_path, self.context, self.data, val)
        engines = build.start_engines(cfg, self.actor.layout, self.model_path, tok, self.context, kv_need, self.rank)
        self.engine = engines.engine  # this rank's, or None
        self.source = build.engine_source(cfg, engines, self.actor, self.data, tok, may_stop)
        if cfg.buffer.enable:
            warn = self.logger.warn
            self.source = build.buffer_source(cfg, self.source, self.actor, tok, self.rewarder, self.objective, warn)
        r = cfg.rollout  # every rank takes part in the sync's gathers; leaders load
        groups = engines.groups
        bucket_mb, transport = r.weight_sync_bucket_mb, r.weight_transport
        self.weight_sync = WeightSync(self.actor, self.engine, groups.leaders, bucket_mb, transport)
        if val is not None:
            self.validator = build.validator(cfg, val, groups, self.engine, tok, rewards, may_stop)

    def _resume(self) -> None:
        """Restore the checkpoint chosen (and verified) at start into every part; the engines get the resumed
        weights and the prompt stream moves past what was trained."""
        state = self.checkpoints.restore()
        if self.weight_sync is not None:  # the engine starts from the HF weights; give it the resumed actor's
            self.weight_sync()
        dp = data_parallel()[1]  # data_position counts per rank: keep the global count
        self.data.skip(state["data_position"] * state.get("data_parallel_size", dp) // dp)
        again = state.get("data_drawn", state["data_position"]) - state["data_position"]
        if again and self.rank == 0:
            say(
                f"[moe-rl] {again} prompts per data-parallel rank drawn after data position {state['data_position']} "
                "before the save (sampled ahead or in flight, or trained after an older untrained one) are sampled "
                "again with the resumed weights"
            )

    def save_checkpoint(self) -> Path:
        state = {"data_position": self.data_position, "wandb_run_id": self.logger.run_id}
        state["data_drawn"] = self.data.position  # rank 0's prompts drawn: more than data_position ahead, in flight
        state["lr_schedules"] = {key: schedule.state_dict() for key, schedule in self.schedules.items()}
        return self.checkpoints.save(self.step_index, state)

    def initial_validation(self) -> dict[str, float]:
        return self.validator(0) if self.validator is not None else {}

    # ---- one RL step: one line per phase ------------------------------------------------
    def step(self) -> dict[str, float]:
        start, timer = time.perf_counter(), Timer()
        progress.begin_step(self.step_index + 1)
        self.memory.reset()
        self.diagnostics.begin_step()
        with timer(self.source.phase):  # rollout | load_dump
            rollout = self.source.next(self.step_index)  # StepAbandoned when a signal took the engine
        dropped = rollout.dropped  # in-flight: this rank's, before balancing moves samples
        balance = {}
        if self.cfg.trainer.balance_batch:
            with timer("balance"):
                rollout, balance = self.balance(rollout)
        with timer("reward"):
            rewards = self.rewarder(rollout, self.step_index + 1)
        old = self._prox_policy(rollout, timer)
        ref, penalty = self._reference(rollout, old, rewards, timer)
        advantages, values, returns = self._advantages(rollout, rewards - penalty, timer)
        with timer("diagnostics"):  # dumps and router agreement, before the update changes the actor
            metrics = self.diagnostics(self.step_index, rollout, old, rewards)
        metrics |= rollout.metrics  # the source's: buffer/*; multi_turn/*, routes/*
        metrics |= {key: schedule.at(self.step_index + 1) for key, schedule in self.schedules.items()}  # actor/lr
        if self.objective.kl_in_reward:
            metrics["reward/kl_penalty_mean"] = float(penalty.mean())
        warming = self.critic is not None and self.step_index < self.cfg.critic.warmup_steps
        actor_updates = self.updates and not warming  # critic warm-up: the actor (and the engine) stay
        if actor_updates:
            with timer("update"):
                metrics |= self.actor.train(rollout.padded, old, advantages, self.objective, self._on_skip, ref)
            old = self.actor.update_policy or old  # loglinear: no pi_old pass; the update's pi_theta stands in
        if self.updates and self.critic is not None:
            with timer("critic_update"):
                metrics |= self.critic.update(rollout.padded, values, returns)
        synced = self._sync(timer) if actor_updates else {}
        metrics |= self.actor.replay_metrics()  # the replay check over every position this step's passes replayed
        val, every = {}, self.cfg.trainer.val_every
        if self.validator is not None and every and (self.step_index + 1) % every == 0:
            with timer("validation"):
                val = self.validator(self.step_index + 1)
        progress.mark("metrics")  # the step's reductions and its log line
        peaks = timer.times | self.memory.read() | idle_times(self.source, timer, time.perf_counter() - start) | synced
        metrics = global_metrics(rollout, rewards, old, self.cfg.sampling.n, self.objective.icepop_band, metrics, peaks)
        metrics |= reward_metrics(self.rewarder.take())  # per reward function and data_source, over every rank
        metrics |= val | balance
        if self.source.live:  # dumps: no engine, no versions to compare
            metrics |= staleness_metrics(rollout, self.step_index, self.cfg.trainer.max_staleness, dropped)
        return self._log(metrics, rollout, old)

    def _prox_policy(self, rollout, timer: Timer) -> ProxPolicy:
        """pi_prox of the step: the old-log-prob pass, or under algorithm.prox_logp=loglinear only each sample's
        interpolation weight (no pass: the update interpolates it)."""
        alpha = self.objective.prox_alpha(rollout.policy_version, self.step_index)
        if alpha is not None:
            return ProxPolicy(alpha=alpha)
        with timer("old_logprobs"):
            return self.actor.old_logprobs(rollout.padded)

    def _reference(self, rollout, old: ProxPolicy, rewards: torch.Tensor, timer: Timer):
        """(log pi_ref [B, T] or None, the KL penalty [B] taken from `rewards` under algorithm.kl_in_reward)."""
        ref, penalty = None, torch.zeros_like(rewards)
        if self.objective.needs_reference:
            with timer("ref_logprobs"):
                ref = self.actor.ref_logprobs(rollout.padded, old)
        if self.objective.kl_in_reward:
            penalty = self.objective.reward_kl(old.logprobs, ref, rollout.padded.loss_mask)
        return ref, penalty

    def _advantages(self, rollout, rewards: torch.Tensor, timer: Timer):
        """(advantages, the critic's values pass, its returns): group-relative from the rewards, or with a critic
        token-level GAE on the values before the update."""
        if self.critic is None:
            return self.objective.advantages(rewards), None, None
        with timer("values"):
            values = self.critic.values(rollout.padded)
        whiten = self.cfg.algorithm.whiten_advantages
        mask = rollout.padded.loss_mask
        advantages, returns = gae_targets(self.objective, rewards, mask, values["values"], whiten)
        return advantages, values, returns

    def _sync(self, timer: Timer) -> dict[str, float]:
        """The updated weights into every engine (none from dumps); the sync's weight_sync/* metrics."""
        if self.weight_sync is None:
            return {}

        def sync() -> dict[str, float]:  # after sampling ahead ended, or with the in-flight requests paused
            with timer("weight_sync"):
                return self.weight_sync()

        synced = {}  # a stop signal that takes the engine mid-sync: no weight_sync/* this step
        with self.may_stop():
            synced = sync_metrics(self.source.update_weights(sync, self.step_index + 1))
        return synced

    def _log(self, metrics: dict[str, float], rollout, old: ProxPolicy) -> dict[str, float]:
        """The step's last metrics, its log line and warnings; the step is done."""
        if "perf/tokens" in metrics:  # the update's real tokens over the data-parallel ranks
            metrics["perf/tokens_per_s"] = metrics.pop("perf/tokens") / metrics["time/update"]
        if "weight_sync/seconds" in metrics:  # each engine's bytes over the slowest rank's sync
            metrics["weight_sync/gb_per_s"] = metrics["weight_sync/bytes"] / metrics["weight_sync/seconds"] / 1e9
        self.step_index += 1
        position = self.source.position  # not the prompts sampled ahead
        self.data_position = self.data.position if position is None else position
        self.logger.log(self.step_index, metrics)
        for warning in self.health(metrics):
            self.logger.warn(self.step_index, warning)
        if self.exact is not None:
            self.exact(self.step_index, rollout.padded, old, metrics["mismatch/exact_fraction"])
        return metrics

    def balance(self, rollout):
        """(this rank's rollout after balancing tokens over the data-parallel ranks, its metrics)."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        return balance_rollout(rollout, cfg.sampling.n, cfg.actor.mini_batches, ps.get_data_parallel_group())

    def _on_skip(self, skipped: bool, mini_batch: int) -> bool:
        """Count a mini-batch whose optimizer step was skipped (raises after too many in a row)."""
        where = f"step {self.step_index + 1}, mini-batch {mini_batch + 1}/{self.cfg.actor.mini_batches}"
        warning = self.skips(skipped, where)
        if warning:
            self.logger.warn(self.step_index + 1, warning)
        return warning is not None

    def finish(self) -> None:
        pass  # RL leaves its checkpoints; nothing to export

    def close(self) -> None:
        try:
            self.source.close()
            for line in self.health.summary():
                self.logger.warn(self.step_index, line)
            self.logger.close()
        finally:
            self.rewarder.close()  # the reward worker processes, whatever else failed


def lr_schedules(cfg: TrainConfig, actor: Actor, critic: Critic | None) -> dict[str, LRSchedule]:
    """The learning-rate schedules of the step, by the metric that logs each rate: actor/lr (actor.lr_*) and, with a
    critic, critic/lr (critic.lr_*; the critic's weight decay is the actor's)."""
    steps, weight_decay = cfg.trainer.steps, cfg.actor.weight_decay
    schedules = {"actor/lr": LRSchedule(actor.optimizer, cfg.actor, steps, weight_decay)}
    if critic is not None:
        schedules["critic/lr"] = LRSchedule(critic.optimizer, cfg.critic, steps, weight_decay)
    return schedules


def idle_times(source, timer: Timer, step_s: float) -> dict[str, float]:
    """time/step, and time/trainer_idle (waiting for samples) and time/rollout_idle (the engine with nothing to
    sample) of the step: synchronously the trainer waits the whole rollout and the engine the rest."""
    rollout_s = timer.times.get(f"time/{source.phase}", 0.0)
    return {"time/step": step_s} | source.idle_times(rollout_s, step_s)


def announce(
    cfg: TrainConfig, start: StartUp, objective: Objective, memory_resettable: bool, reward_lines: list[str] = ()
) -> None:
    """The run header (with `reward_lines`, naming each reward function: RewardSet.describe), the notes on settings
    that change what runs, and the planner's preflight of this run: said before the model is built (the preflight
    may refuse the layout)."""
    notes = [objective.fused_note] if objective.fused_note else []
    if cfg.trainer.true_on_policy and cfg.actor.fused_logprob:
        notes.append(
            "trainer.true_on_policy: the fused log-prob kernel is off (log-probs through the full-vocabulary "
            "log_softmax, as the engine computes them)"
            if torch.cuda.is_available()
            else "trainer.true_on_policy: log-prob values come from the engine-op pass (the engine's "
            "full-vocabulary log_softmax); actor.fused_logprob computes only the update's gradients"
        )
    if not memory_resettable:
        notes.append("memory/peak_rss_gib is the process's lifetime peak (/proc/self/clear_refs is not writable)")
    world = dist.get_world_size()
    lines = run_header(cfg, start.run_dir, start.model_path, start.hf_config, world) + list(reward_lines) + notes
    for line in lines if start.rank == 0 else []:
        say(f"[moe-rl] {line}")
    if cfg.trainer.preflight:  # the planner's sizing of this run, before the model is built
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()) if torch.cuda.is_available() else None
        line = preflight(cfg, start.model_path, world, gpu and gpu.total_memory)
        if start.rank == 0:
            say(f"[moe-rl] {line}")


def true_on_policy_engines(rank: int) -> None:
    """trainer.true_on_policy: the engines' side of the mode, set in the environment before they start."""
    gpu = torch.cuda.is_available()
    os.environ.update(batch_invariant.engine_environment() if gpu else engine_ops.engine_environment())
    if not gpu and (note := engine_ops.vllm_version_warning()) and rank == 0:
        say(f"[moe-rl] WARNING: {note}")


def resume_notes(cfg: TrainConfig, start: StartUp) -> list[str]:
    """What changes when a checkpoint resumes under another world or data-parallel size (written by older
    versions: not recorded, taken as the same). The model and optimizer reload in any layout; the replay buffer,
    held per rank, does not: refused."""
    if not start.resumed:
        return []
    state, path = start.resumed, start.resume_path
    world, dp = dist.get_world_size(), data_parallel()[1]
    saved_world, saved_dp = state.get("world_size", world), state.get("data_parallel_size", dp)
    if (saved_world, saved_dp) == (world, dp):
        return []
    if cfg.buffer.enable:
        raise CheckpointError(
            f"cannot resume {path} with buffer.enable: its replay buffer is held per rank, written by "
            f"{saved_world} ranks with {saved_dp} data-parallel, and this run has {world} with {dp}. Resume with "
            "that layout, or start a fresh run (trainer.resume=off)"
        )
    notes = []
    if saved_world != world:
        notes.append(
            f"{path} was written by {saved_world} ranks, this run has {world}: each rank's RNG state "
            "is not restored (the one its start-up seeding gave it stays)"
        )
    if saved_dp != dp:
        p = cfg.data.prompts_per_step
        notes.append(
            f"{path} was trained with {saved_dp} data-parallel ranks, this run has {dp}: each rank's "
            f"prompt stream (its shard of the data, shuffled per rank) is another one, so the prompts from here "
            f"on differ from an uninterrupted run's; a step now trains {p * dp} prompts (was {p * saved_dp}: "
            "data.prompts_per_step is per data-parallel rank)"
        )
    return notes


def train(cfg: TrainConfig, run_dir: str | Path) -> list[dict[str, float]]:
    """Run RL steps up to `trainer.steps` (counting resumed ones); returns this run's per-step
    metrics (rank 0 also writes them). Checkpoints every `trainer.checkpoint_every` steps, at the
    end, and on SIGTERM."""
    stop_with_launcher()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        start = start_up(cfg, run_dir, validate, refuse_finished=True)
    except NothingToTrain as e:
        if dist.get_rank() == 0:
            say(f"[moe-rl] {e}")
        return []
    trainer = Trainer(cfg, start)
    start_up_done()
    return run_steps(trainer, cfg.trainer, retry_failed_saves=cfg.trainer.on_save_failure == "retry")
