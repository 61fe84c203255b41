"""Supervised fine-tuning on the RL trainer's actor (launch/sft_moe.py): the same megatron-core model under any
parallel layout, packing, recompute, fused log-probs and optimizer; checkpoints with resume and SIGTERM;
metrics.jsonl, wandb and one console line per step; at the end an HF folder that RL starts from.

A step: the next `data.batch_size` examples (the same global batch whatever the data-parallel size), each rank its
share, one optimizer step of next-token cross-entropy on the response tokens, the token mean over the batch
(objectives/sft.py). Every `trainer.val_every` steps and at the end: val/loss over the validation examples.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch.distributed as dist

from moe_rl.actor import lora
from moe_rl.actor.actor import Actor
from moe_rl.actor.hf_export import write_hf_folder
from moe_rl.actor.lr_schedule import LRSchedule
from moe_rl.common import progress
from moe_rl.common.distributed import world_max
from moe_rl.common.gc_startup import start_up_done
from moe_rl.common.machine import settings_line
from moe_rl.common.platform import this_machine
from moe_rl.config import SFTConfig
from moe_rl.config.validate import validate_sft
from moe_rl.data.prompts import ChatSettings, DataError, PromptSource
from moe_rl.data.sft import (
    Batches,
    Example,
    check_lengths,
    pad,
    read_examples,
    read_sft,
    reasoning_gym_examples,
    task_examples,
)
from moe_rl.reward import RewardSet
from moe_rl.rollout.config import RolloutConfig, SamplingConfig
from moe_rl.rollout.engine import RolloutEngine
from moe_rl.rollout.engine_groups import engine_groups
from moe_rl.trainer.logger import say
from moe_rl.trainer.metrics import PeakMemory
from moe_rl.trainer.run import Checkpoints, StartUp, data_parallel, run_steps, start_up
from moe_rl.trainer.signals import StopFlag, stop_with_launcher
from moe_rl.trainer.validation import Validator
from moe_rl.weight_sync import WeightSync


class SFTTrainer:
    """Supervised fine-tuning's parts (the actor, the examples, validation) and its step; the skeleton around them is
    trainer/run.py's."""

    def __init__(self, cfg: SFTConfig, start: StartUp):
        # heavy: transformers, imported on first use
        from transformers import AutoTokenizer

        self.cfg, self.start, self.run_dir, self.rank = cfg, start, start.run_dir, start.rank
        t, self.model_path, hf_config = cfg.trainer, start.model_path, start.hf_config
        # the data before the model: a bad row fails in seconds
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        limit = cfg.data.max_length or hf_config.max_position_embeddings
        limit_name = "data.max_length" if cfg.data.max_length else "the model's context (max_position_embeddings)"
        train, val = self._examples()
        for examples in (train, val):
            check_lengths(examples, limit, limit_name)
        generate = bool(val and t.val_every and cfg.val.generate)
        val_prompts, self.rewards = [], None
        if generate and cfg.data.reward_spec:
            val_prompts, self.rewards = self._val_prompts(hf_config.max_position_embeddings)
        dp_rank, dp = data_parallel()
        self.batches = Batches(train, cfg.data.batch_size, t.seed, dp_rank, dp)
        if 0 < len(val) < dp:
            raise DataError(f"{len(val)} validation examples cannot be shared by {dp} data-parallel ranks")
        self.val = val[dp_rank::dp]  # each rank scores its share; val/loss sums over the ranks
        self._val_batch = None
        if self.rank == 0:
            self._announce(len(train), len(val), dp)
        self.actor = Actor(cfg.actor, cfg.model, cfg.parallel, self.model_path, record_routes=False)
        if self.actor.lora and self.rank == 0:
            say(f"[moe-rl] {lora.describe(self.actor.chunks, self.actor.lora)}")
        self.schedule = LRSchedule(self.actor.optimizer, cfg.actor, t.steps, cfg.actor.weight_decay)
        self.memory = PeakMemory()
        self.memory.reset()
        self.step_index = start.step
        self.checkpoints = Checkpoints(start, t.checkpoint_keep, self.actor)
        self.logger = start.logger(cfg)
        start.say_resumed()
        self.stop = StopFlag()
        self.may_stop = functools.partial(self.stop.engine_may_stop, self.logger.warn_now)
        self.engine = self.weight_sync = self.generation = None
        if val_prompts:
            self._start_generation(val_prompts, self.rewards)
        elif generate and self.rank == 0:
            say("[moe-rl] validation: val/loss only (task=file has no reward: set data.reward to score generations)")
        if start.resumed:
            self.batches.skip(self.checkpoints.restore()["data_position"])

    def _announce(self, train: int, val: int, dp: int) -> None:
        """The run's header: where it writes, the model, the layout, the examples."""
        cfg, t, p = self.cfg, self.cfg.trainer, self.cfg.parallel
        checkpoints = "checkpoints/, " if t.saves_checkpoints else ""
        hf = "hf/ at the end" if t.export_hf else "no hf/ (trainer.export_hf=false)"
        say(f"[moe-rl] SFT run {self.run_dir}: metrics.jsonl, {checkpoints}{hf}")
        say(
            f"[moe-rl] model {self.model_path} ({self.start.hf_config.model_type}); layout world "
            f"{dist.get_world_size()} = DP {dp} x TP {p.tp} x PP {p.pp} x CP {p.cp}, EP {p.ep}; {train} train and "
            f"{val} val examples, {cfg.data.batch_size} per step"
        )
        say(f"[moe-rl] {settings_line(cfg, this_machine())}")

    def _examples(self) -> tuple[list[Example], list[Example]]:
        d, seed = self.cfg.data, self.cfg.trainer.seed
        if d.task == "arithmetic":
            train = task_examples(d.arithmetic, "train", d.problems, seed, self.tokenizer)
            return train, task_examples(d.arithmetic, "val", d.val_problems, seed, self.tokenizer)
        if d.task == "reasoning_gym":
            return tuple(reasoning_gym_examples(d.reasoning_gym, s, self.tokenizer) for s in ("train", "val"))
        keys = (d.prompt_key, d.response_key, d.messages_key, self.tokenizer)
        how = {"format": d.format, "chat": ChatSettings.of(d)}
        train, read_by = read_sft(d.path, *keys, split=d.split, **how)
        if self.rank == 0:
            say(read_by.describe(str(d.path)))
        return train, read_examples(d.val_path, *keys, split=d.val_split, **how) if d.val_path else []

    def _val_prompts(self, context: int) -> tuple[list, RewardSet]:
        """The validation prompts of generation (every rank the same list) and the reward that scores them; a row
        without an answer the reward needs, or too long for the context with val.max_tokens, is an error naming it."""
        cfg, d = self.cfg, self.cfg.data
        rewards = RewardSet.from_config(d)  # worker processes start at the first score
        prompts = PromptSource(
            d.task,
            d.val_path,
            d.prompt_key,
            d.answer_key,
            cfg.trainer.seed,
            messages_key=d.messages_key,
            tokenizer=self.tokenizer,
            context_limit=context - cfg.val.max_tokens,
            answers_for=rewards.needs_answer,
            problems=(d.reasoning_gym, "val", 0)
            if d.task == "reasoning_gym"
            else (d.arithmetic, "val", d.val_problems),
            format=d.format,
            split=d.val_split,
            chat=ChatSettings.of(d),
        ).items
        rewards.check_prompts(prompts, f"validation {d.val_path or 'the arithmetic val split'}")
        return prompts, rewards

    def _start_generation(self, prompts: list, rewards: RewardSet) -> None:
        """Validation by generation (val.*): one engine (on rank 0) that gets the actor's weights before each
        validation, and RL's Validator over `prompts`."""
        cfg = self.cfg
        groups = engine_groups(1, *data_parallel())
        if groups.is_leader:
            lay = self.actor.layout
            engine_cfg = RolloutConfig(
                model=self.model_path, dtype=cfg.model.dtype, capture="none", seed=cfg.trainer.seed
            )
            self.engine = RolloutEngine(engine_cfg, lay.moe_layers, lay.num_experts, lay.topk)
        self.weight_sync = WeightSync(self.actor, self.engine, groups.leaders, bucket_mb=64)
        sampling = SamplingConfig(max_tokens=cfg.val.max_tokens)
        args = (self.tokenizer, rewards, cfg.val, sampling, self.may_stop)
        self.generation = Validator(prompts, groups, self.engine, *args)
        if self.rank == 0:
            what = f"{len(prompts)} prompts, {cfg.data.reward_spec}, one engine"
            say(f"[moe-rl] validation: val/loss and generation ({what})")

    def _padded(self, examples: list[Example]):
        # expert-parallel ranks dispatch tokens together: one sequence length over the ranks, as the RL source pads
        (length,) = world_max(max(len(e.ids) for e in examples))
        return pad(examples, self.tokenizer.pad_token_id or 0, self.cfg.parallel.seq_multiple, length)

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        progress.begin_step(self.step_index + 1)
        self.memory.reset()
        padded = self._padded(self.batches.next())
        lr = self.schedule.at(self.step_index + 1)  # actor.lr_* of this step
        metrics = self.actor.supervised_step(padded) | {"actor/lr": lr}
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
                with self.may_stop():
                    self.weight_sync()
            out |= self.generation(self.step_index)
        return out

    def initial_validation(self) -> dict[str, float]:
        return self.validate() if self.val and self.cfg.trainer.val_every else {}

    def save_checkpoint(self) -> Path:
        state = {"data_position": self.batches.position, "wandb_run_id": self.logger.run_id}
        state["lr_schedules"] = {"actor/lr": self.schedule.state_dict()}
        return self.checkpoints.save(self.step_index, state)

    def finish(self) -> None:
        """The HF folder of the last step (trainer.export_hf)."""
        if not self.cfg.trainer.export_hf:
            return
        a = self.actor
        provenance = {"sft_step": self.step_index, "source_model": self.model_path}
        out = write_hf_folder(a.chunks, a.conv, self.model_path, self.run_dir / "hf", provenance=provenance)
        if self.rank == 0:
            say(f"[moe-rl] HF folder of step {self.step_index}: {out}")

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.engine.shutdown()
            self.logger.close()
        finally:
            if self.rewards is not None:
                self.rewards.close()  # the reward worker processes


def sft(cfg: SFTConfig, run_dir: str | Path) -> list[dict[str, float]]:
    """Run SFT steps up to `trainer.steps` (counting resumed ones); returns this run's per-step metrics (rank 0
    also writes them). Checkpoints every `trainer.checkpoint_every` steps, at the end and on SIGTERM; then the HF
    folder <run dir>/hf (trainer.export_hf)."""
    stop_with_launcher()
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = SFTTrainer(cfg, start_up(cfg, run_dir, validate_sft))
    start_up_done()
    return run_steps(trainer, cfg.trainer)
