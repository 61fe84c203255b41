"""Structured training config: the schema Hydra validates `conf/` against before heavy work.

Each component keeps its own dataclass (ParallelConfig in actor.parallel, RolloutConfig and
SamplingConfig in rollout.engine); this module composes them, registers the schema with
Hydra's ConfigStore and checks cross-field consistency in `validate`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from moe_rl.actor.parallel import ParallelConfig
from moe_rl.objectives.aggregation import AGG_MODES
from moe_rl.rollout.engine import RolloutConfig, SamplingConfig


@dataclass
class ModelConfig:
    path: str = ""
    """HF model folder. Empty: build the tiny model below into the run directory."""
    tiny_arch: str = "qwen3_moe"
    """Architecture of the built-in tiny model (qwen3_moe | mixtral | olmoe)."""
    dtype: str = "float32"
    """Actor dtype: float32 | bfloat16."""
    recompute: str | None = None
    """Activation recompute: null | full | selective."""


@dataclass
class AlgorithmConfig:
    policy_loss: str = "gspo"
    """Registered policy loss (moe_rl.objectives.POLICY_LOSSES): gspo | ppo."""
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    loss_agg: str = "seq-mean-token-mean"
    correction: str = "icepop"
    """Registered mismatch correction: none | icepop | tis | seq-tis | seq-mask | geo-mask."""
    correction_low: float = 0.5
    """Lower band (icepop, seq-mask, geo-mask)."""
    correction_high: float = 5.0
    """Upper band (icepop, seq-mask, geo-mask)."""
    correction_cap: float = 2.0
    """Cap (tis, seq-tis)."""
    advantage: str = "grpo"
    """Registered advantage estimator: grpo | drgrpo | rloo | reinforce."""


@dataclass
class ActorConfig:
    router_replay: str = "r3"
    """r3 (replay the rollout engine's routes) | r2 (replay the actor's own old-pass routes) | off."""
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""
    mini_batches: int = 2
    """Optimizer steps per rollout batch (pi_theta drifts from pi_old after the first); >= 1."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass; >= 1."""


@dataclass
class DataConfig:
    task: str = "toy"
    """toy (built in, learnable by a tiny random model) | file."""
    path: str = ""
    """jsonl or parquet file of prompts (task=file)."""
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward: str = "moe_rl.data.rewards:toy_low_token_reward"
    """Reward plugin `module:function(responses, answers, response_ids) -> list[float]`."""
    prompts_per_step: int = 8
    """Prompts per step on each data-parallel rank (samples = prompts * rollout.n)."""
    overlong_prompts: str = "error"
    """A prompt whose tokens + sampling.max_tokens exceed the engine's context: error (name its line)
    | drop (drop such rows at start and print how many)."""


@dataclass
class TrainerConfig:
    steps: int = 30
    seed: int = 1234
    first_minibatch_tolerance: float = 1e-4
    """Warn when |mean(log pi_theta - log pi_old)| on the first mini-batch exceeds this."""
    mode: str = "train"
    """train | rollout_only (rollout + old log-probs + a dump each step, no update) | from_dump
    (train on the dumps in dump_dir, cycling through its steps; no engine)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (also at the last step and on SIGTERM); 0 = only those."""
    checkpoint_dir: str = ""
    """Empty: <run dir>/checkpoints."""
    checkpoint_keep: int = 3
    """Keep the newest N checkpoints, delete older ones; 0 = keep all."""
    resume: str = "auto"
    """auto (newest checkpoint in checkpoint_dir, else a fresh start) | auto_skip_damaged (as auto, but a
    checkpoint that fails its manifest check is skipped for the newest older one that passes, with a
    warning) | off | path to a step_* folder. Checkpoints are verified before any other work."""
    dump_every: int = 0
    """Write a rollout dump (for moe-rl-diagnose offline / from_dump) every N steps; 0 = never."""
    dump_dir: str = ""
    """Empty: <run dir>/dumps. from_dump reads it."""
    max_skipped_steps: int = 3
    """An optimizer step with a non-finite loss or gradient is skipped on every rank (counted in
    actor/skipped_steps); this many consecutive skips stop the run with an error (>= 1)."""


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"
    """online | offline | disabled."""
    wandb_project: str = "moe-rl"
    router_agreement_every: int = 1
    """Log router/agreement (trainer's live routing vs the engine's routes) every N steps; 0 = never.
    Costs one extra forward under R3 (R2 records live routes anyway)."""


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(dtype="float32"))
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need no model, run before anything is built: one clear error naming the key."""
    from moe_rl.data.prompts import OVERLONG_POLICIES
    from moe_rl.data.rewards import load_reward
    from moe_rl.objectives import ADVANTAGES, CORRECTIONS, POLICY_LOSSES

    def bad(key: str, msg: str):
        raise ValueError(f"config {key}: {msg}")

    if cfg.algorithm.policy_loss not in POLICY_LOSSES:
        bad("algorithm.policy_loss", f"{cfg.algorithm.policy_loss!r} is not one of {POLICY_LOSSES.names()}")
    if cfg.algorithm.correction not in CORRECTIONS:
        bad("algorithm.correction", f"{cfg.algorithm.correction!r} is not one of {CORRECTIONS.names()}")
    if cfg.algorithm.advantage not in ADVANTAGES:
        bad("algorithm.advantage", f"{cfg.algorithm.advantage!r} is not one of {ADVANTAGES.names()}")
    if cfg.algorithm.loss_agg not in AGG_MODES:
        bad("algorithm.loss_agg", f"{cfg.algorithm.loss_agg!r} is not one of {AGG_MODES}")
    if cfg.actor.router_replay not in ("r3", "r2", "off"):
        bad("actor.router_replay", f"{cfg.actor.router_replay!r}: choose r3, r2 or off")
    if cfg.actor.router_replay == "r3" and cfg.rollout.capture == "none":
        bad("actor.router_replay", "r3 replays the rollout engine's routes, but rollout.capture=none")
    if cfg.model.dtype not in ("float32", "bfloat16"):
        bad("model.dtype", f"{cfg.model.dtype!r}: choose float32 or bfloat16")
    if cfg.logging.wandb_mode not in ("online", "offline", "disabled"):
        bad("logging.wandb_mode", f"{cfg.logging.wandb_mode!r}: choose online, offline or disabled")
    t = cfg.trainer
    if t.mode not in ("train", "rollout_only", "from_dump"):
        bad("trainer.mode", f"{t.mode!r}: choose train, rollout_only or from_dump")
    if t.mode == "from_dump" and not t.dump_dir:
        bad("trainer.dump_dir", "mode=from_dump needs the folder of an earlier run's dumps")
    if t.mode == "from_dump" and t.dump_every:
        bad("trainer.dump_every", "mode=from_dump reads dumps; it cannot also write them")
    for key in ("steps", "checkpoint_every", "checkpoint_keep", "dump_every"):
        if getattr(t, key) < 0:
            bad(f"trainer.{key}", "must be >= 0")
    if cfg.data.task not in ("toy", "file"):
        bad("data.task", f"{cfg.data.task!r}: choose toy or file")
    if cfg.data.task == "file" and not cfg.data.path:
        bad("data.path", "task=file needs a jsonl or parquet path")
    if cfg.data.task == "file" and not os.path.isfile(cfg.data.path):
        bad("data.path", f"{cfg.data.path!r} does not exist (or is not a file)")
    if cfg.data.overlong_prompts not in OVERLONG_POLICIES:
        bad("data.overlong_prompts", f"{cfg.data.overlong_prompts!r}: choose one of {OVERLONG_POLICIES}")
    try:
        load_reward(cfg.data.reward)
    except ValueError as e:
        bad("data.reward", str(e))
    if cfg.data.prompts_per_step < 1:
        bad("data.prompts_per_step", "must be >= 1")
    if cfg.sampling.n < 1:
        bad("sampling.n", "must be >= 1")
    if cfg.sampling.n < 2 and ADVANTAGES.meta(cfg.algorithm.advantage).get("needs_groups"):
        bad(
            "sampling.n",
            f"{cfg.sampling.n}: algorithm.advantage={cfg.algorithm.advantage} compares samples within a "
            "group of the same prompt, so every advantage would be 0; use sampling.n >= 2 (or advantage=reinforce)",
        )
    if t.mode != "from_dump" and not cfg.sampling.temperature > 0:
        bad(
            "sampling.temperature",
            f"{cfg.sampling.temperature}: training needs sampling (> 0); greedy decoding gives identical "
            "samples (zero advantages) and no behaviour log-probabilities for the importance ratio",
        )
    if cfg.sampling.max_tokens < 1:
        bad("sampling.max_tokens", f"{cfg.sampling.max_tokens}: must be >= 1 (tokens generated per sample)")
    if cfg.actor.micro_batch_size < 1:
        bad("actor.micro_batch_size", f"{cfg.actor.micro_batch_size}: must be >= 1 (samples per forward)")
    if cfg.actor.mini_batches < 1:
        bad("actor.mini_batches", f"{cfg.actor.mini_batches}: must be >= 1")
    if t.max_skipped_steps < 1:
        bad("trainer.max_skipped_steps", f"{t.max_skipped_steps}: must be >= 1 (1 = stop at the first skip)")
    samples = cfg.sampling.n * cfg.data.prompts_per_step
    if samples % cfg.actor.mini_batches:
        bad("actor.mini_batches", f"{cfg.actor.mini_batches} does not divide the {samples} samples per step")
    try:
        cfg.parallel.data_parallel_size(world_size)
    except ValueError as e:
        bad("parallel", str(e))
    if cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp > 1 and cfg.rollout.topology == "per_rank":
        bad(
            "parallel",
            "tp/pp/cp > 1 with rollout.topology=per_rank is not supported yet (each model-parallel "
            "group would need one shared rollout)",
        )


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_moe_schema", node=TrainConfig)
