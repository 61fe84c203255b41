"""`rollout.*`, `sampling.*` and `buffer.priority`: the rollout engine's settings as data (moe_rl/rollout/engine.py,
placement.py and buffer.py use them; moe_rl.config composes them into the run's config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from moe_rl.common.errors import refuse
from moe_rl.rollout.multi_turn.config import MultiTurnConfig


class Placement(StrEnum):
    """Where an engine runs (rollout.placement)."""

    colocated = "colocated"
    separate = "separate"


PLACEMENTS = tuple(m.value for m in Placement)


class Priority(StrEnum):
    """How the replay buffer draws groups (buffer.priority)."""

    uniform = "uniform"
    recency = "recency"
    advantage = "advantage"
    rarity = "rarity"
    mixed = "mixed"


PRIORITIES = tuple(m.value for m in Priority)


@dataclass
class SamplingConfig:
    """Sampling for one rollout batch."""

    n: int = 8
    """Samples per prompt (the GRPO group size; >= 2 for group advantages)."""
    temperature: float = 1.0
    """> 0 for training: greedy decoding gives identical groups and no usable behaviour log-probs."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    max_tokens: int = 24
    """Tokens generated per sample (>= 1)."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (the response ends before them)."""
    seed: int | None = 0
    """Base seed; prompt i uses seed + i. None: unseeded."""

    def check(self) -> None:
        """This section's own rules."""
        if self.n < 1:
            refuse("sampling.n", "must be >= 1")
        if self.max_tokens < 1:
            refuse("sampling.max_tokens", f"{self.max_tokens}: must be >= 1 (tokens generated per sample)")


class Capture(StrEnum):
    """Route capture (rollout.capture)."""

    auto = "auto"  # native on CUDA, hook on CPU
    hook = "hook"  # the routers' capture hook in the engine's worker (CPU)
    native = "native"  # vLLM's routed_experts output (GPU)
    none = "none"  # no routes (then actor.router_replay cannot be r3)


class StartMethod(StrEnum):
    """How a CPU engine's processes start (rollout.cpu_start_method)."""

    fork = "fork"  # from the rank, which has imported torch and vLLM already
    spawn = "spawn"  # a fresh interpreter, vLLM-CPU's own choice


class WeightTransport(StrEnum):
    """The last hop of a weight-sync bucket into the engine (rollout.weight_transport; moe_rl/weight_sync.py)."""

    shm = "shm"  # a /dev/shm file the engine worker maps
    rpc = "rpc"  # a safetensors blob through collective_rpc
    cuda_ipc = "cuda_ipc"  # GPU: the bucket stays on the leader's device, mapped by CUDA IPC handle


DEVICE_TRANSPORTS = (WeightTransport.cuda_ipc.value,)  # the bucket buffer lives in device memory


class HeadDtype(StrEnum):
    """dtype of the engine's lm_head (rollout.head_dtype)."""

    model = "model"  # the engine's dtype (vLLM's default)
    float32 = "float32"  # fp32 logits whatever the engine's dtype


class LogprobsMode(StrEnum):
    """Which log-probs the engine returns (rollout.logprobs_mode, vLLM's logprobs_mode)."""

    raw_logprobs = "raw_logprobs"  # the model's distribution at temperature 1
    processed_logprobs = "processed_logprobs"  # after temperature and top-p


@dataclass
class RolloutConfig:
    """vLLM engine settings."""

    model: str = ""
    """HF model folder (weights are re-synced from the actor after each update). The trainer sets it
    from model.path (setting it there is an error)."""
    dtype: str = "bfloat16"
    """Engine dtype, a name vLLM takes (bfloat16 on GPUs; the training-inference mismatch is what replay and
    corrections handle). A training run's default is auto: bfloat16 on CUDA, float32 on CPU (moe-rl resolves it
    before the engine starts; the run header says which)."""
    head_dtype: HeadDtype = HeadDtype.model
    """The engine's lm_head projection (vLLM's hf_overrides head_dtype): model (in rollout.dtype) | float32 (logits
    summed and kept in fp32, as vLLM recommends for RL). With a bf16 engine and an fp32 actor, float32 lowered the
    stability lab's mean mismatch/k3_kl to 0.80x (docs/stability.md); not with true on-policy, whose engine-op pass
    computes the head in the engine's dtype."""
    engines: int = 0
    """Number of engines in a training run; 0 = one per data-parallel rank. Each serves an equal share of the
    data-parallel ranks and runs on the lowest rank among them (rollout/engine_groups.py)."""
    tensor_parallel_size: int = 1
    """Tensor-parallel size of each engine: its workers are processes of their own (vLLM's mp executor),
    each holding a shard and a KV cache. With 1 on CPU the engine core
    process runs its one worker itself."""
    placement: Placement = Placement.colocated
    """colocated (the engine shares its rank's cores or device) | separate (CPU: the rank's cores split in
    halves, trainer threads pinned to one, the engine's to the other; rollout/placement.py). With
    trainer.max_staleness >= 1 separate lets generation and training run side by side."""
    capture: Capture = Capture.auto
    """Route capture: auto (native on CUDA, hook on CPU) | hook | native | none."""
    max_model_len: int | None = None
    """Context length; None: the model's max_position_embeddings."""
    max_num_batched_tokens: int | None = None
    """The engine's token budget per forward step (vLLM's max_num_batched_tokens); None: vLLM's own default (on
    CPU 4,096 here; on GPUs it depends on the device, e.g. 8,192 or 16,384). A step whose prompts add up to more
    prefills them over several steps, a prompt longer than the budget in chunks; seeded samples are the same either
    way (moe_rl.compat.vllm.keep_seeded_samples_across_chunks). Below vLLM's max_num_seqs (256 on CPU) the engine
    schedules at most this many sequences per step. MLA models on CPU cannot chunk a prefill: vLLM raises the
    budget there to at least the context length."""
    kv_cache_gib: float | None = None
    """CPU engines: the KV cache in GiB (vLLM's kv_cache_memory_bytes). null: the trainer sizes it for the most an
    engine holds at once, its share of a step's samples (or of a validation pass's, if more) each at its longest
    (the prompt limit + max_tokens, within the context) plus one KV block, so that no sample waits for KV
    (moe_rl/plan/kv.py `cpu_kv_cache_gib`): 144 MiB per engine in the default run (float32), 72 MiB in bfloat16.
    An engine built outside the trainer gets 1 GiB. GPU engines ignore it: their KV is what
    rollout.gpu_memory_utilization leaves."""
    cpu_busy_loop_s: float | None = 0.05
    """CPU, engines with tensor_parallel_size > 1: how long the engine's core and worker processes spin for the next
    message after one before they sleep on a socket (vLLM's own default, null here: 1 s). Their spin competes with
    the trainer's ranks for the cores: 0.05 keeps back-to-back decode steps fast and halved the default run's
    update time (docs/performance.md). With one worker, which the engine core runs itself, there is no such
    message queue and nothing spins."""
    cpu_start_method: StartMethod = StartMethod.fork
    """CPU: how an engine's processes start. fork: from the rank, which has already imported torch and vLLM (about
    10 s of CPU less per engine start, docs/performance.md); only from a process with one OpenMP thread (torchrun's
    OMP_NUM_THREADS=1), else the engine is spawned and a line says why | spawn: vLLM-CPU's own choice, a fresh
    interpreter. Same tokens and log-probs either way. With CUDA vLLM always spawns (a forked child cannot use the
    parent's CUDA context), so this is not read there."""
    gpu_memory_utilization: float = 0.5
    """Share of GPU memory for the engine's weights and KV cache (GPU)."""
    sleep_while_training: bool = False
    """GPU, colocated engines: after each rollout the engine sleeps (vLLM sleep level 1: KV cache freed, weights
    offloaded to host memory) so the actor trains with the device to itself; the weight sync wakes its weights,
    the next sampling its KV cache."""
    logprobs_mode: LogprobsMode = LogprobsMode.raw_logprobs
    """raw_logprobs (model distribution at temperature 1) | processed_logprobs (after temperature/top-p)."""
    weight_sync_bucket_mb: int = 64
    """Upper bound of one weight-sync bucket."""
    weight_transport: WeightTransport = WeightTransport.shm
    """Last hop of a weight-sync bucket into the engine: shm (a /dev/shm file the engine worker maps, the whole
    update one engine call whose buckets are announced on a socket; CPU, and on GPU through host memory) | rpc
    (a safetensors blob through collective_rpc) | cuda_ipc (GPU, colocated, tensor_parallel_size 1: the bucket
    stays on the leader's device, the worker maps it by CUDA IPC handle)."""
    seed: int | None = None
    """Engine seed; None = 0. The trainer sets it from trainer.seed (setting it there is an error)."""
    block_size: int | None = None
    """KV-cache block size in tokens (the prefix cache reuses whole blocks); None: the engine's default (128 on
    CPU, 16 on GPUs)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn (agentic) rollouts; rollout.multi_turn.env=none keeps single-turn rollouts."""
    inflight: bool = False
    """In-flight weight updates (rollout/inflight_source.py): the engine keeps 1 + trainer.max_staleness steps of
    prompt groups in flight and never waits for a step's longest sample; a step trains the first
    data.prompts_per_step groups per data-parallel rank to finish, and the weight sync pauses the engine with its
    requests kept (their KV re-prefilled under the new weights). Every token keeps the version, mu and routes it was
    sampled with (Rollout.versions); a group with a token more than trainer.max_staleness versions old is dropped
    and sampled again (rollout/dropped_fraction). Needs trainer.max_staleness >= 1 (any bound) and the hook route
    capture; logged: rollout/version_lag_mean, rollout/version_lag_max, rollout/version_lag_share_<k>. At scale:
    max_staleness 2-4 with thinking-length responses (PipelineRL, AReaL)."""
    partial: bool = False
    """Partial rollouts (slime's and verl's variant, for engines that cannot keep a request across an update; needs
    rollout.inflight=true): each weight sync aborts the running samples, and each continues after it as a new
    request from its generated prefix, re-prefilled under the new weights. The prefix keeps its tokens' versions,
    mu and routes (the continuation's prefill adds no route rows for it). Its later tokens are sampled with a seed
    derived from the sample's and the prefix length, so even at unchanged weights they differ from a keep-mode run's.
    Refused with sampling.stop (a stop string spanning the cut would be missed)."""

    def check(self) -> None:
        """This section's own rules (the trainer's config validation; the multi-turn ones span sections, the ones that
        depend on the device are moe_rl.config.validate's)."""
        if self.model:
            refuse("rollout.model", "is set from model.path by the trainer; set model.path instead")
        if self.seed is not None:
            refuse("rollout.seed", "is set from trainer.seed by the trainer; set trainer.seed instead")
        if self.engines < 0:
            refuse("rollout.engines", f"{self.engines}: must be >= 0 (0 = one engine per data-parallel rank)")
        if self.weight_transport == "cuda_ipc" and self.tensor_parallel_size > 1:
            refuse(
                "rollout.weight_transport",
                f"cuda_ipc maps the bucket on the leader's GPU, which only the first of rollout.tensor_parallel_size="
                f"{self.tensor_parallel_size} engine workers shares; use shm (host memory, any engine layout)",
            )
        if self.sleep_while_training and self.placement == "separate":
            refuse(
                "rollout.sleep_while_training",
                "true with rollout.placement=separate (the engine's device is not the actor's)",
            )
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            refuse("rollout.kv_cache_gib", f"{self.kv_cache_gib}: must be > 0 (or null: sized by the trainer)")
        if self.tensor_parallel_size < 1:
            refuse("rollout.tensor_parallel_size", f"{self.tensor_parallel_size}: must be >= 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            why = f"{self.max_num_batched_tokens}: must be >= 1 (or null: vLLM's default)"
            refuse("rollout.max_num_batched_tokens", why)
        if self.tensor_parallel_size > 1 and self.placement == "separate":
            refuse(
                "rollout.tensor_parallel_size",
                f"{self.tensor_parallel_size} with rollout.placement=separate: the separate placement binds one engine "
                "process to half of its rank's cores; use placement colocated",
            )
