"""The skeleton every trainer runs in (RL: trainer/loop.py, SFT: trainer/sft.py): start-up (checks, process groups,
the checkpoint to resume, the model), checkpoints of the state the parts declare, stop signals, the hang watchdog
and the loop of steps. A trainer brings its parts and its step; this module brings everything around them.

    start = start_up(cfg, run_dir, validate)      # before any part is built
    trainer = SomeTrainer(cfg, start)             # builds its parts, each from its own config section
    history = run_steps(trainer, cfg.trainer)     # the loop, saves, signals, watchdog; then trainer.finish()
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from moe_rl.actor import lora
from moe_rl.actor.model import check_divisibility, get_converter, load_hf_config
from moe_rl.actor.parallel import init_distributed
from moe_rl.common import progress
from moe_rl.models.tiny import built_in_model
from moe_rl.rollout.source import StepAbandoned
from moe_rl.trainer import checkpoint
from moe_rl.trainer.checkpoint import CheckpointSaveError
from moe_rl.trainer.logger import RunLogger, say
from moe_rl.trainer.run_dir import check_same_run_dir
from moe_rl.trainer.signals import StopFlag
from moe_rl.trainer.watchdog import watching


class NothingToTrain(Exception):
    """The checkpoint resumed is already at trainer.steps."""


def data_parallel() -> tuple[int, int]:
    """This rank's (data-parallel rank, data-parallel size), after start_up."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


@dataclass
class StartUp:
    """What start-up settles before any part is built."""

    run_dir: Path
    rank: int
    checkpoint_dir: Path
    resume_path: Path | None  # the verified checkpoint to resume, None for a fresh run
    resumed: dict | None  # its trainer state (trainer.json)
    model_path: str  # model.path, or the built-in model's folder
    hf_config: Any

    @property
    def step(self) -> int:
        """Steps already trained (0 for a fresh run)."""
        return self.resumed["step"] if self.resumed else 0

    def say_resumed(self, notes: list[str] = ()) -> None:
        """Rank 0 says which checkpoint the run resumes, with `notes` on what changes there."""
        if self.resumed and self.rank == 0:
            say(f"[moe-rl] resumed from {self.resume_path} at step {self.step}")
            for note in notes:
                say(f"[moe-rl] WARNING: {note}")

    def logger(self, cfg) -> RunLogger:
        """The run's logger (rank 0 writes), continuing the resumed run's wandb run and metrics.jsonl."""
        resumed = self.resumed or {}
        step = self.step if self.resumed else None
        return RunLogger(
            self.run_dir, cfg, enabled=self.rank == 0, wandb_id=resumed.get("wandb_run_id"), resumed_step=step
        )


def start_up(cfg, run_dir: Path, validate: Callable[[Any, int], None], refuse_finished: bool = False) -> StartUp:
    """Check the config, start the process groups, choose (and verify) the checkpoint to resume, find the model:
    all before a part is built, so a bad setting or a damaged checkpoint fails in seconds. `refuse_finished`: a
    checkpoint already at trainer.steps raises NothingToTrain (a requeued job that had finished)."""
    validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before anything is built
    init_distributed(cfg.parallel, seed=cfg.trainer.seed)
    check_same_run_dir(run_dir)  # before any rank writes to its own
    rank, t = dist.get_rank(), cfg.trainer
    # A damaged checkpoint fails (or is skipped under auto_skip_damaged) before any other work.
    checkpoint_dir = Path(t.checkpoint_dir or run_dir / "checkpoints")
    resume_path = checkpoint.resume_point(checkpoint_dir, t.resume, rank)
    resumed = None
    if resume_path is not None:
        resumed = checkpoint.saved_state(resume_path)
        if refuse_finished and resumed.get("step", 0) >= t.steps:
            # said before a model, engine or wandb run
            raise NothingToTrain(
                f"nothing to train: the checkpoint is at step {resumed.get('step', 0)} and trainer.steps={t.steps} "
                f"({resume_path}; raise trainer.steps to go on)"
            )
    m = cfg.model
    model_path = m.path or built_in_model(run_dir, m.tiny_arch, m.tiny_size, t.seed)
    hf_config = load_hf_config(model_path)
    conv = get_converter(hf_config)
    check_divisibility(conv, cfg.parallel)  # before anything is built
    lora.check_model(conv, cfg.actor.lora)
    return StartUp(run_dir, rank, checkpoint_dir, resume_path, resumed, model_path, hf_config)


class CheckpointPart(Protocol):
    """State a part keeps in a checkpoint beside the actor, in its own folder of the step's checkpoint."""

    def save(self, folder: Path) -> None:
        """Write this rank's state under `folder` (every rank calls it)."""
        ...

    def load(self, folder: Path) -> None:
        """Restore this rank's state from `folder`."""
        ...


class Checkpoints:
    """Saves and restores the state the parts declare: the model's chunks and optimizer (megatron's distributed
    checkpoint, `model`: an object with `chunks`, `optimizer`, `weights_finite()`), every other part's folder
    (`parts`: name -> CheckpointPart) and the trainer's JSON state."""

    def __init__(self, start: StartUp, keep: int, model, parts: dict[str, CheckpointPart] | None = None):
        self.start, self.keep, self.model, self.parts = start, keep, model, parts or {}

    def restore(self) -> dict:
        """Load the resumed checkpoint into the model and the parts; its trainer state."""
        path, m = self.start.resume_path, self.model
        state = checkpoint.load(path, m.chunks, m.optimizer)  # a missing trainer.json is its error
        for name, part in self.parts.items():
            part.load(path / name)
        return state

    def save(self, step: int, state: dict) -> Path:
        """Checkpoint `step` with the trainer's `state` (plus the world and data-parallel sizes and the model path).
        Refuses non-finite weights; collective."""
        progress.mark("checkpoint")
        m = self.model
        if not m.weights_finite():
            raise checkpoint.CheckpointError(
                f"refusing to save step {step}: the actor's weights are not finite on some rank"
            )
        state = state | {"model_path": self.start.model_path}
        if getattr(m, "lora", None):  # the export rebuilds the adapters from it (the checkpoint holds them only)
            state |= {"lora": dataclasses.asdict(m.cfg.lora)}
        state |= {"world_size": dist.get_world_size(), "data_parallel_size": data_parallel()[1]}

        def extra(partial: Path) -> None:  # every rank: the parts beside the model
            for name, part in self.parts.items():
                part.save(partial / name)

        path = checkpoint.save(self.start.checkpoint_dir, step, m.chunks, m.optimizer, state, self.keep, extra)
        if self.start.rank == 0:
            say(f"[moe-rl] checkpoint step {step} -> {path}")
        return path


class Steps(Protocol):
    """What run_steps asks of a trainer."""

    step_index: int  # steps done
    run_dir: Path
    logger: RunLogger
    stop: StopFlag
    engine: Any  # this rank's rollout engine (watched by the hang watchdog), or None

    def initial_validation(self) -> dict[str, float]:
        """trainer.val_before_train's metrics (logged as step 0); {} for none."""
        ...

    def step(self) -> dict[str, float]: ...

    def save_checkpoint(self) -> Path: ...

    def finish(self) -> None:
        """After the last step (not after a stop signal): e.g. SFT's HF folder."""
        ...

    def close(self) -> None: ...


def run_steps(trainer: Steps, t, retry_failed_saves: bool = False) -> list[dict[str, float]]:
    """Steps up to `t.steps` (trainer.*), counting resumed ones; this run's per-step metrics. Checkpoints every
    `t.checkpoint_every` steps, at the end and on a stop signal (then returns without `finish`).
    `retry_failed_saves` (trainer.on_save_failure=retry): a failed save but the last step's warns and training goes
    on."""
    history = []
    try:
        with watching(t.hang_timeout_s, trainer.engine, trainer.run_dir):
            if t.val_before_train and trainer.step_index == 0 and (val := trainer.initial_validation()):
                trainer.logger.log(0, val)
            while trainer.step_index < t.steps:
                try:
                    history.append(trainer.step())
                except StepAbandoned as e:
                    trainer.logger.warn(trainer.step_index + 1, str(e))
                if trainer.stop.agreed():
                    if t.saves_checkpoints:
                        trainer.save_checkpoint()
                    trainer.logger.warn(trainer.step_index, checkpoint.signal_stop_warning(t.no_checkpoint_because))
                    return history
                if t.saves_checkpoints and checkpoint.save_due(trainer.step_index, t.steps, t.checkpoint_every):
                    _save_or_retry(trainer, t, retry_failed_saves)
            trainer.finish()
    finally:
        trainer.close()
    return history


def _save_or_retry(trainer: Steps, t, retry: bool) -> None:
    """A due save; with `retry` a failed one (not the last step's) warns and training goes on."""
    try:
        trainer.save_checkpoint()
    except CheckpointSaveError as e:  # raised on every rank alike: all go on, or all stop
        if not retry or trainer.step_index == t.steps:
            raise
        trainer.logger.warn(
            trainer.step_index,
            f"{e}. Training goes on (trainer.on_save_failure=retry): the next save is "
            f"at step {trainer.step_index + t.checkpoint_every}",
        )
