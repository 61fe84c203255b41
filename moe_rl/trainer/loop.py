"""The RL loop: rollout -> reward -> advantages -> old log-probs (with replay) -> updates -> weight sync.

Departures from the textbook: the behaviour policy mu is the vLLM engine (not pi_old); the
training-inference mismatch is corrected by `algorithm.correction` (IcePop by default) on top
of routing replay (R3 by default), and GSPO's ratio is per sequence.
"""

from __future__ import annotations

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


def _world_max(value: int) -> int:
    """Max over all ranks: data-parallel ranks that share an expert-parallel group must pad to
    one sequence length (megatron's token dispatchers exchange equal-sized blocks)."""
    t = torch.tensor([value], dtype=torch.long)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


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
        from moe_rl.actor.parallel import init_distributed
        from moe_rl.actor.replay import RouteReplay
        from moe_rl.actor.weights import load_hf_weights
        from moe_rl.data.prompts import PromptSource
        from moe_rl.data.rewards import load_reward
        from moe_rl.objectives import ADVANTAGES, CORRECTIONS, POLICY_LOSSES
        from moe_rl.rollout.engine import RolloutEngine
        from moe_rl.routing.model_layout import moe_layout
        from moe_rl.trainer.logger import RunLogger

        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        validate(cfg, dist.get_world_size())
        self.cfg, self.run_dir = cfg, run_dir
        self.rank = dist.get_rank()
        model_path = cfg.model.path or self._tiny_model(run_dir)
        hf_cfg = load_hf_config(model_path)
        self.layout = moe_layout(hf_cfg)
        self.chunks, self.conv = build_model(
            hf_cfg, cfg.parallel, ModelOptions(dtype=cfg.model.dtype, recompute=cfg.model.recompute)
        )
        load_hf_weights(self.chunks, self.conv, model_path)
        self.replay = None if cfg.actor.router_replay == "off" else RouteReplay(self.chunks, self.layout.moe_layers)
        params = [p for c in self.chunks for p in c.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.actor.lr, weight_decay=cfg.actor.weight_decay)
        rollout_cfg = type(cfg.rollout)(**{**cfg.rollout.__dict__, "model": model_path, "seed": cfg.trainer.seed})
        self.engine = RolloutEngine(rollout_cfg, self.layout.moe_layers, self.layout.num_experts, self.layout.topk)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
        dp_size = ps.get_data_parallel_world_size(with_context_parallel=True)
        d = cfg.data
        self.data = PromptSource(d.task, d.path, d.prompt_key, d.answer_key, cfg.trainer.seed, dp_rank, dp_size)
        self.reward_fn = load_reward(d.reward)
        self.advantage_fn = ADVANTAGES.get(cfg.algorithm.advantage)
        self.correction_fn = CORRECTIONS.get(cfg.algorithm.correction)
        self.loss_fn = POLICY_LOSSES.get(cfg.algorithm.policy_loss)
        self.logger = RunLogger(run_dir, cfg, enabled=self.rank == 0)
        self.step_index = 0

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
        with timer("rollout"):
            prompts, batch = self.rollout()
        with timer("reward"):
            rewards = self.reward(prompts, batch)
        advantages = self.advantage_fn(rewards, self.cfg.sampling.n)
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]
        padded = batch.to_padded(
            pad_id=self.tokenizer.pad_token_id or 0,
            pad_to_multiple=self.cfg.parallel.tp,
            min_length=_world_max(max(lengths)),
        )
        with timer("old_logprobs"):
            old = self.old_logprobs(padded)
        every = self.cfg.logging.router_agreement_every
        agreement = {}
        if every and self.replay is not None and padded.routes is not None and self.step_index % every == 0:
            with timer("router_agreement"):  # before the update changes the actor
                agreement["router/agreement"] = self.router_agreement(padded, old)
        with timer("update"):
            metrics = self.update(padded, old, advantages)
        metrics.update(agreement)
        with timer("weight_sync"):
            self.sync_weights()
        metrics.update(self.batch_metrics(rewards, batch, padded, old))
        metrics.update(timer.times)
        metrics = _mean_over_world(metrics)
        self.step_index += 1
        self.logger.log(self.step_index, metrics)
        for warning in health_warnings(metrics, self.cfg.trainer.first_minibatch_tolerance):
            self.logger.warn(self.step_index, warning)
        return metrics

    def rollout(self):
        prompts = self.data.next(self.cfg.data.prompts_per_step)
        ids = [self.tokenizer(p.text)["input_ids"] for p in prompts]
        return prompts, self.engine.generate(ids, self.cfg.sampling)

    def reward(self, prompts, batch) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        answers = [prompts[i].answer for i in batch.prompt_index]
        rewards = self.reward_fn(texts, answers, batch.response_ids)
        if len(rewards) != len(batch):
            raise ValueError(f"data.reward returned {len(rewards)} rewards for {len(batch)} samples")
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
                a.grad_clip,
                replay=self.replay if routes is not None else None,
            )
            if i == 0:  # pi_theta == pi_old before the first optimizer step
                out["actor/first_minibatch_ppo_kl"] = m.get("ppo_kl", 0.0)
            for k, v in m.items():
                key = k if "/" in k else f"actor/{k}"
                out[key] = out.get(key, 0.0) + v / a.mini_batches
        return out

    def router_agreement(self, padded, old) -> float:
        """Fraction of (token, MoE layer) pairs where the actor's own routing picks the same expert
        set as the rollout engine (this rank's layers; real tokens except the last)."""
        from moe_rl.actor.forward import compute_logprobs

        if self.cfg.actor.router_replay == "r2":
            live = old["routes"]
        else:
            live = compute_logprobs(
                self.chunks,
                padded.input_ids,
                padded.attention_mask,
                self.cfg.actor.micro_batch_size,
                with_entropy=False,
                replay=self.replay,
                record=True,
            )["routes"]
        cols = sorted({self.replay.col[h.layer] for h in self.replay.hooks})
        valid = padded.attention_mask.bool().clone()
        valid[torch.arange(valid.shape[0]), padded.attention_mask.sum(1) - 1] = False
        same = (live[:, :, cols].long().sort(-1).values == padded.routes[:, :, cols].long().sort(-1).values).all(-1)
        return float(same[valid].float().mean())

    def sync_weights(self) -> None:
        from moe_rl.actor.weights import export_hf_state_dict

        self.engine.update_weights(export_hf_state_dict(self.chunks, self.conv).items())

    def batch_metrics(self, rewards, batch, padded, old) -> dict[str, float]:
        from moe_rl.objectives import mismatch_metrics

        mask = padded.loss_mask
        m = {
            "reward/mean": float(rewards.mean()),
            "reward/max": float(rewards.max()),
            "response/length_mean": float(sum(map(len, batch.response_ids)) / len(batch)),
            "actor/entropy": float((old["entropy"] * mask).sum() / mask.sum().clamp(min=1)),
        }
        alg = self.cfg.algorithm
        mm = mismatch_metrics(old["logprobs"], padded.rollout_logprobs, mask, alg.correction_low, alg.correction_high)
        m.update({f"mismatch/{k}": float(v) for k, v in mm.items()})
        return m

    def close(self) -> None:
        self.engine.shutdown()
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


def train(cfg: TrainConfig, run_dir: str | Path) -> list[dict[str, float]]:
    """Run `trainer.steps` RL steps; returns the per-step metrics (rank 0 also writes them)."""
    import signal

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)

    def on_sigterm(signum, frame):  # torchrun / Slurm stop a job with SIGTERM: unwind so engines shut down
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)
    trainer = Trainer(cfg, run_dir)
    history = []
    try:
        for _ in range(cfg.trainer.steps):
            history.append(trainer.step())
    finally:
        trainer.close()
    return history
