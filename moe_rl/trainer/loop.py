"""The RL loop: rollout -> reward -> advantages -> old log-probs (with replay) -> update -> weight sync.

Departures from the textbook: the behaviour policy mu is the vLLM engine (not pi_old); the
training-inference mismatch is corrected by `algorithm.correction` (IcePop by default) on top
of routing replay (R3 by default), and GSPO's ratio is per sequence.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.actor import batch_invariant, engine_ops
from moe_rl.actor.actor import Actor
from moe_rl.actor.converters import get_converter
from moe_rl.actor.model import check_divisibility, load_hf_config
from moe_rl.actor.parallel import init_distributed
from moe_rl.actor.replay import holds_routes
from moe_rl.common import progress
from moe_rl.common.batch import ProxPolicy
from moe_rl.common.distributed import all_gather_objects
from moe_rl.common.gc_startup import start_up_done
from moe_rl.config import TrainConfig
from moe_rl.config.validate import validate
from moe_rl.critic.critic import Critic, gae_targets
from moe_rl.data.prompts import PromptSource
from moe_rl.data.rewards import load_reward, score
from moe_rl.diagnostics.step_hooks import StepDiagnostics
from moe_rl.models.tiny import built_in_model
from moe_rl.objectives import Objective
from moe_rl.objectives.proximal import loglinear_alpha
from moe_rl.plan.kv import cpu_kv_cache_gib
from moe_rl.plan.preflight import preflight
from moe_rl.plan.spec import load_spec
from moe_rl.rollout import dump, placement
from moe_rl.rollout.ahead import AheadSource
from moe_rl.rollout.balance import balance_rollout
from moe_rl.rollout.buffer import BufferSource, ReplayBuffer
from moe_rl.rollout.engine import RolloutEngine
from moe_rl.rollout.engine_groups import engine_groups
from moe_rl.rollout.multi_turn.builtin_envs import env_class
from moe_rl.rollout.multi_turn.loop import AgentLoop
from moe_rl.rollout.source import DumpSource, EngineSource, StepAbandoned
from moe_rl.routing.records import filler_row, route_dtype
from moe_rl.trainer import checkpoint
from moe_rl.trainer.checkpoint import CheckpointError, CheckpointSaveError
from moe_rl.trainer.health import HealthMonitor, SkipCounter
from moe_rl.trainer.logger import RunLogger, run_header, say
from moe_rl.trainer.metrics import PeakMemory, Timer, global_metrics
from moe_rl.trainer.run_dir import check_same_run_dir
from moe_rl.trainer.signals import StopFlag, stop_with_launcher
from moe_rl.trainer.validation import Validator
from moe_rl.trainer.watchdog import watching
from moe_rl.weight_sync import WeightSync, sync_metrics


class NothingToTrain(Exception):
    """The checkpoint resumed is already at trainer.steps."""


class Trainer:
    """Builds every part from the config once (the mode picks the parts); `step()` runs one RL step."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before anything is built
        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        check_same_run_dir(run_dir)  # before any rank writes to its own
        self.cfg, self.run_dir = cfg, run_dir
        self.rank = dist.get_rank()
        t = cfg.trainer
        # A damaged checkpoint fails (or is skipped under auto_skip_damaged) before any other work.
        self.checkpoint_dir = Path(t.checkpoint_dir or run_dir / "checkpoints")
        self.resume_path = checkpoint.resume_point(self.checkpoint_dir, t.resume, self.rank)
        done = checkpoint.saved_state(self.resume_path).get("step", 0) if self.resume_path is not None else 0
        if self.resume_path is not None and done >= t.steps:
            # a requeued job that had finished, or trainer.steps lowered: said before a model, engine or wandb run
            raise NothingToTrain(
                f"nothing to train: the checkpoint is at step {done} and trainer.steps={t.steps} ({self.resume_path}; "
                "raise trainer.steps to go on)"
            )
        m = cfg.model
        self.model_path = m.path or built_in_model(run_dir, m.tiny_arch, m.tiny_size, cfg.trainer.seed)
        hf_config = load_hf_config(self.model_path)
        # the engines' context: prompt limits, the agent loop's turns and the KV cache's size follow it
        self.context = cfg.rollout.max_model_len or hf_config.max_position_embeddings
        check_divisibility(get_converter(hf_config), cfg.parallel)  # before anything is built
        # Data and reward before the model and engines: a bad file fails in seconds.
        self._build_data()
        self.objective = Objective(cfg.algorithm, cfg.sampling.n)
        self.memory = PeakMemory()
        self.memory.reset()  # probes whether the peak can be reset per step
        notes = [self.objective.fused_note] if self.objective.fused_note else []
        if t.true_on_policy and cfg.actor.fused_logprob:
            notes.append(
                "trainer.true_on_policy: the fused log-prob kernel is off (log-probs through the full-vocabulary "
                "log_softmax, as the engine computes them)"
                if torch.cuda.is_available()
                else "trainer.true_on_policy: log-prob values come from the engine-op pass (the engine's "
                "full-vocabulary log_softmax); actor.fused_logprob computes only the update's gradients"
            )
        if not self.memory.resettable:
            notes.append("memory/peak_rss_gib is the process's lifetime peak (/proc/self/clear_refs is not writable)")
        world = dist.get_world_size()
        for line in run_header(cfg, run_dir, self.model_path, hf_config, world) if self.rank == 0 else []:
            say(f"[moe-rl] {line}")
        for note in notes if self.rank == 0 else []:
            say(f"[moe-rl] {note}")
        if t.preflight:  # the planner's sizing of this run, before the model is built
            gpu = torch.cuda.get_device_properties(torch.cuda.current_device()) if torch.cuda.is_available() else None
            line = preflight(cfg, self.model_path, world, gpu and gpu.total_memory)
            if self.rank == 0:
                say(f"[moe-rl] {line}")
        self.actor = Actor(
            cfg.actor,
            cfg.model,
            cfg.parallel,
            self.model_path,
            record_routes=t.dump_every > 0 or t.mode == "rollout_only",
            reference=self.objective.needs_reference,
            true_on_policy=t.true_on_policy,
        )
        self.diagnostics = StepDiagnostics(
            self.actor,
            Path(t.dump_dir or run_dir / "dumps"),
            dump_every=1 if t.mode == "rollout_only" else t.dump_every,
            agreement_every=cfg.logging.router_agreement_every,
            dump_meta={"actor_dtype": cfg.model.dtype, "rollout_dtype": cfg.rollout.dtype, "n": cfg.sampling.n},
        )
        self.critic = self._build_critic() if self.objective.needs_values else None
        self.step_index = 0
        self.skips = SkipCounter(t.max_skipped_steps)
        recomputed = cfg.algorithm.prox_logp != "loglinear"  # else pi_prox is interpolated: no check to make
        self.health = HealthMonitor(t.first_minibatch_tolerance if recomputed else None)
        self.stop = StopFlag()
        resumed = self._resume()
        self.logger = RunLogger(
            run_dir,
            cfg,
            enabled=self.rank == 0,
            wandb_id=(resumed or {}).get("wandb_run_id"),
            resumed_step=self.step_index if resumed else None,
        )
        if t.true_on_policy:  # the engine's side of the mode, before it starts
            gpu = torch.cuda.is_available()
            os.environ.update(batch_invariant.engine_environment() if gpu else engine_ops.engine_environment())
            if not gpu and (note := engine_ops.vllm_version_warning()) and self.rank == 0:
                say(f"[moe-rl] WARNING: {note}")
        validating = bool(t.val_every or t.val_before_train)
        self.val_prompts = self._read_val_prompts() if validating else None  # before the engines: they size KV for it
        self.source, engine = self._build_source()
        self.engine = engine  # this rank's, or None
        self.weight_sync = None
        if cfg.trainer.mode != "from_dump":  # every rank takes part in the sync's gathers; leaders load
            r = cfg.rollout
            leaders = self.source.groups.leaders
            self.weight_sync = WeightSync(self.actor, engine, leaders, r.weight_sync_bucket_mb, r.weight_transport)
        self.updates = t.mode != "rollout_only"
        self.validator = self._build_validator(engine) if validating else None
        if resumed:
            if cfg.buffer.enable:
                self.source.buffer.load(self._buffer_file(self.resume_path))
            if self.weight_sync is not None:  # the engine starts from the HF weights; give it the resumed actor's
                self.weight_sync()
            self.data.skip(resumed["data_position"])
        self.data_position = self.data.position  # prompts consumed by completed steps

    def _build_data(self) -> None:
        # heavy: megatron-core and transformers, imported on first use
        from megatron.core import parallel_state as ps
        from transformers import AutoTokenizer

        cfg, d = self.cfg, self.cfg.data
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.reward_fn = load_reward(d.reward_spec)
        self.data = self._read_prompts(
            d.path,
            ps.get_data_parallel_rank(),
            ps.get_data_parallel_world_size(),
            cfg.sampling.max_tokens,
            d.task,
            answers_for=self._answers_for(training=True),
            problems=(d.arithmetic, "train", d.problems),
        )  # context-parallel ranks share their samples
        if self.data.dropped and self.rank == 0:
            say(
                f"[moe-rl] data: dropped {self.data.dropped} prompts of {d.path or d.task} longer than "
                f"{self.data.token_limit} tokens ({self.data.limit_name}; data.overlong_prompts=drop)"
            )

    def _answers_for(self, training: bool) -> str | None:
        """What scores the prompts against their reference answers (so every prompt needs one): the multi-turn
        environment in training, else the reward function; None when neither needs answers."""
        env = self.cfg.rollout.multi_turn.env
        if training and env != "none":  # the environment scores; the reward function is not called
            needs = getattr(env_class(env), "needs_answer", False)  # an optional attribute of an environment class
            return f"rollout.multi_turn.env={env}" if needs else None
        needs = getattr(self.reward_fn, "needs_answer", False)
        return f"data.reward={self.cfg.data.reward_spec}" if needs else None

    def _read_prompts(
        self,
        path: str,
        dp_rank: int,
        dp_size: int,
        max_tokens: int,
        task: str = "file",
        answers_for=None,
        problems=None,
    ):
        """A PromptSource over `path` (this data-parallel rank's shard), rendered, tokenized and length-checked
        as data.* says, for responses of up to `max_tokens`; `answers_for`, `problems`: see PromptSource."""
        cfg, d = self.cfg, self.cfg.data
        return PromptSource(
            task,
            path,
            d.prompt_key,
            d.answer_key,
            cfg.trainer.seed,
            dp_rank,
            dp_size,
            messages_key=d.messages_key,
            tokenizer=self.tokenizer,
            apply_chat_template=d.apply_chat_template,
            max_prompt_tokens=d.max_prompt_tokens,
            context_limit=self.context - max_tokens,
            overlong=d.overlong_prompts,
            answers_for=answers_for,
            problems=problems,
        )

    def _build_source(self):
        """(RolloutSource, this rank's engine or None) for trainer.mode."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        cfg, a = self.cfg, self.actor
        if cfg.trainer.mode == "from_dump":
            fingerprint = dump.model_fingerprint(a.hf_config, a.layout)
            source = DumpSource(
                Path(cfg.trainer.dump_dir),
                fingerprint,
                cfg.sampling.n,
                cfg.actor.mini_batches,
                cfg.actor.router_replay,
                route_layers=a.route_layers,
                holds_routes=holds_routes(),
            )
            return source, None
        groups = engine_groups(cfg.rollout.engines, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        kv = cfg.rollout.kv_cache_gib
        if kv is None and not torch.cuda.is_available():
            kv = self._engine_kv_cache_gib(len(groups.served), len(groups.leaders))
        fill = {"model": self.model_path, "seed": cfg.trainer.seed, "kv_cache_gib": kv}
        rollout_cfg = type(cfg.rollout)(**{**cfg.rollout.__dict__, **fill})
        engine, trainer_cores, engine_cores = None, None, None
        if groups.is_leader:
            if cfg.rollout.placement == "separate":
                local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
                trainer_cores, engine_cores = placement.split_cores(*local)
                placement.bind_engine(engine_cores)
            engine = RolloutEngine(rollout_cfg, a.layout.moe_layers, a.layout.num_experts, a.layout.topk)
        agent = None
        if engine is not None and cfg.rollout.multi_turn.env != "none":
            agent = AgentLoop(engine, cfg.rollout.multi_turn, self.tokenizer, self.context)
        if trainer_cores is not None:  # after the engine's processes started
            placement.pin(trainer_cores, engine_cores)
            if self.rank == 0:
                say(f"[moe-rl] placement: trainer on cores {trainer_cores}, engine on {engine_cores}")
        source = EngineSource(
            engine,
            groups,
            self.data,
            self.tokenizer,
            cfg.sampling,
            cfg.data.prompts_per_step,
            cfg.parallel.seq_multiple,
            self._engine_may_stop,
            agent,
            route_layers=a.route_layers,
            holds_routes=holds_routes(),
        )
        if cfg.trainer.max_staleness:
            source = AheadSource(source, cfg.trainer.max_staleness, cfg.trainer.steps, engine_cores)
        if cfg.buffer.enable:
            source = self._buffer_source(source)
        return source, engine

    def _buffer_source(self, inner):
        """The replay buffer over the engine's batches (buffer.*); its draws seeded per data-parallel rank, so
        ranks that share samples (TP, PP) draw alike."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        cfg, b, layout = self.cfg, self.cfg.buffer, self.actor.layout
        seed = cfg.trainer.seed + 7919 * (1 + ps.get_data_parallel_rank())
        buffer = ReplayBuffer(b.capacity, b.max_age, b.priority, b.alpha, b.eps, b.fresh_fraction, seed)
        filler = filler_row(len(self.actor.route_layers), layout.topk, route_dtype(layout.num_experts))
        return BufferSource(
            inner,
            buffer,
            b,
            self.reward,
            self.objective.advantages,
            group_size=cfg.sampling.n,
            prompts_per_step=cfg.data.prompts_per_step,
            mini_batches=cfg.actor.mini_batches,
            pad_id=self.tokenizer.pad_token_id or 0,
            pad_multiple=cfg.parallel.seq_multiple,
            filler=torch.from_numpy(np.ascontiguousarray(filler)),
            warn=self.logger.warn,
        )

    def _buffer_file(self, checkpoint_path: Path) -> Path:
        return checkpoint_path / "buffer" / f"rank_{self.rank:05d}.safetensors"

    def _engine_kv_cache_gib(self, served: int, engines: int) -> float:
        """rollout.kv_cache_gib left null, CPU: what this rank's engine holds at most at once, at full length, its
        share of a step's samples or of a validation pass's, whichever takes more (plan/kv.py cpu_kv_cache_gib)."""
        cfg, context = self.cfg, self.context

        def longest(prompts: PromptSource, max_tokens: int) -> int:  # a multi-turn sample grows to the context
            single = cfg.rollout.multi_turn.env == "none"  # token_limit: _read_prompts always gives a context limit
            return min(context, prompts.token_limit + max_tokens) if single else context

        need = [(cfg.data.prompts_per_step * served * cfg.sampling.n, longest(self.data, cfg.sampling.max_tokens))]
        if self.val_prompts is not None:
            share = -(-len(self.val_prompts.items) // engines)
            need.append((share * cfg.val.n, longest(self.val_prompts, cfg.val.max_tokens or cfg.sampling.max_tokens)))
        spec, r = load_spec(self.model_path), cfg.rollout
        return max(cpu_kv_cache_gib(spec, r.tensor_parallel_size, r.dtype, n, tokens) for n, tokens in need)

    def _read_val_prompts(self) -> PromptSource:
        cfg = self.cfg
        max_tokens = cfg.val.max_tokens or cfg.sampling.max_tokens
        d, answers = cfg.data, self._answers_for(training=False)
        if d.val_path or d.task != "arithmetic":
            val = self._read_prompts(d.val_path, 0, 1, max_tokens, answers_for=answers)
        else:  # the task's val split
            problems = (d.arithmetic, "val", d.val_problems)
            val = self._read_prompts("", 0, 1, max_tokens, d.task, answers_for=answers, problems=problems)
        if self.rank == 0:
            dropped = f", {val.dropped} dropped as too long" if val.dropped else ""
            where = d.val_path or "the arithmetic val split"
            say(f"[moe-rl] validation: {len(val.items)} prompts of {where}{dropped}")
        return val

    def _build_validator(self, engine):
        cfg = self.cfg
        prompts = self.val_prompts.items  # in file order, every rank the same list
        args = (self.tokenizer, self.reward_fn, cfg.val, cfg.sampling, self._engine_may_stop)
        return Validator(prompts, self.source.groups, engine, *args, reward_timeout_s=cfg.data.reward_timeout_s)

    def _resume(self) -> dict | None:
        """Restore the checkpoint chosen (and verified) at start; None for a fresh run."""
        if self.resume_path is None:
            return None
        # may refuse; a missing trainer.json is checkpoint.load's error
        notes = self._resume_elsewhere(checkpoint.saved_state(self.resume_path))
        state = checkpoint.load(self.resume_path, self.actor.chunks, self.actor.optimizer)
        if self.critic is not None:
            checkpoint.load_part(self.resume_path / "critic", self.critic.chunks, self.critic.optimizer)
        self.step_index = state["step"]
        if self.rank == 0:
            say(f"[moe-rl] resumed from {self.resume_path} at step {self.step_index}")
            for note in notes:
                say(f"[moe-rl] WARNING: {note}")
        dp = _data_parallel_size()  # data_position counts per rank: keep the global count
        state["data_position"] = state["data_position"] * state.get("data_parallel_size", dp) // dp
        return state

    def _resume_elsewhere(self, state: dict) -> list[str]:
        """What changes when a checkpoint resumes under another world or data-parallel size (written by older
        versions: not recorded, taken as the same). The model and optimizer reload in any layout; the replay buffer,
        held per rank, does not."""
        world, dp = dist.get_world_size(), _data_parallel_size()
        saved_world, saved_dp = state.get("world_size", world), state.get("data_parallel_size", dp)
        if (saved_world, saved_dp) == (world, dp):
            return []
        if self.cfg.buffer.enable:
            raise CheckpointError(
                f"cannot resume {self.resume_path} with buffer.enable: its replay buffer is held per rank, written by "
                f"{saved_world} ranks with {saved_dp} data-parallel, and this run has {world} with {dp}. Resume with "
                "that layout, or start a fresh run (trainer.resume=off)"
            )
        notes = []
        if saved_world != world:
            notes.append(
                f"{self.resume_path} was written by {saved_world} ranks, this run has {world}: each rank's RNG state "
                "is not restored (the one its start-up seeding gave it stays)"
            )
        if saved_dp != dp:
            p = self.cfg.data.prompts_per_step
            notes.append(
                f"{self.resume_path} was trained with {saved_dp} data-parallel ranks, this run has {dp}: each rank's "
                f"prompt stream (its shard of the data, shuffled per rank) is another one, so the prompts from here "
                f"on differ from an uninterrupted run's; a step now trains {p * dp} prompts (was {p * saved_dp}: "
                "data.prompts_per_step is per data-parallel rank)"
            )
        return notes

    def save_checkpoint(self) -> Path:
        progress.mark("checkpoint")
        if not self.actor.weights_finite():
            raise checkpoint.CheckpointError(
                f"refusing to save step {self.step_index}: the actor's weights are not finite on some rank"
            )
        state = {"data_position": self.data_position, "wandb_run_id": self.logger.run_id, "model_path": self.model_path}
        state |= {"world_size": dist.get_world_size(), "data_parallel_size": _data_parallel_size()}
        a, keep = self.actor, self.cfg.trainer.checkpoint_keep
        buffer = self.source.buffer

        def extra(partial: Path) -> None:  # every rank: the parts beside the actor
            if buffer is not None:
                buffer.save(self._buffer_file(partial))
            if self.critic is not None:
                checkpoint.save_part(partial / "critic", self.critic.chunks, self.critic.optimizer)

        path = checkpoint.save(self.checkpoint_dir, self.step_index, a.chunks, a.optimizer, state, keep, extra)
        if self.rank == 0:
            say(f"[moe-rl] checkpoint step {self.step_index} -> {path}")
        return path

    # ---- one RL step: one line per phase ------------------------------------------------
    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        progress.begin_step(self.step_index + 1)
        timer = Timer()
        self.memory.reset()
        self.diagnostics.begin_step()
        with timer(self.source.phase):  # rollout | load_dump
            rollout = self.source.next(self.step_index)  # StepAbandoned when a signal took the engine
        balance = {}
        if self.cfg.trainer.balance_batch:
            with timer("balance"):
                rollout, balance = self.balance(rollout)
        with timer("reward"):
            rewards = self.reward(rollout)
        if self.objective.prox_logp == "loglinear":  # no pi_prox pass: the update interpolates it
            old = ProxPolicy(alpha=loglinear_alpha(rollout.policy_version, self.step_index))
        else:
            with timer("old_logprobs"):
                old = self.actor.old_logprobs(rollout.padded)
        ref, penalty = None, torch.zeros_like(rewards)
        if self.objective.needs_reference:
            with timer("ref_logprobs"):
                ref = self.actor.ref_logprobs(rollout.padded, old)
        if self.objective.kl_in_reward:
            penalty = self.objective.reward_kl(old.logprobs, ref, rollout.padded.loss_mask)
        if self.critic is not None:  # PPO with a critic: token-level GAE on the values before the update
            with timer("values"):
                values = self.critic.values(rollout.padded)
            whiten = self.cfg.algorithm.whiten_advantages
            advantages, returns = gae_targets(
                self.objective, rewards - penalty, rollout.padded.loss_mask, values["values"], whiten
            )
        else:
            advantages = self.objective.advantages(rewards - penalty)
        with timer("diagnostics"):  # dumps and router agreement, before the update changes the actor
            metrics = self.diagnostics(self.step_index, rollout, old, rewards)
        metrics |= rollout.metrics  # the source's: buffer/*; multi_turn/*, routes/*
        if self.objective.kl_in_reward:
            metrics["reward/kl_penalty_mean"] = float(penalty.mean())
        warming = self.critic is not None and self.step_index < self.cfg.critic.warmup_steps
        actor_updates = self.updates and not warming  # critic warm-up: the actor (and the engine) stay
        if actor_updates:
            with timer("update"):
                metrics |= self.actor.train(rollout.padded, old, advantages, self.objective, self._on_skip, ref)
            if self.actor.update_policy is not None:  # loglinear: no pi_old pass; the update's pi_theta stands in
                old = self.actor.update_policy
        if self.updates and self.critic is not None:
            with timer("critic_update"):
                metrics |= self.critic.update(rollout.padded, values, returns)
        synced = {}
        if actor_updates and self.weight_sync is not None:
            self.source.wait_idle()  # sampling ahead: the next step's ends before the weights change
            with timer("weight_sync"), self._engine_may_stop():
                synced = sync_metrics(self.weight_sync())
        if self.actor.replay is not None:  # the replay check over every position this step's passes replayed
            counts = torch.tensor(self.actor.replay.dispatch_check(), dtype=torch.long)
            dist.all_reduce(counts)
            metrics["router/replay_checked"], metrics["router/replay_mismatches"] = map(float, counts.tolist())
        val, every = {}, self.cfg.trainer.val_every
        if self.validator is not None and every and (self.step_index + 1) % every == 0:
            with timer("validation"):
                val = self.validator(self.step_index + 1)
        progress.mark("metrics")  # the step's reductions and its log line
        peaks = timer.times | self.memory.read() | self._idle_times(timer, time.perf_counter() - start) | synced
        metrics = global_metrics(rollout, rewards, old, self.cfg.sampling.n, self.objective.icepop_band, metrics, peaks)
        metrics |= val | balance | self._staleness(rollout)
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
        if self.actor.exact is not None and metrics["mismatch/exact_fraction"] < 1.0:
            self._not_exact(rollout.padded, old, metrics["mismatch/exact_fraction"])
        return metrics

    def _not_exact(self, padded, old: ProxPolicy, fraction: float) -> None:
        """trainer.true_on_policy and some response token's pi_old != mu: warn (or stop, under
        true_on_policy_strict) naming the first such token over the ranks. Collective."""
        differ = (old.logprobs.float() != padded.rollout_logprobs.float()) & (padded.loss_mask > 0)
        first = None
        if differ.any():
            i, j = map(int, differ.nonzero()[0])
            first = (i, j, float(old.logprobs[i, j]), float(padded.rollout_logprobs[i, j]))
        found = [(r, f) for r, f in enumerate(all_gather_objects(first)) if f is not None]
        if not found:  # the metric's comparison and this one are the same; nothing to name
            return
        rank, (i, j, pi_old, mu) = found[0]
        message = (
            f"trainer.true_on_policy: pi_old != mu on {1 - fraction:.3%} of response tokens; the first on rank "
            f"{rank}, sample {i} of its batch, token position {j}: log pi_old {pi_old!r}, log mu {mu!r}"
        )
        if self.cfg.trainer.true_on_policy_strict:
            raise RuntimeError(message + " (trainer.true_on_policy_strict=true)")
        self.logger.warn(self.step_index, message)

    def _build_critic(self):
        cfg = self.cfg
        return Critic(cfg.critic, cfg.model, cfg.parallel, cfg.actor, cfg.critic.model_path or self.model_path)

    def _staleness(self, rollout) -> dict[str, float]:
        """How many actor versions the step's samples lag the actor that trains on them (every rank's samples
        come from one version per step, so this rank's values are the step's)."""
        if not self.source.live:  # dumps: no engine, no versions to compare
            return {}
        lag = (self.step_index - rollout.policy_version).float()
        return {"staleness/mean": float(lag.mean()), "staleness/max": float(lag.max())}

    def _idle_times(self, timer, step_s: float) -> dict[str, float]:
        """time/step, and time/trainer_idle (waiting for samples) and time/rollout_idle (the engine with nothing
        to sample) of the step: synchronously the trainer waits the whole rollout and the engine the rest."""
        rollout_s = timer.times.get(f"time/{self.source.phase}", 0.0)
        return {"time/step": step_s} | self.source.idle_times(rollout_s, step_s)

    def balance(self, rollout):
        """(this rank's rollout after balancing tokens over the data-parallel ranks, its metrics)."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        return balance_rollout(rollout, cfg.sampling.n, cfg.actor.mini_batches, ps.get_data_parallel_group())

    def reward(self, rollout) -> torch.Tensor:
        """The reward plugin's scores (checked), or the dump's rewards."""
        if rollout.rewards is not None:
            return rollout.rewards
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        answers = [rollout.prompts[i].answer for i in rollout.prompt_index]
        sources = [rollout.prompts[i].text for i in rollout.prompt_index]
        rank = self.rank if dist.get_world_size() > 1 else None
        ids = rollout.response_ids
        rewards = score(
            self.reward_fn,
            texts,
            answers,
            ids,
            sources,
            self.step_index + 1,
            rank,
            timeout_s=self.cfg.data.reward_timeout_s,
        )
        return torch.tensor(rewards, dtype=torch.float32)

    def _on_skip(self, skipped: bool, mini_batch: int) -> bool:
        """Count a mini-batch whose optimizer step was skipped (raises after too many in a row)."""
        where = f"step {self.step_index + 1}, mini-batch {mini_batch + 1}/{self.cfg.actor.mini_batches}"
        warning = self.skips(skipped, where)
        if warning:
            self.logger.warn(self.step_index + 1, warning)
        return warning is not None

    def _engine_may_stop(self):
        """StopFlag.engine_may_stop, warning at the step under way."""
        return self.stop.engine_may_stop(lambda message: self.logger.warn(self.step_index + 1, message))

    def close(self) -> None:
        self.source.close()
        for line in self.health.summary():
            self.logger.warn(self.step_index, line)
        self.logger.close()


def train(cfg: TrainConfig, run_dir: str | Path) -> list[dict[str, float]]:
    """Run RL steps up to `trainer.steps` (counting resumed ones); returns this run's per-step
    metrics (rank 0 also writes them). Checkpoints every `trainer.checkpoint_every` steps, at the
    end, and on SIGTERM."""
    stop_with_launcher()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(cfg, run_dir)
    except NothingToTrain as e:
        if dist.get_rank() == 0:
            say(f"[moe-rl] {e}")
        return []
    start_up_done()
    t = cfg.trainer
    saves = t.saves_checkpoints
    history = []
    try:
        with watching(t.hang_timeout_s, trainer.engine, run_dir):
            if t.val_before_train and trainer.step_index == 0 and (val := trainer.validator(0)):
                trainer.logger.log(0, val)
            while trainer.step_index < t.steps:
                try:
                    history.append(trainer.step())
                except StepAbandoned as e:
                    trainer.logger.warn(trainer.step_index + 1, str(e))
                if trainer.stop.agreed():
                    if saves:
                        trainer.save_checkpoint()
                    trainer.logger.warn(trainer.step_index, checkpoint.signal_stop_warning(t.no_checkpoint_because))
                    break
                last = trainer.step_index == t.steps
                if saves and checkpoint.save_due(trainer.step_index, t.steps, t.checkpoint_every):
                    try:
                        trainer.save_checkpoint()
                    except CheckpointSaveError as e:  # raised on every rank alike: all go on, or all stop
                        if t.on_save_failure != "retry" or last:
                            raise
                        trainer.logger.warn(
                            trainer.step_index,
                            f"{e}. Training goes on (trainer.on_save_failure=retry): the next save is "
                            f"at step {trainer.step_index + t.checkpoint_every}",
                        )
    finally:
        trainer.close()
    return history


def _data_parallel_size() -> int:
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_world_size()
