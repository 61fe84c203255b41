"""Run logging: one console line per step, metrics.jsonl in the run directory, wandb.

On a terminal a progress bar with ETA stays below the step lines; to a file (Slurm logs,
`> out.log`) each step is one plain line that never wraps."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path

from moe_rl.common import progress
from moe_rl.common.machine import settings_line
from moe_rl.routing.model_layout import moe_layout


def say(line: str) -> None:
    """A line of moe-rl's own for the console and, as an INFO record, for the run's train_moe.log (Hydra's file
    handler; its console handler shows WARNING and above only, so the line appears once)."""
    print(line, flush=True)
    logging.getLogger("moe_rl").info(line)


# vLLM warnings about settings moe-rl makes on purpose for its CPU engines (eager mode, no Triton CPU backend, no
# tcmalloc/iomp preload): on the console they read as problems, repeated for every engine. They stay in train_moe.log.
CPU_ENGINE_NOTES = (
    "Triton is installed, but doesn't include CPU backend",
    "Triton is not installed. triton-cpu is expected",
    "Model Runner V2 requires Triton",
    "Enforce eager set, disabling torch.compile",
    "Inductor compilation was disabled by user settings",
    "libtcmalloc is not found in LD_PRELOAD",
    "libiomp is not found in LD_PRELOAD",
    "Reset SSM cache type to float32",
)
# The libraries' Python warnings (routed to logging as "py.warnings" by the launchers) that a CPU run always raises and
# that ask nothing of the user there: Transformer Engine and Apex are GPU packages, and the rest are deprecations inside
# megatron-core and vLLM. On a GPU every one of them is shown (a missing Transformer Engine matters there).
CPU_LIBRARY_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed. Falling back to Torch Norm",
    "full scope is deprecated. Use empty cuda_graph_scope",
    "`torch.distributed.reduce_op` is deprecated",
)
# Deprecations that megatron-core's checkpoint loading raises inside megatron and torch on every resume, GPU or CPU (8
# lines on the default run's console): (where the warning is raised, what it says). Only these places are matched, so
# the same deprecation raised from a user's own code still shows.
LIBRARY_DEPRECATIONS = (
    ("megatron/core/dist_checkpointing/", "`load_state_dict` is deprecated"),
    ("torch/distributed/checkpoint/", "we are deprecating ShardedTensor"),
)
# vLLM's loader warns once per weight when it narrows a weight to the engine's dtype: at the engine's load of a
# float32 checkpoint and at every weight sync from a float32 actor under rollout.dtype=bfloat16 (54 lines a step on
# the tiny model's two engines, thousands on a real MoE). That cast is what rollout.dtype asks for; the run header
# says it once (`cast from ...`), and the per-weight lines stay in train_moe.log.
CAST_ON_LOAD = "Attempted to load weight %s with dtype %s into parameter with dtype %s"
NARROWING = ({"torch.float32", "torch.float64"}, {"torch.bfloat16", "torch.float16"})  # (from, to)


class QuietCpuEngineNotes(logging.Filter):
    """Console filter (conf/train_moe.yaml, hydra.job_logging): drops vLLM's CPU_ENGINE_NOTES and its per-weight
    notes of a float32 -> 16-bit cast on load (CAST_ON_LOAD), the LIBRARY_DEPRECATIONS, and without CUDA the
    CPU_LIBRARY_WARNINGS; every other record, vLLM's other warnings (another dtype pair included), passes. The file
    keeps them all."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":
            # heavy: torch (hydra builds this filter before anything imports it; a warning comes after)
            import torch

            message = record.getMessage()
            if any(where in message and what in message for where, what in LIBRARY_DEPRECATIONS):
                return False
            return torch.cuda.is_available() or not any(w in message for w in CPU_LIBRARY_WARNINGS)
        if not record.name.startswith("vllm"):
            return True
        if record.msg == CAST_ON_LOAD and isinstance(record.args, tuple) and len(record.args) == 3:
            wide, narrow = NARROWING
            return not (str(record.args[1]) in wide and str(record.args[2]) in narrow)
        message = record.getMessage()
        return not any(note in message for note in CPU_ENGINE_NOTES)


def step_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One line per step; a quantity the step did not produce (no update under trainer.mode=rollout_only) is left
    out rather than shown as nan."""
    times = " ".join(f"{k[5:]}={v:.1f}s" for k, v in metrics.items() if k.startswith("time/"))
    shown = (
        ("loss", "sft/loss", ".4f"),
        ("reward", "reward/mean", ".3f"),
        ("len", "response/length_mean", ".1f"),
        ("turns", "multi_turn/turns_mean", ".2f"),
        # k3, E_mu[r - 1 - log r] with r = pi_old/mu: an estimate of KL(mu||pi_old) that is never negative, where
        # mismatch/kl (k1, the mean log ratio) is float noise of either sign when the two policies are equal
        ("kl(mu||pi_old)", "mismatch/k3_kl", ".2e"),
        ("clipfrac", "actor/clipfrac", ".3f"),
        ("gnorm", "actor/grad_norm", ".3f"),
    )
    fields = " ".join(f"{name} {metrics[key]:{fmt}}" for name, key, fmt in shown if key in metrics)
    rss = f" rss {metrics['memory/peak_rss_gib']:.2f}G" if "memory/peak_rss_gib" in metrics else ""
    return f"step {step}/{total} {fields}{rss} | {times}"


def val_line(step: int, metrics: dict[str, float]) -> str:
    """The console line of a validation: SFT's val/loss and the scores of generation, whichever the record has."""
    parts = [f"loss {metrics['val/loss']:.4f}"] if "val/loss" in metrics else []
    if "val/reward_mean" in metrics:
        parts.append(
            f"reward {metrics['val/reward_mean']:.3f} pass@k {metrics['val/pass@k']:.3f} "
            f"pass@1 {metrics['val/pass@1']:.3f} len {metrics['val/length_mean']:.1f} "
            f"({metrics['val/prompts']:.0f} prompts)"
        )
    return f"validation at step {step}: {' '.join(parts)}"


def run_header(cfg, run_dir: Path, model_path: str, hf_config, world: int) -> list[str]:
    """What this run is, said before the engines start: where it writes, the model, the layout, the objective."""
    # torch (moe_rl.objectives, the platform probe): not loaded by importing this module
    from moe_rl.common.platform import this_machine
    from moe_rl.objectives import CORRECTIONS, POLICY_LOSSES

    p, r, a = cfg.parallel, cfg.rollout, cfg.algorithm
    moe = moe_layout(hf_config)
    params = model_parameters(model_path)
    source = f"{model_path} ({hf_config.model_type})" if cfg.model.path else f"built-in tiny {cfg.model.tiny_arch}"
    dp = p.data_parallel_size(world)
    engines = f"{r.engines or dp} engine(s) of TP {r.tensor_parallel_size} in {r.dtype}" + cast_note(
        checkpoint_dtype(model_path), cfg.model.dtype, r.dtype
    )
    if cfg.trainer.mode == "from_dump":
        engines = f"no engine (samples from {cfg.trainer.dump_dir})"
    objective = f"{POLICY_LOSSES.name_of(a.loss)} + {CORRECTIONS.name_of(a.correction)}, advantage {a.advantage}"
    replay = cfg.actor.router_replay
    stages = ""
    if p.first_stage_layers or p.last_stage_layers:  # megatron's uneven stages
        stages = f" (stages of {'/'.join(map(str, p.stage_layers(moe.num_layers)))} layers)"
    checkpoints = "checkpoints/, " if cfg.trainer.saves_checkpoints else ""
    return [
        f"run {run_dir}: metrics.jsonl, {checkpoints}train_moe.log (these lines and every library's log)",
        f"model {source}, {params / 1e6:,.1f}M parameters, {moe.num_layers} layers "
        f"({len(moe.moe_layers)} MoE), {moe.num_experts} experts, top-{moe.topk}, {cfg.model.dtype}",
        f"layout: world {world} = DP {dp} x TP {p.tp} x PP {p.pp}{stages} x CP {p.cp}, EP {p.ep}, ETP {p.etp}; "
        f"{engines}",
        f"{cfg.trainer.mode}: {cfg.trainer.steps} step{'' if cfg.trainer.steps == 1 else 's'} x "
        f"{cfg.data.prompts_per_step} prompts x {cfg.sampling.n} "
        f"samples per DP rank; {objective}; router replay {replay}"
        + (f"; up to {cfg.trainer.max_staleness} version(s) off-policy" if cfg.trainer.max_staleness else ""),
        settings_line(cfg, this_machine()),
    ]


def cast_note(checkpoint: str | None, actor: str, engine: str) -> str:
    """What the engines narrow on load (the checkpoint) and at each weight sync (the actor's weights), if anything:
    the console leaves out vLLM's per-weight warning of that cast (QuietCpuEngineNotes)."""
    bits = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16}
    wider = [
        f"the {dtype} {what}"
        for what, dtype in (("checkpoint", checkpoint), ("actor at each sync", actor))
        if dtype is not None and bits.get(dtype, 0) > bits.get(engine, 0)
    ]
    return f", cast from {' and '.join(wider)} (vLLM's note per weight: train_moe.log)" if wider else ""


def checkpoint_dtype(model_path: str) -> str | None:
    """The floating dtype that most parameters of an HF folder have (from the safetensors headers); None if none."""
    names = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    floating = [(n, names[d]) for d, n in parameter_counts(model_path).items() if d in names]
    return max(floating)[1] if floating else None


def model_parameters(model_path: str) -> int:
    """Parameters in an HF folder's safetensors files, from their headers (nothing is loaded)."""
    return sum(parameter_counts(model_path).values())


def parameter_counts(model_path: str) -> dict[str, int]:
    """Parameters per safetensors dtype ("F32", "BF16", ...) in an HF folder, from the files' headers."""
    # heavy: safetensors, imported on first use
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for f in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():  # noqa: SIM118
                piece = st.get_slice(key)
                counts[piece.get_dtype()] = counts.get(piece.get_dtype(), 0) + math.prod(piece.get_shape())
    return counts


def run_config(cfg) -> dict:
    """The config as wandb shows it, with the registered names of the loss and correction (their
    dataclasses alone do not say which was chosen)."""
    # torch (moe_rl.objectives): not loaded by importing this module
    from moe_rl.objectives import CORRECTIONS, POLICY_LOSSES

    out = dataclasses.asdict(cfg)
    alg = getattr(cfg, "algorithm", None)  # an SFT config has none
    if alg is not None:
        out["algorithm"]["loss"]["name"] = POLICY_LOSSES.name_of(alg.loss)
        out["algorithm"]["correction"]["name"] = CORRECTIONS.name_of(alg.correction)
    return out


class RunLogger:
    def __init__(
        self, run_dir: Path, cfg, enabled: bool = True, wandb_id: str | None = None, resumed_step: int | None = None
    ):
        """wandb_id: continue that wandb run (a resumed checkpoint's). resumed_step: the step of the checkpoint this
        run resumed; records of later steps in metrics.jsonl (logged before a crash, trained again now) move aside."""
        self.enabled = enabled
        self.run = None
        self.progress = None
        if not enabled:
            return
        self.total = cfg.trainer.steps
        self.path = Path(run_dir) / "metrics.jsonl"
        if resumed_step is not None:
            self._set_aside_steps_after(resumed_step)
        if sys.stdout.isatty():
            # heavy: rich, imported on first use
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
            )
            self.task = self.progress.add_task("steps", total=self.total)  # shown from the first step on:
            # before it, vLLM's start-up output (written past rich) would tear the bar
        w = cfg.logging.wandb
        if w.mode != "disabled":
            # heavy: wandb, imported on first use
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=w.project,
                entity=w.entity,
                name=w.name,
                group=w.group,
                tags=list(w.tags) or None,
                mode=w.mode,
                dir=str(run_dir),
                id=wandb_id,
                resume="allow" if wandb_id else None,
                config=run_config(cfg),
            )

    def _set_aside_steps_after(self, step: int) -> None:
        """A run that resumes the checkpoint of `step` trains the steps after it again: their earlier records (a
        crash between checkpoints) go to metrics.superseded.jsonl, so that metrics.jsonl holds each step once."""
        if not self.path.is_file():
            return
        records = [(json.loads(line)["step"], line) for line in self.path.read_text().splitlines()]
        later = [(s, line) for s, line in records if s > step]
        if not later:
            return
        aside = self.path.with_name("metrics.superseded.jsonl")
        with aside.open("a") as f:
            f.write("".join(line + "\n" for _, line in later))
        self.path.write_text("".join(line + "\n" for s, line in records if s <= step))
        steps = sorted({s for s, _ in later})
        which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        say(
            f"[moe-rl] {self.path}: the records of {which}, logged after the checkpoint of step {step} and trained "
            f"again now, moved to {aside.name}"
        )

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def _print(self, line: str) -> None:
        if self.progress is None:
            return say(line)
        self.progress.start()  # idempotent
        self.progress.console.print(line, highlight=False, soft_wrap=True)
        logging.getLogger("moe_rl").info(line)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        if "reward/mean" in metrics or "sft/loss" in metrics:  # a training step (a record may hold only validation)
            self._print(step_line(step, self.total, metrics))
        if "val/reward_mean" in metrics or "val/loss" in metrics:
            self._print(val_line(step, metrics))
        if self.progress is not None:
            self.progress.update(self.task, completed=step)

    def warn(self, step: int, message: str) -> None:
        if self.enabled:
            self._print(f"step {step} warning: {message}")

    def warn_now(self, message: str) -> None:
        """A warning at the step under way (common/progress.py)."""
        self.warn(progress.current_step(), message)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.run is not None:
            self.run.finish()
