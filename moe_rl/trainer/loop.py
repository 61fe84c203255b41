"""The RL loop: rollout -> reward -> advantages -> old log-probs (with replay) -> updates -> weight sync.

Departures from the textbook: the behaviour policy mu is the vLLM engine (not pi_old); the
training-inference mismatch is corrected by `algorithm.correction` (IcePop by default) on top
of routing replay (R3 by default), and GSPO's ratio is per sequence.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl.config import TrainConfig, validate


class Timer:
    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - t0


def _mean_over_world(metrics: dict[str, float]) -> dict[str, float]:
    if not dist.is_initialized() or dist.get_world_size() == 1 or not metrics:
        return metrics
    keys = sorted(metrics)
    t = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: v / dist.get_world_size() for k, v in zip(keys, t.tolist(), strict=True)}


def _world_max(*values: int) -> list[int]:
    """Max over all ranks (one all-reduce). Used for the padded length (data-parallel ranks that
    share an expert-parallel group must pad to one sequence length: megatron's token dispatchers
    exchange equal-sized blocks) and for flags every rank must agree on."""
    t = torch.tensor(values, dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class StepAbandoned(Exception):
    """A stop signal cut the step short before it changed the actor (the engine died with it)."""


def _global_count(x: torch.Tensor) -> float:
    from megatron.core import parallel_state as ps

    t = x.detach().double().clone().reshape(1)
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return float(t.item())


class Trainer:
    """Builds every component from the config once; `step()` runs one RL step."""

    def __init__(self, cfg: TrainConfig, run_dir: Path):
        from megatron.core import parallel_state as ps
        from transformers import AutoTokenizer

        from moe_rl.actor.model import ModelOptions, build_model, load_hf_config
        from moe_rl.actor.optimizer import build_optimizer
        from moe_rl.actor.parallel import init_distributed
        from moe_rl.actor.replay import RouteReplay
        from moe_rl.actor.weights import load_hf_weights
        from moe_rl.data.prompts import PromptSource
        from moe_rl.data.rewards import load_reward
        from moe_rl.objectives import ADVANTAGES, CORRECTIONS, POLICY_LOSSES
        from moe_rl.rollout.engine import RolloutEngine
        from moe_rl.routing.model_layout import moe_layout
        from moe_rl.trainer import checkpoint
        from moe_rl.trainer.logger import RunLogger

        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before anything is built
        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        self.cfg, self.run_dir = cfg, run_dir
        self.rank = dist.get_rank()
        t, d = cfg.trainer, cfg.data
        # A damaged checkpoint fails (or is skipped under auto_skip_damaged) before any other work.
        self.checkpoint_dir = Path(t.checkpoint_dir or run_dir / "checkpoints")
        self.resume_path, notes = checkpoint.resolve_resume(self.checkpoint_dir, t.resume)
        for note in notes if self.rank == 0 else []:
            print(f"[moe-rl] WARNING: {note}", flush=True)
        model_path = cfg.model.path or self._tiny_model(run_dir)
        hf_cfg = load_hf_config(model_path)
        self.layout = moe_layout(hf_cfg)
        # Data and reward before the model and engines: a bad file fails in seconds.
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        context = cfg.rollout.max_model_len or hf_cfg.max_position_embeddings
        self.data = PromptSource(
            d.task,
            d.path,
            d.prompt_key,
            d.answer_key,
            t.seed,
            dp_rank,
            dp_size,
            tokenize=lambda texts: self.tokenizer(texts)["input_ids"],
            max_prompt_tokens=context - cfg.sampling.max_tokens,
            overlong=d.overlong_prompts,
        )
        if self.data.dropped and self.rank == 0:
            print(
                f"[moe-rl] data: dropped {self.data.dropped} prompts of {d.path or d.task} longer than "
                f"{context - cfg.sampling.max_tokens} tokens (data.overlong_prompts=drop)",
                flush=True,
            )
        self.reward_fn = load_reward(d.reward)
        self.advantage_fn = ADVANTAGES.get(cfg.algorithm.advantage)
        self.correction_fn = CORRECTIONS.get(cfg.algorithm.correction)
        self.loss_fn = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.chunks, self.conv = build_model(
            hf_cfg, cfg.parallel, ModelOptions(dtype=cfg.model.dtype, recompute=cfg.model.recompute)
        )
        load_hf_weights(self.chunks, self.conv, model_path)
        self.dumping = t.dump_every > 0 or t.mode == "rollout_only"
        wants_replay = cfg.actor.router_replay != "off" or self.dumping
        self.replay = RouteReplay(self.chunks, self.layout.moe_layers, verify="count") if wants_replay else None
        self.optimizer = build_optimizer(self.chunks, cfg.actor.lr, cfg.actor.weight_decay, cfg.actor.grad_clip)
        self.model_path, self.hf_cfg = model_path, hf_cfg
        self.dump_dir = Path(t.dump_dir or run_dir / "dumps")
        self.step_index = 0
        self.skips = SkipCounter(t.max_skipped_steps)
        self.health = HealthMonitor(t.first_minibatch_tolerance)
        self.stop = StopFlag()
        resumed = self._resume()
        self.logger = RunLogger(run_dir, cfg, enabled=self.rank == 0, wandb_id=(resumed or {}).get("wandb_run_id"))
        self.engine = None
        if t.mode != "from_dump":
            rollout_cfg = type(cfg.rollout)(**{**cfg.rollout.__dict__, "model": model_path, "seed": t.seed})
            self.engine = RolloutEngine(rollout_cfg, self.layout.moe_layers, self.layout.num_experts, self.layout.topk)
            if resumed:  # the engine starts from the HF weights; give it the resumed actor's
                self.sync_weights()
        if resumed:
            self.data.skip(resumed["data_position"])
        self.data_position = self.data.position  # prompts consumed by completed steps

    def _resume(self) -> dict | None:
        """Restore the checkpoint chosen (and verified) at start; None for a fresh run."""
        from moe_rl.trainer import checkpoint

        if self.resume_path is None:
            return None
        state = checkpoint.load(self.resume_path, self.chunks, self.optimizer)
        self.step_index = state["step"]
        if self.rank == 0:
            print(f"[moe-rl] resumed from {self.resume_path} at step {self.step_index}", flush=True)
        return state

    def save_checkpoint(self) -> Path:
        from moe_rl.actor.train_step import all_finite
        from moe_rl.trainer import checkpoint

        if not all_finite([p for c in self.chunks for p in c.parameters()]):
            raise checkpoint.CheckpointError(
                f"refusing to save step {self.step_index}: the actor's weights are not finite on some rank"
            )
        state = {"data_position": self.data_position, "wandb_run_id": self.logger.run_id, "model_path": self.model_path}
        keep = self.cfg.trainer.checkpoint_keep
        path = checkpoint.save(self.checkpoint_dir, self.step_index, self.chunks, self.optimizer, state, keep)
        if self.rank == 0:
            print(f"[moe-rl] checkpoint step {self.step_index} -> {path}", flush=True)
        return path

    def _tiny_model(self, run_dir: Path) -> str:
        from moe_rl.tools.tiny_model import TinySpec, build_tiny_model

        path = run_dir / "tiny_model"
        if self.rank == 0 and not (path / "config.json").is_file():
            build_tiny_model(TinySpec(arch=self.cfg.model.tiny_arch, seed=self.cfg.trainer.seed), path)
        dist.barrier()
        return str(path)

    # ---- one RL step: one line per phase ------------------------------------------------
    def step(self) -> dict[str, float]:
        timer = Timer()
        t, n = self.cfg.trainer, self.cfg.sampling.n
        if self.replay is not None:
            self.replay.dispatch_check(reset=True)
        if t.mode == "from_dump":
            with timer("load_dump"):
                padded, rewards = self.load_dump()
            lengths_mean = float(padded.loss_mask.sum() / len(rewards))
        else:
            with timer("rollout"):
                prompts, batch = self.rollout()
            # One all-reduce: whether any rank lost its engine (ranks leave the step together) and
            # the padded length (EP ranks must agree on it).
            pairs = [] if batch is None else zip(batch.prompt_ids, batch.response_ids, strict=True)
            abandoned, longest = _world_max(batch is None, max((len(p) + len(r) for p, r in pairs), default=0))
            if abandoned:
                raise StepAbandoned(f"step {self.step_index + 1}: the rollout engine stopped with the signal")
            with timer("reward"):
                rewards = self.reward(prompts, batch)
            with timer("route_handling"):  # padding, route tensors
                padded = batch.to_padded(
                    pad_id=self.tokenizer.pad_token_id or 0, pad_to_multiple=self.cfg.parallel.tp, min_length=longest
                )
            lengths_mean = sum(map(len, batch.response_ids)) / len(batch)
        advantages = self.advantage_fn(rewards, n)
        with timer("old_logprobs"):
            old = self.old_logprobs(padded)
        metrics: dict[str, float] = {}
        every = self.cfg.logging.router_agreement_every
        dump_now = self.dumping and (t.mode == "rollout_only" or self.step_index % t.dump_every == 0)
        agree_now = every and self.replay is not None and padded.routes is not None and self.step_index % every == 0
        if dump_now or agree_now:
            with timer("diagnostics"):  # before the update changes the actor
                views = self.routing_views(padded, old)
            if agree_now:
                metrics["router/agreement"] = self.router_agreement(padded, views["routes_live"])
            if dump_now:
                self.write_dump(padded, rewards, views)
        if t.mode != "rollout_only":
            with timer("update"):
                metrics.update(self.update(padded, old, advantages))
            if self.engine is not None:
                with timer("weight_sync"), self._engine_may_stop():
                    self.sync_weights()
        metrics.update(self.batch_metrics(rewards, lengths_mean, padded, old))
        metrics.update(timer.times)
        metrics = _mean_over_world(metrics)
        self.step_index += 1
        self.data_position = self.data.position
        self.logger.log(self.step_index, metrics)
        for warning in self.health(metrics):
            self.logger.warn(self.step_index, warning)
        return metrics

    @contextmanager
    def _engine_may_stop(self):
        """Under a stop signal (SIGTERM reaches the engine's processes too) an engine failure ends
        the step's engine work instead of the run: the checkpoint does not need the engine."""
        from moe_rl.rollout.engine import RolloutEngineError

        try:
            yield
        except RolloutEngineError as e:
            if not self.stop.requested:
                raise
            self.logger.warn(self.step_index + 1, f"engine stopped by the signal ({e}); checkpointing without it")

    def rollout(self):
        """(prompts, RolloutBatch); (prompts, None) when a stop signal took the engine down."""
        prompts, batch = self.data.next(self.cfg.data.prompts_per_step), None
        ids = [self.tokenizer(p.text)["input_ids"] for p in prompts]
        sampling = self.cfg.sampling
        if sampling.seed is not None:  # distinct per step and rank, reproducible after a resume
            stream = self.step_index * dist.get_world_size() + self.rank
            sampling = type(sampling)(**{**sampling.__dict__, "seed": sampling.seed + stream * len(ids)})
        with self._engine_may_stop():
            batch = self.engine.generate(ids, sampling)
        return prompts, batch

    def reward(self, prompts, batch) -> torch.Tensor:
        from moe_rl.data.rewards import score

        texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        answers = [prompts[i].answer for i in batch.prompt_index]
        sources = [prompts[i].text for i in batch.prompt_index]
        rank = self.rank if dist.get_world_size() > 1 else None
        rewards = score(self.reward_fn, texts, answers, batch.response_ids, sources, self.step_index + 1, rank)
        return torch.tensor(rewards, dtype=torch.float32)

    def old_logprobs(self, padded) -> dict[str, torch.Tensor]:
        mode = self.cfg.actor.router_replay
        return _compute_old(self.chunks, padded, self.cfg.actor.micro_batch_size, self.replay, mode)

    def update(self, padded, old, advantages) -> dict[str, float]:
        from moe_rl.actor.train_step import train_minibatch

        a, alg = self.cfg.actor, self.cfg.algorithm
        corr = self.correction_fn(old["logprobs"], padded.rollout_logprobs, padded.loss_mask, **_correction_kwargs(alg))
        routes = {"r3": padded.routes, "r2": old.get("routes"), "off": None}[a.router_replay]
        b = padded.input_ids.shape[0]
        per = b // a.mini_batches
        out: dict[str, float] = {f"{alg.correction}/{k}": float(v) for k, v in corr.metrics.items()}
        out["actor/skipped_steps"] = 0.0
        norms = []
        for i in range(a.mini_batches):
            rows = slice(i * per, (i + 1) * per)
            mask = corr.mask[rows]
            batch = {
                "input_ids": padded.input_ids[rows],
                "attention_mask": padded.attention_mask[rows],
                "old_logprobs": old["logprobs"][rows],
                "loss_mask": mask,
                "advantages": advantages[rows],
                "weights": (corr.weights if corr.weights is not None else torch.ones_like(mask))[rows],
            }
            if routes is not None:
                batch["routes"] = routes[rows]
            counts = {"num_tokens": _global_count(mask.sum()), "num_seqs": _global_count((mask.sum(-1) > 0).sum())}

            def loss(logp, mb, counts=counts):
                return self.loss_fn(
                    logp,
                    mb["old_logprobs"],
                    mb["advantages"],
                    mb["loss_mask"],
                    clip_low=alg.clip_low,
                    clip_high=alg.clip_high,
                    weights=mb["weights"],
                    agg=alg.loss_agg,
                    **counts,
                )

            m = train_minibatch(
                self.chunks,
                self.optimizer,
                batch,
                loss,
                a.micro_batch_size,
                replay=self.replay if routes is not None else None,
            )
            if i == 0:  # pi_theta == pi_old before the first optimizer step
                out["actor/first_minibatch_ppo_kl"] = m.get("ppo_kl", 0.0)
            where = f"step {self.step_index + 1}, mini-batch {i + 1}/{a.mini_batches}"
            warning = self.skips(bool(m.pop("skipped")), where)
            if warning:
                out["actor/skipped_steps"] += 1
                self.logger.warn(self.step_index + 1, warning)
            norms.append(m.pop("actor/grad_norm"))
            for k, v in m.items():
                key = k if "/" in k else f"actor/{k}"
                out[key] = out.get(key, 0.0) + v / a.mini_batches
        applied = [x for x in norms if math.isfinite(x)]
        out["actor/grad_norm"] = sum(applied) / len(applied) if applied else float("nan")
        return out

    def routing_views(self, padded, old) -> dict[str, torch.Tensor | None]:
        from moe_rl.actor.forward import routing_views

        mode = self.cfg.actor.router_replay
        return routing_views(
            self.chunks,
            padded.input_ids,
            padded.attention_mask,
            self.cfg.actor.micro_batch_size,
            self.replay,
            padded.routes,
            replayed=old["logprobs"] if mode == "r3" else None,
            live=old if mode == "r2" else None,
        )

    def router_agreement(self, padded, live_routes: torch.Tensor) -> float:
        """Fraction of (token, MoE layer) pairs where the actor's own routing picks the same expert
        set as the rollout engine (this rank's layers; real tokens except the last)."""
        from moe_rl.routing.compare import route_sets_differ, routed_positions

        cols = sorted({self.replay.col[h.layer] for h in self.replay.hooks})
        valid = routed_positions(padded.attention_mask)
        differ, _ = route_sets_differ(live_routes[:, :, cols][valid], padded.routes[:, :, cols][valid])
        return float((~differ).float().mean())

    def write_dump(self, padded, rewards, views) -> None:
        from moe_rl.rollout import dump

        dump.write_rank(
            self.dump_dir,
            self.step_index,
            padded,
            views,
            self.replay.dispatch_check(),
            model_path=self.model_path,
            model=dump.model_fingerprint(self.hf_cfg, self.layout),
            actor_dtype=self.cfg.model.dtype,
            rollout_dtype=self.cfg.rollout.dtype,
            router_replay=self.cfg.actor.router_replay,
            n=self.cfg.sampling.n,
            rewards=rewards,
        )

    def load_dump(self):
        """The padded batch and rewards of the next dumped step (trainer.mode=from_dump)."""
        from moe_rl.rollout import dump
        from moe_rl.rollout.batch import PaddedBatch

        steps = dump.step_folders(self.dump_dir)
        folder = steps[self.step_index % len(steps)]
        tensors, meta = dump.read(folder / f"rank_{self.rank:05d}.safetensors")
        expected = dump.model_fingerprint(self.hf_cfg, self.layout)
        if meta["model"] != expected:
            raise dump.DumpError(f"{folder}: dump is from model {meta['model']}, the actor is {expected}")
        if meta["world_size"] != dist.get_world_size():
            raise dump.DumpError(
                f"{folder}: written by {meta['world_size']} ranks, this run has {dist.get_world_size()}"
            )
        routes = tensors.get("routes")
        if "rewards" not in tensors:
            raise dump.DumpError(f"{folder}: has no rewards (written by moe-rl-diagnose, not a training run?)")
        if self.cfg.actor.router_replay == "r3" and routes is None:
            raise dump.DumpError(f"{folder}: actor.router_replay=r3 needs engine routes; the dump has none")
        padded = PaddedBatch(
            tensors["input_ids"],
            tensors["attention_mask"],
            tensors["loss_mask"],
            tensors["rollout_logprobs"],
            routes,
        )
        return padded, tensors["rewards"]

    def sync_weights(self) -> None:
        from moe_rl.actor.weights import export_hf_state_dict

        self.engine.update_weights(export_hf_state_dict(self.chunks, self.conv).items())

    def batch_metrics(self, rewards, lengths_mean, padded, old) -> dict[str, float]:
        from moe_rl.objectives import mismatch_metrics

        mask = padded.loss_mask
        m = {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            # every rank holds the same number of groups: the world mean is the global fraction
            "reward/zero_variance_groups": zero_variance_fraction(rewards, self.cfg.sampling.n),
            "response/length_mean": float(lengths_mean),
            "actor/entropy": float((old["entropy"] * mask).sum() / mask.sum().clamp(min=1)),
        }
        alg = self.cfg.algorithm
        mm = mismatch_metrics(old["logprobs"], padded.rollout_logprobs, mask, alg.correction_low, alg.correction_high)
        m.update({f"mismatch/{k}": float(v) for k, v in mm.items()})
        return m

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        for line in self.health.summary():
            self.logger.warn(self.step_index, line)
        self.logger.close()


# Thresholds practitioners watch (verl / slime rollout-correction guides).
HEALTH = (
    ("mismatch/kl", lambda v: abs(v) > 0.1, "|KL(mu || pi_old)| > 0.1"),
    ("mismatch/chi2_token", lambda v: v > 1.0, "token chi^2 > 1"),
    ("mismatch/ess", lambda v: v < 0.3, "effective sample size < 0.3"),
    ("mismatch/log_ppl_abs_diff", lambda v: v > 0.1, "|log-ppl diff| > 0.1"),
)


def health_warnings(metrics: dict[str, float], first_minibatch_tolerance: float) -> list[str]:
    out = []
    kl0 = metrics.get("actor/first_minibatch_ppo_kl")
    if kl0 is not None and abs(kl0) > first_minibatch_tolerance:
        out.append(
            f"pi_theta != pi_old on the first mini-batch (ppo_kl {kl0:.2e} > {first_minibatch_tolerance:g}): "
            "broken weight sync or routing replay?"
        )
    for key, bad, text in HEALTH:
        if key in metrics and bad(metrics[key]):
            out.append(f"training-inference mismatch: {text} ({key} = {metrics[key]:.3g})")
    return out


class NonFiniteUpdateError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


class SkipCounter:
    """Consecutive optimizer steps skipped for a non-finite loss or gradient; `limit` in a row stop
    the run (trainer.max_skipped_steps)."""

    def __init__(self, limit: int):
        self.limit, self.streak = limit, 0

    def __call__(self, skipped: bool, where: str) -> str | None:
        """The warning for a skipped step (None for an applied one); raises at the limit."""
        if not skipped:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak >= self.limit:
            raise NonFiniteUpdateError(
                f"{where}: {self.streak} optimizer step(s) in a row had a non-finite loss or gradient "
                f"(trainer.max_skipped_steps={self.limit}); stopping before the model is damaged. Check the "
                "rewards, the learning rate and the mismatch metrics of the last steps (metrics.jsonl)."
            )
        return (
            f"{where}: non-finite loss or gradient; the optimizer step was skipped on every rank "
            f"({self.streak} in a row, limit trainer.max_skipped_steps={self.limit})"
        )


def zero_variance_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of GRPO groups (group_size consecutive samples) whose rewards are all equal: those
    groups have zero advantage and teach nothing."""
    groups = rewards.reshape(-1, group_size)
    return float((groups == groups[:, :1]).all(dim=1).float().mean())


class HealthMonitor:
    """Step-level warnings from the logged metrics: the stateless `health_warnings`, a gradient-norm
    jump (> 10x the median of the previous ten steps; users of RL trainers report such jumps ahead
    of collapse) and steps with nothing to learn (every group's rewards equal), the latter shown
    once and counted at the end."""

    def __init__(self, first_minibatch_tolerance: float = 1e-4, window: int = 10, spike: float = 10.0):
        self.tolerance = first_minibatch_tolerance
        self.norms: list[float] = []
        self.window, self.spike = window, spike
        self.flat_steps = 0

    def __call__(self, metrics: dict[str, float]) -> list[str]:
        out = health_warnings(metrics, self.tolerance)
        norm = metrics.get("actor/grad_norm")
        if norm is not None and math.isfinite(norm):
            previous = self.norms[-self.window :]
            if previous:
                median = statistics.median(previous)
                if median > 0 and norm > self.spike * median:
                    out.append(
                        f"gradient-norm spike: actor/grad_norm {norm:.3g} is {norm / median:.0f}x the median "
                        f"{median:.3g} of the previous {len(previous)} steps (often precedes a collapse)"
                    )
            self.norms.append(norm)
        if metrics.get("reward/zero_variance_groups") == 1.0:
            self.flat_steps += 1
            if self.flat_steps == 1:
                out.append(
                    "every group's rewards are equal (reward/zero_variance_groups = 1): all advantages are 0 and "
                    "this step teaches nothing; too easy or too hard a task, or a reward that ignores the response? "
                    "(said once; counted at the end)"
                )
        return out

    def summary(self) -> list[str]:
        if self.flat_steps:
            return [f"{self.flat_steps} step(s) had nothing to learn (every group's rewards equal)"]
        return []


def _compute_old(chunks, padded, micro_batch_size, replay, mode):
    from moe_rl.actor.forward import compute_logprobs

    kw = {}
    if mode == "r3":
        kw = {"routes": padded.routes, "replay": replay}
    elif mode == "r2":
        kw = {"record": True, "replay": replay}
    return compute_logprobs(chunks, padded.input_ids, padded.attention_mask, micro_batch_size, **kw)


def _correction_kwargs(alg) -> dict:
    name = alg.correction
    if name in ("icepop", "seq-mask", "geo-mask"):
        return {"low": alg.correction_low, "high": alg.correction_high}
    if name in ("tis", "seq-tis"):
        return {"cap": alg.correction_cap}
    return {}


class StopFlag:
    """SIGTERM/SIGUSR1 (Slurm preemption, torchrun shutdown) ask for a checkpoint at the next step
    boundary; a second signal exits at once. Ranks agree on stopping with one all-reduce.

    A repeat within `REPEAT_S` seconds is the same request, not a second one: under Slurm a rank
    gets the signal twice within milliseconds (`scancel --signal` reaches every process of the
    step, and torchrun forwards the one it got)."""

    REPEAT_S = 2.0

    def __init__(self):
        import signal

        self.requested = False
        self.first_at = 0.0
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        import signal

        name = signal.Signals(signum).name
        if self.requested and time.monotonic() - self.first_at > self.REPEAT_S:
            print(f"[moe-rl] pid {os.getpid()}: second {name}: exiting now", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        if not self.requested:
            print(
                f"[moe-rl] pid {os.getpid()}: {name}: checkpoint at the next step boundary", file=sys.stderr, flush=True
            )
            self.requested, self.first_at = True, time.monotonic()

    def agreed(self) -> bool:
        t = torch.tensor([int(self.requested)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def stop_with_launcher() -> None:
    """Under torchrun: receive SIGUSR1 when the launcher dies (even by SIGKILL), so the rank
    checkpoints at the next step boundary and exits instead of training on unsupervised.
    Linux prctl(PR_SET_PDEATHSIG); elsewhere a no-op. (SIGUSR1, not SIGTERM: with SIGTERM a rank
    was seen to receive it twice, which StopFlag takes as "exit now".)"""
    import ctypes
    import signal

    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGUSR1, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGUSR1)


def train(cfg: TrainConfig, run_dir: str | Path) -> list[dict[str, float]]:
    """Run RL steps up to `trainer.steps` (counting resumed ones); returns this run's per-step
    metrics (rank 0 also writes them). Checkpoints every `trainer.checkpoint_every` steps, at the
    end, and on SIGTERM."""
    stop_with_launcher()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, run_dir)
    t = cfg.trainer
    saves = t.mode != "rollout_only"
    history = []
    try:
        while trainer.step_index < t.steps:
            try:
                history.append(trainer.step())
            except StepAbandoned as e:
                trainer.logger.warn(trainer.step_index + 1, str(e))
            if trainer.stop.agreed():
                if saves:
                    trainer.save_checkpoint()
                trainer.logger.warn(trainer.step_index, "stopped by a signal after saving a checkpoint")
                break
            if saves and (
                trainer.step_index == t.steps or (t.checkpoint_every and trainer.step_index % t.checkpoint_every == 0)
            ):
                trainer.save_checkpoint()
    finally:
        trainer.close()
    return history
