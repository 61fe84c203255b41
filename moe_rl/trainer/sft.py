"""Supervised fine-tuning on the RL trainer's actor (launch/sft_moe.py): the same megatron-core model under any
parallel layout, packing, recompute, fused log-probs and optimizer; checkpoints with resume and SIGTERM;
metrics.jsonl, wandb and one console line per step; at the end an HF folder that RL starts from.

A step: the next `data.batch_size` examples (the same global batch whatever the data-parallel size), each rank its
share, one optimizer step of next-token cross-entropy on the response tokens, the token mean over the batch
(objectives/sft.py). Every `trainer.val_every` steps and at the end: val/loss over the validation examples.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from moe_rl.actor.actor import Actor
from moe_rl.actor.hf_export import write_hf_folder
from moe_rl.actor.model import check_divisibility, get_converter, load_hf_config
from moe_rl.actor.parallel import init_distributed
from moe_rl.common import progress
from moe_rl.common.distributed import world_max
from moe_rl.common.gc_startup import start_up_done
from moe_rl.config import SFTConfig
from moe_rl.config.validate import validate_sft
from moe_rl.data.prompts import DataError, PromptSource
from moe_rl.data.rewards import load_reward
from moe_rl.data.sft import Batches, Example, check_lengths, pad, read_examples, task_examples
from moe_rl.models.tiny import built_in_model
from moe_rl.rollout.config import RolloutConfig, SamplingConfig
from moe_rl.rollout.engine import RolloutEngine
from moe_rl.rollout.engine_groups import engine_groups
from moe_rl.trainer import checkpoint
from moe_rl.trainer.logger import RunLogger, say
from moe_rl.trainer.metrics import PeakMemory
from moe_rl.trainer.run_dir import check_same_run_dir
from moe_rl.trainer.signals import StopFlag, stop_with_launcher
from moe_rl.trainer.validation import Validator
from moe_rl.trainer.watchdog import watching
from moe_rl.weight_sync import WeightSync


class SFTTrainer:
    def __init__(self, cfg: SFTConfig, run_dir: Path):
        # heavy: megatron-core and transformers, imported on first use
        from megatron.core import parallel_state as ps
        from transformers import AutoTokenizer

        validate_sft(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before anything is built
        init_distributed(cfg.parallel, seed=cfg.trainer.seed)
        check_same_run_dir(run_dir)
        self.cfg, self.run_dir, self.rank = cfg, run_dir, dist.get_rank()
        t = cfg.trainer
        self.checkpoint_dir = Path(t.checkpoint_dir or run_dir / "checkpoints")
        self.resume_path = checkpoint.resume_point(self.checkpoint_dir, t.resume, self.rank)
        m = cfg.model
        self.model_path = m.path or built_in_model(run_dir, m.tiny_arch, m.tiny_size, cfg.trainer.seed)
        hf_config = load_hf_config(self.model_path)
        check_divisibility(get_converter(hf_config), cfg.parallel)
        # the data before the model: a bad row fails in seconds
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        limit = cfg.data.max_length or hf_config.max_position_embeddings
        limit_name = "data.max_length" if cfg.data.max_length else "the model's context (max_position_embeddings)"
        train, val = self._examples()
        for examples in (train, val):
            check_lengths(examples, limit, limit_name)
        generate = bool(val and t.val_every and cfg.val.generate)
        val_prompts, reward_fn = [], None
        if generate and cfg.data.reward_spec:
            val_prompts, reward_fn = self._val_prompts(hf_config.max_position_embeddings)
        dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.batches = Batches(train, cfg.data.batch_size, t.seed, dp_rank, dp)
        if 0 < len(val) < dp:
            raise DataError(f"{len(val)} validation examples cannot be shared by {dp} data-parallel ranks")
        self.val = val[dp_rank::dp]  # each rank scores its share; val/loss sums over the ranks
        self._val_batch = None
        if self.rank == 0:
            p = cfg.parallel
            checkpoints = "checkpoints/, " if t.saves_checkpoints else ""
            hf = "hf/ at the end" if t.export_hf else "no hf/ (trainer.export_hf=false)"
            say(f"[moe-rl] SFT run {run_dir}: metrics.jsonl, {checkpoints}{hf}")
            say(
                f"[moe-rl] model {self.model_path} ({hf_config.model_type}); layout world {dist.get_world_size()} = "
                f"DP {dp} x TP {p.tp} x PP {p.pp} x CP {p.cp}, EP {p.ep}; {len(train)} train and {len(val)} val "
                f"examples, {cfg.data.batch_size} per step"
            )
        self.actor = Actor(cfg.actor, cfg.model, cfg.parallel, self.model_path, record_routes=False)
        self.memory = PeakMemory()
        self.memory.reset()
        self.stop = StopFlag()
        self.step_index = 0
        resumed = self._resume()
        self.logger = RunLogger(
            run_dir,
            cfg,
            enabled=self.rank == 0,
            wandb_id=(resumed or {}).get("wandb_run_id"),
            resumed_step=self.step_index if resumed else None,
        )
        self.engine = self.weight_sync = self.generation = None
        if val_prompts:
            self._start_generation(val_prompts, reward_fn)
        elif generate and self.rank == 0:
            say("[moe-rl] validation: val/loss only (task=file has no reward: set data.reward to score generations)")

    def _examples(self) -> tuple[list[Example], list[Example]]:
        d, seed = self.cfg.data, self.cfg.trainer.seed
        if d.task == "arithmetic":
            train = task_examples(d.arithmetic, "train", d.problems, seed, self.tokenizer)
            return train, task_examples(d.arithmetic, "val", d.val_problems, seed, self.tokenizer)
        keys = (d.prompt_key, d.response_key, d.messages_key, self.tokenizer)
        return read_examples(d.path, *keys), read_examples(d.val_path, *keys) if d.val_path else []

    def _val_prompts(self, context: int) -> tuple[list, Callable]:
        """The validation prompts of generation (every rank the same list) and the reward that scores them; a row
        without an answer the reward needs, or too long for the context with val.max_tokens, is an error naming it."""
        cfg, d = self.cfg, self.cfg.data
        reward_fn = load_reward(d.reward_spec)
        needs = f"data.reward={d.reward_spec}" if getattr(reward_fn, "needs_answer", False) else None
        prompts = PromptSource(
            d.task,
            d.val_path,
            d.prompt_key,
            d.answer_key,
            cfg.trainer.seed,
            messages_key=d.messages_key,
            tokenizer=self.tokenizer,
            context_limit=context - cfg.val.max_tokens,
            answers_for=needs,
            problems=(d.arithmetic, "val", d.val_problems),
        ).items
        return prompts, reward_fn

    def _start_generation(self, prompts: list, reward_fn: Callable) -> None:
        """Validation by generation (val.*): one engine (on rank 0) that gets the actor's weights before each
        validation, and RL's Validator over `prompts`."""
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        cfg = self.cfg
        groups = engine_groups(1, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
        if groups.is_leader:
            lay = self.actor.layout
            engine_cfg = RolloutConfig(
                model=self.model_path, dtype=cfg.model.dtype, capture="none", seed=cfg.trainer.seed
            )
            self.engine = RolloutEngine(engine_cfg, lay.moe_layers, lay.num_experts, lay.topk)
        self.weight_sync = WeightSync(self.actor, self.engine, groups.leaders, bucket_mb=64)
        sampling = SamplingConfig(max_tokens=cfg.val.max_tokens)
        args = (self.tokenizer, reward_fn, cfg.val, sampling, self._engine_may_stop)
        self.generation = Validator(prompts, groups, self.engine, *args)
        if self.rank == 0:
            what = f"{len(prompts)} prompts, {cfg.data.reward_spec}, one engine"
            say(f"[moe-rl] validation: val/loss and generation ({what})")

    def _engine_may_stop(self):
        """StopFlag.engine_may_stop, warning at the current step."""
        return self.stop.engine_may_stop(lambda message: self.logger.warn(self.step_index, message))

    def _resume(self) -> dict | None:
        if self.resume_path is None:
            return None
        state = checkpoint.load(self.resume_path, self.actor.chunks, self.actor.optimizer)
        self.step_index = state["step"]
        self.batches.skip(state["data_position"])
        if self.rank == 0:
            say(f"[moe-rl] resumed from {self.resume_path} at step {self.step_index}")
        return state

    def _padded(self, examples: list[Example]):
        # expert-parallel ranks dispatch tokens together: one sequence length over the ranks, as the RL source pads
        (length,) = world_max(max(len(e.ids) for e in examples))
        return pad(examples, self.tokenizer.pad_token_id or 0, self.cfg.parallel.seq_multiple, length)

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        progress.begin_step(self.step_index + 1)
        self.memory.reset()
        padded = self._padded(self.batches.next())
        metrics = self.actor.supervised_step(padded)
        self.step_index += 1
        seconds = time.perf_counter() - start
        metrics |= {"time/step": seconds, "perf/tokens_per_s": metrics.pop("perf/tokens") / seconds}
        metrics |= self.memory.read()
        if self.val and self.cfg.trainer.val_every and self._due(self.cfg.trainer.val_every):
            metrics |= self.validate()
        self.logger.log(self.step_index, metrics)
        return metrics

    def _due(self, every: int) -> bool:
        return self.step_index % every == 0 or self.step_index == self.cfg.trainer.steps

    def validate(self) -> dict[str, float]:
        """val/loss, and with validation by generation the val/* scores of the step's weights (collective)."""
        if self._val_batch is None:  # the same examples every time: padded once
            self._val_batch = self._padded(self.val)
        out = {"val/loss": self.actor.nll(self._val_batch)}
        if self.generation is not None:
            if self.step_index > 0:  # the engine started with the weights of step 0
                with self._engine_may_stop():
                    self.weight_sync()
            out |= self.generation(self.step_index)
        return out

    def save_checkpoint(self) -> Path:
        state = {
            "data_position": self.batches.position,
            "wandb_run_id": self.logger.run_id,
            "model_path": self.model_path,
            "world_size": dist.get_world_size(),
        }
        a = self.actor
        path = checkpoint.save(
            self.checkpoint_dir, self.step_index, a.chunks, a.optimizer, state, self.cfg.trainer.checkpoint_keep
        )
        if self.rank == 0:
            say(f"[moe-rl] checkpoint step {self.step_index} -> {path}")
        return path

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.logger.close()


def sft(cfg: SFTConfig, run_dir: str | Path) -> list[dict[str, float]]:
    """Run SFT steps up to `trainer.steps` (counting resumed ones); returns this run's per-step metrics (rank 0
    also writes them). Checkpoints every `trainer.checkpoint_every` steps, at the end and on SIGTERM; then the HF
    folder <run dir>/hf (trainer.export_hf)."""
    stop_with_launcher()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = SFTTrainer(cfg, run_dir)
    start_up_done()
    t = cfg.trainer
    history = []
    try:
        with watching(t.hang_timeout_s, trainer.engine, run_dir):
            if trainer.val and t.val_every and t.val_before_train and trainer.step_index == 0:
                trainer.logger.log(0, trainer.validate())
            while trainer.step_index < t.steps:
                history.append(trainer.step())
                if trainer.stop.agreed():
                    if t.saves_checkpoints:
                        trainer.save_checkpoint()
                    trainer.logger.warn(trainer.step_index, checkpoint.signal_stop_warning(t.no_checkpoint_because))
                    return history
                if checkpoint.save_due(trainer.step_index, t.steps, t.checkpoint_every):
                    trainer.save_checkpoint()
        if t.export_hf:
            a = trainer.actor
            out = write_hf_folder(
                a.chunks,
                a.conv,
                trainer.model_path,
                run_dir / "hf",
                provenance={"sft_step": trainer.step_index, "source_model": trainer.model_path},
            )
            if trainer.rank == 0:
                say(f"[moe-rl] HF folder of step {trainer.step_index}: {out}")
    finally:
        trainer.close()
    return history
