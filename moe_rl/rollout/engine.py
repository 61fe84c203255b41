"""The vLLM rollout engine: sampling with per-token log-probs and expert routes, weight sync.

An engine belongs to one rank (its engine core in a subprocess with a private process group); the
trainer runs `rollout.engines` of them on the leaders of its engine groups (rollout/engine_groups.py).

Weight sync (moe_rl/weight_sync.py) calls the worker extension through `rpc`. For GPU colocation
(`rollout.sleep_while_training`), vLLM's `sleep(level=1)` frees the KV cache and offloads the weights
after each rollout while the actor trains; the weight sync wakes the weights, sampling the KV cache.
"""

from __future__ import annotations

import gc
import glob
import os
import threading
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe_rl.common import progress
from moe_rl.common.batch import RolloutBatch
from moe_rl.compat.versions import check_versions
from moe_rl.compat.vllm_plugin import BUSY_LOOP_ENV, CPU_ENGINE_ENV, ENGINE_ENV
from moe_rl.rollout.config import RolloutConfig, SamplingConfig
from moe_rl.rollout.reaper import Reaper
from moe_rl.rollout.route_capture import HookRouteCapture, NativeRouteCapture, RouteCapture
from moe_rl.routing.records import route_dtype, validate_routes


class RolloutEngineError(RuntimeError):
    """The rollout engine failed (died, refused a request, or returned inconsistent data)."""


# What vLLM's engine core answers a call with once a signal has started its shutdown (EngineCoreProc.
# _reject_utility_in_shutdown): a plain Exception, not EngineDeadError.
SHUTTING_DOWN = "Server shutting down"


def _set_vllm_env(cfg: RolloutConfig) -> None:
    """The variables this rank's engine processes read (moe_rl.compat.vllm_plugin): every engine is moe-rl's;
    CPU engines get their settings and vLLM-CPU defaults."""
    os.environ.pop(BUSY_LOOP_ENV, None)
    os.environ.pop(CPU_ENGINE_ENV, None)
    os.environ[ENGINE_ENV] = "1"
    if torch.cuda.is_available():
        return
    os.environ[CPU_ENGINE_ENV] = "1"
    if cfg.cpu_busy_loop_s is not None:
        os.environ[BUSY_LOOP_ENV] = str(cfg.cpu_busy_loop_s)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


DEFAULT_KV_CACHE_GIB = 1.0  # a CPU engine's KV cache where nothing sized it (rollout.kv_cache_gib)


def _default_max_num_seqs(world_size: int) -> int:
    """vLLM's default max_num_seqs for an offline `LLM` of `world_size` workers on this platform."""
    # heavy: vLLM, imported on first use
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    defaults = EngineArgs.get_batch_defaults(world_size)[1]
    return defaults.get(UsageContext.LLM_CLASS, SchedulerConfig.DEFAULT_MAX_NUM_SEQS)


def _engine_start(cfg: RolloutConfig):
    """The context an engine starts in: forked from this rank on CPU where rollout.cpu_start_method says so."""
    if cfg.cpu_start_method not in ("fork", "spawn"):
        raise ValueError(f"rollout.cpu_start_method={cfg.cpu_start_method!r}: choose fork or spawn")
    if torch.cuda.is_available() or cfg.cpu_start_method == "spawn":
        return nullcontext()
    threads = torch.get_num_threads()
    if threads != 1 or os.environ.get("OMP_NUM_THREADS") != "1":
        # A process that has run OpenMP with a team of threads cannot fork: libgomp's thread pool does not cross
        # fork, and the child's first parallel region waits forever on threads that do not exist (seen: an engine
        # started from pytest hung in its KV-cache allocation). torchrun starts ranks with OMP_NUM_THREADS=1.
        print(
            f"[moe-rl] rollout.cpu_start_method=fork: this engine is spawned instead, since this process may have run "
            f"OpenMP with several threads (torch.get_num_threads()={threads}, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}); fork needs both 1, as torchrun sets them",
            flush=True,
        )
        return nullcontext()
    # compat.vllm registers an at-fork hook: imported where an engine runs
    from moe_rl.compat.vllm import engine_core_by_fork

    return engine_core_by_fork()


def engine_visible_devices(visible: str | None, device_count: int, first: int, count: int) -> str:
    """CUDA_VISIBLE_DEVICES for an engine's processes: this rank's device `first` (an index into what this process
    sees, `visible`) and the `count - 1` after it, by the names the parent's CUDA_VISIBLE_DEVICES gives them."""
    names = visible.split(",") if visible else [str(i) for i in range(device_count)]
    if first + count > len(names):
        raise RolloutEngineError(
            f"rollout.tensor_parallel_size={count}: an engine led by the rank on device {first} needs devices "
            f"{first}..{first + count - 1}, but this process sees {len(names)} ({visible or 'all'})"
        )
    return ",".join(names[first : first + count])


@contextmanager
def _engine_sees_its_gpus(count: int):
    """vLLM starts an engine's workers on devices 0..count-1 of those they see (EngineArgs has no device), so
    without this every engine of a node would sit on GPU 0. A colocated engine belongs on its leader's device
    (and the next ones for its TP workers): its processes, started inside this block, see only those."""
    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = engine_visible_devices(
        before, torch.cuda.device_count(), torch.cuda.current_device(), count
    )
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@dataclass
class TurnOutput:
    """One sample of one multi-turn turn (RolloutEngine.generate_turn)."""

    prompt_ids: list[int]  # as the engine saw them
    response_ids: list[int]
    logprobs: np.ndarray  # [len(response)] float32
    finish_reason: str
    routes: np.ndarray | None  # [len(prompt) + len(response) - 1, L_moe, K]; rows not computed are 0
    computed: np.ndarray | None  # [len(prompt) + len(response) - 1] bool: rows the engine computed this turn
    cached_tokens: int  # prompt tokens served from the prefix cache


def sampling_params(sampling: SamplingConfig, n: int, max_tokens: int, seed: int | None):
    # heavy: vLLM, imported on first use
    from vllm import SamplingParams

    return SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=max_tokens,
        stop=list(sampling.stop) or None,
        logprobs=0,
        seed=seed,
        # The trainer decodes what it needs itself (rewards, multi-turn): the engine's client detokenizes only
        # where stop strings need the text. Same tokens and log-probs; 7% less time per toy rollout.
        detokenize=bool(sampling.stop),
    )


def _sampled_logprobs(completion, where: str) -> np.ndarray:
    """mu's log-prob of each sampled token of a vLLM CompletionOutput, float32."""
    tokens, steps = list(completion.token_ids), completion.logprobs
    if steps is None or len(steps) != len(tokens):
        raise RolloutEngineError(
            f"{where}: engine returned {0 if steps is None else len(steps)} log-probs for {len(tokens)} tokens"
        )
    return np.array([step[tok].logprob for step, tok in zip(steps, tokens, strict=True)], dtype=np.float32)


def _executor_kwargs(cfg: RolloutConfig) -> dict[str, Any]:
    """How vLLM runs the engine's workers."""
    if cfg.tensor_parallel_size > 1:  # routes are taken from worker 0: every TP worker routes all tokens
        return dict(tensor_parallel_size=cfg.tensor_parallel_size, distributed_executor_backend="mp")
    if not torch.cuda.is_available():
        # vLLM-CPU turns the one-worker executor ("uni") into its multiprocess one, whose single worker is a
        # process of its own beside the engine core: one more process to start, import vLLM in (~11 s of CPU
        # on a 2-core machine) and watch. Named by class, the one-worker executor stays: the engine core runs
        # its worker itself. Same kernels, same thread settings (VLLM_CPU_OMP_THREADS_BIND applies in the
        # engine core), so the same tokens and log-probs.
        # heavy: vLLM, imported on first use
        from vllm.v1.executor.uniproc_executor import UniProcExecutor

        return {"distributed_executor_backend": UniProcExecutor}
    return {}


def _engine_kwargs(
    cfg: RolloutConfig, worker_extension: str, capture: RouteCapture | None, prefix_caching: bool
) -> dict[str, Any]:
    """vLLM's `LLM(**kwargs)` for this engine: the config's settings, the platform's defaults, the capture's needs."""
    kwargs: dict[str, Any] = dict(
        model=cfg.model,
        dtype=cfg.dtype,
        seed=cfg.seed or 0,
        max_model_len=cfg.max_model_len,
        worker_extension_cls=worker_extension,
        logprobs_mode=str(cfg.logprobs_mode),
        enforce_eager=not torch.cuda.is_available(),
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        # vLLM's bar over the checkpoint's files: progress for a many-file model, noise for one file
        use_tqdm_on_load=len(glob.glob(os.path.join(cfg.model, "*.safetensors"))) > 1,
    )
    kwargs.update(_executor_kwargs(cfg))
    # compat.vllm registers an at-fork hook: imported where an engine runs
    from moe_rl.compat.vllm import mla_backend_for_dtype

    kwargs.update(mla_backend_for_dtype(cfg.model, str(cfg.dtype)))
    if cfg.head_dtype != "model":
        kwargs["hf_overrides"] = {"head_dtype": str(cfg.head_dtype)}
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    if cfg.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        # vLLM refuses a budget below max_num_seqs; a step of that budget cannot schedule more sequences anyway
        default_seqs = _default_max_num_seqs(cfg.tensor_parallel_size)
        if cfg.max_num_batched_tokens < default_seqs:
            kwargs["max_num_seqs"] = cfg.max_num_batched_tokens
    if not torch.cuda.is_available():
        kwargs["kv_cache_memory_bytes"] = int((cfg.kv_cache_gib or DEFAULT_KV_CACHE_GIB) * 2**30)
    if cfg.sleep_while_training:
        kwargs["enable_sleep_mode"] = True
    if capture is not None:
        kwargs.update(capture.engine_kwargs())
    elif prefix_caching:
        kwargs["enable_prefix_caching"] = True
    return kwargs


def _make_capture(
    mode: str, moe_layers: list[int], num_experts: int, topk: int, prefix_caching: bool
) -> tuple[RouteCapture | None, bool]:
    """The route capture `rollout.capture` names, and whether prefix caching stays on with it."""
    if mode == "auto":
        mode = "native" if torch.cuda.is_available() else "hook"
    if mode == "hook":
        return HookRouteCapture(moe_layers, topk, route_dtype(num_experts), prefix_caching), prefix_caching
    if mode == "native":
        if prefix_caching:
            print(
                "[moe-rl] rollout.multi_turn.prefix_caching: off (native route capture records whole sequences "
                "only; every turn prefills the conversation again)",
                flush=True,
            )
        return NativeRouteCapture(moe_layers), False
    if mode == "none":
        return None, prefix_caching
    raise ValueError(f"rollout.capture={mode!r}: choose auto, hook, native or none")


def _start_engine(cfg: RolloutConfig, kwargs: dict[str, Any]) -> tuple[Any, Reaper, list]:
    """Start vLLM's `LLM(**kwargs)` -> (the LLM, its reaper, the processes it started: the engine core and its workers,
    psutil.Process). The reaper starts first: if this process dies while the engine starts, the engine dies too."""
    # heavy: vLLM and psutil, imported on first use
    import psutil
    from vllm import LLM

    me = psutil.Process()
    reaper = Reaper()
    before = {p.pid for p in me.children(recursive=True)}
    try:
        with (
            _engine_start(cfg),
            _engine_sees_its_gpus(cfg.tensor_parallel_size),
        ):
            llm = LLM(**kwargs)
    except Exception as e:
        reaper.close()
        # The half-built client's sockets and threads are finalized now, not by a later collection that may
        # fall inside the next engine's start (as shutdown() does for a started engine)
        gc.collect()
        raise RolloutEngineError(f"vLLM engine for {cfg.model} failed to start: {e}") from e
    # The engine core and its workers: watched while we wait on the engine, because a
    # killed engine core can leave vLLM's client blocked forever (seen with 0.32 on CPU).
    procs = [p for p in me.children(recursive=True) if p.pid not in before and p.pid != reaper.proc.pid]
    reaper.watch([p.pid for p in procs])
    return llm, reaper, procs


def _kill(procs: list) -> None:
    """Kill the engine's processes (psutil.Process) and wait for them, up to 10 s."""
    # heavy: psutil, imported on first use
    import psutil

    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _dead_processes(procs: list) -> list[int]:
    """The pids of `procs` (psutil.Process) that are gone or zombies."""
    # heavy: psutil, imported on first use
    import psutil

    dead = []
    for p in procs:
        try:
            if not p.is_running() or p.status() == psutil.STATUS_ZOMBIE:
                dead.append(p.pid)
        except psutil.NoSuchProcess:
            dead.append(p.pid)
    return dead


def _call_watched(what: str, procs: list, gone: Callable[[], None], fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a daemon thread, failing fast if one of the engine's `procs` dies; `gone()` is called
    before raising where the engine is gone (died, or shutting down on a signal).

    A daemon thread (not an executor, whose threads are joined at exit): a call blocked on a
    dead engine must not keep the interpreter from exiting.
    """
    # heavy: vLLM, imported on first use
    from vllm.v1.engine.exceptions import EngineDeadError

    box: dict[str, Any] = {}

    def run():
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # re-raised on the calling thread
            box["error"] = e

    thread = threading.Thread(target=run, name=f"moe-rl-vllm-{what}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)
        if thread.is_alive() and (dead := _dead_processes(procs)):
            gone()
            raise RolloutEngineError(
                f"{what}: vLLM engine process(es) {dead} died; see the engine log above (out of memory? killed?)"
            )
    error = box.get("error")
    if isinstance(error, EngineDeadError):
        gone()
        raise RolloutEngineError(f"{what}: the vLLM engine process died ({error}); see its log above") from error
    if error is not None and str(error) == SHUTTING_DOWN:  # a stop signal reached the engine core too
        gone()
        raise RolloutEngineError(f"{what}: the vLLM engine is shutting down (a stop signal?)") from error
    if isinstance(error, TimeoutError):
        raise RolloutEngineError(f"{what}: the vLLM engine did not answer in time") from error
    if error is not None:
        raise error
    return box["result"]


def _refuse_if_shut_down(engine: RolloutEngine, what: str) -> None:
    if not getattr(engine, "_alive", False):
        raise RolloutEngineError(f"{what}: the rollout engine was shut down (or died earlier)")


def refuse_cut_short(outputs, gone: Callable[[], None]) -> None:
    """vLLM returns a request it aborted (its engine core shutting down on a stop signal) or failed as
    finished: such a sample is not the policy's whole response and is never trained on. `gone()` is called
    for an abort."""
    for i, out in enumerate(outputs):
        for c in out.outputs:
            if c.finish_reason in ("abort", "error"):
                if c.finish_reason == "abort":  # nothing of ours aborts a request: the engine is going away
                    gone()
                raise RolloutEngineError(
                    f"generate: the engine ended prompt {i}, sample {c.index} with finish reason "
                    f"'{c.finish_reason}' after {len(c.token_ids)} tokens (shutting down on a signal? see its "
                    "log above)"
                )


def _turns(outputs, routes: dict) -> list[TurnOutput]:
    """generate_turn's result from vLLM's RequestOutputs (one sample each) and the capture's partial routes."""
    turns = []
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        rows, computed = routes.get((i, 0), (None, None))
        turns.append(
            TurnOutput(
                list(out.prompt_token_ids),
                list(c.token_ids),
                _sampled_logprobs(c, f"prompt {i}"),
                str(c.finish_reason),
                rows,
                computed,
                int(out.num_cached_tokens or 0),
            )
        )
    return turns


def to_batch(outputs, routes, moe_layers: list[int], num_experts: int, topk: int) -> RolloutBatch:
    """A RolloutBatch from vLLM's RequestOutputs (samples in index order) and the capture's routes (or None)."""
    prompt_ids, response_ids, logps, reasons, pidx, sidx, recs = [], [], [], [], [], [], []
    for i, out in enumerate(outputs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            resp = list(c.token_ids)
            lp = _sampled_logprobs(c, f"prompt {i} sample {c.index}")
            prompt_ids.append(list(out.prompt_token_ids))
            response_ids.append(resp)
            logps.append(lp)
            reasons.append(str(c.finish_reason))
            pidx.append(i)
            sidx.append(c.index)
            if routes is not None:
                t = len(out.prompt_token_ids) + len(resp)
                recs.append(
                    validate_routes(
                        routes[(i, c.index)],
                        num_tokens=t,
                        num_experts=num_experts,
                        num_moe_layers=len(moe_layers),
                        topk=topk,
                        sample=f"{len(prompt_ids) - 1} (prompt {i}, sample {c.index})",
                    )
                )
    return RolloutBatch(
        prompt_ids,
        response_ids,
        logps,
        reasons,
        np.array(pidx),
        np.array(sidx),
        recs if routes is not None else None,
        moe_layers,
        num_experts,
        topk,
    )


class RolloutEngine:
    """One vLLM engine with route capture. Use as a context manager (or call `shutdown`)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        moe_layers: list[int],
        num_experts: int,
        topk: int,
        worker_extension: str = "moe_rl.rollout.worker_ext.MoeRLWorkerExtension",
    ):
        """`worker_extension`: the class vLLM mixes into the engine's workers, moe-rl's or a subclass of it (the
        tests add probes of the worker process's state that way)."""
        if not os.path.isfile(os.path.join(cfg.model, "config.json")):
            raise FileNotFoundError(f"rollout.model={cfg.model!r}: config.json not found")
        check_versions()  # vLLM's patches (moe_rl/compat): once per process
        self.cfg = cfg
        self.moe_layers, self.num_experts, self.topk = list(moe_layers), num_experts, topk
        # multi-turn: later turns reuse the KV of earlier ones where the capture can record around cache hits
        self.capture, self.prefix_caching = _make_capture(
            cfg.capture,
            self.moe_layers,
            num_experts,
            topk,
            cfg.multi_turn.env != "none" and cfg.multi_turn.prefix_caching,
        )
        _set_vllm_env(cfg)
        kwargs = _engine_kwargs(cfg, worker_extension, self.capture, self.prefix_caching)
        if "kv_cache_memory_bytes" in kwargs:
            self.kv_cache_bytes = kwargs["kv_cache_memory_bytes"]
        self._asleep: set[str] = set()  # what sleep() released: "weights", "kv_cache"
        self.llm, self._reaper, self._procs = _start_engine(cfg, kwargs)
        self._alive = True
        self.rpc("moe_rl_init_worker")
        self._reaper.own([f for f in self.rpc("moe_rl_store_file") if f])
        if self.capture is not None:
            self.capture.install(self.llm)
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import mark_each_engine_step

        # Every engine step (one decode step of the batch) is progress for the hang watchdog: a long rollout
        # moves, an engine that stopped answering does not.
        mark_each_engine_step(self.llm, progress.mark)

    # ---- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def health_check(self, timeout_s: float = 30.0) -> None:
        """Raise RolloutEngineError unless the engine answers within `timeout_s`."""
        self.guard("moe_rl_ping", self.llm.collective_rpc, "moe_rl_ping", timeout=timeout_s, args=())

    def shutdown(self) -> None:
        """Stop the engine core and its workers (idempotent), also after the engine died. Its processes are
        killed first: a rollout engine holds nothing to flush, and vLLM's graceful stop waits seconds for an
        engine core that outlives its workers; the reaper then removes their shared memory and sockets."""
        if not hasattr(self, "llm"):
            return
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import mark_engine_stopping

        self._alive = False
        mark_engine_stopping(self.llm)
        _kill(self._procs)
        try:
            self.llm.llm_engine.engine_core.shutdown()  # the client side: sockets, threads
        except Exception:  # with its processes gone a client may fail to close cleanly; nothing is left to stop
            pass
        finally:
            del self.llm
            # the client's sockets and threads finalized now, not by a collection inside the next engine's start
            gc.collect()
            self._reaper.close()  # the engine's shared-memory segments and socket files

    @property
    def processes(self) -> list:
        """The engine core and its workers (psutil.Process)."""
        return list(self._procs)

    def gone(self) -> None:
        """The engine went away (died, or shuts down on a signal): later calls are refused."""
        self._alive = False

    def guard(self, what: str, fn, *args, **kwargs):
        """Run an engine call, failing fast if an engine process dies (`_call_watched`)."""
        _refuse_if_shut_down(self, what)
        return _call_watched(what, self._procs, self.gone, fn, *args, **kwargs)

    def rpc(self, method: str, *args):
        """Call a `moe_rl_*` method of the worker extension on every engine worker (guarded: a dead
        engine raises RolloutEngineError); returns the workers' answers."""
        return self.guard(method, self.llm.collective_rpc, method, timeout=None, args=args)

    # ---- GPU colocation: the engine sleeps while the actor trains (rollout.sleep_while_training) ----
    def sleep(self) -> None:
        """Free the KV cache and offload the weights (vLLM sleep level 1); a no-op unless configured."""
        if self.cfg.sleep_while_training and not self._asleep:
            self.guard("sleep", self.llm.sleep, level=1)
            self._asleep = {"weights", "kv_cache"}

    def wake_up(self, *tags: str) -> None:
        """Bring back what sleep() released: `tags` of "weights", "kv_cache" (none: both)."""
        wanted = self._asleep & set(tags or ("weights", "kv_cache"))
        if wanted:
            self.guard("wake_up", self.llm.wake_up, sorted(wanted))
            self._asleep -= wanted

    # ---- sampling -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> RolloutBatch:
        """Sample `sampling.n` responses per prompt (token-id prompts)."""
        # heavy: vLLM, imported on first use
        from vllm import TokensPrompt

        _refuse_if_shut_down(self, "generate")
        self.wake_up()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        longest = max(len(p) for p in prompts) + sampling.max_tokens
        limit = self.llm.llm_engine.model_config.max_model_len
        if longest > limit:
            raise ValueError(f"longest prompt + max_tokens = {longest} exceeds the engine's max_model_len={limit}")
        params = [
            sampling_params(
                sampling, sampling.n, sampling.max_tokens, None if sampling.seed is None else sampling.seed + i
            )
            for i in range(len(prompts))
        ]
        outputs = self.guard(
            "generate", self.llm.generate, [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        refuse_cut_short(outputs, self.gone)
        routes = self.guard("route capture", self.capture.collect, self.llm, outputs) if self.capture else None
        return to_batch(outputs, routes, self.moe_layers, self.num_experts, self.topk)

    def generate_turn(
        self, prompts: list[list[int]], sampling: SamplingConfig, max_tokens: list[int], seeds: list[int | None]
    ) -> list[TurnOutput]:
        """One turn of multi-turn rollouts: one sample per token-id prompt, each with its own token budget and
        seed, and the routes of the positions the engine computed for it (prefix-cache hits are not).
        `sampling.n` is not used (each trajectory is its own prompt)."""
        # heavy: vLLM, imported on first use
        from vllm import TokensPrompt

        _refuse_if_shut_down(self, "generate_turn")
        self.wake_up()
        limit = self.llm.llm_engine.model_config.max_model_len
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            if not p or m < 1 or len(p) + m > limit:
                raise ValueError(f"generate_turn: prompt {i} has {len(p)} tokens + {m} to sample (limit {limit})")
        params = [sampling_params(sampling, 1, m, seed) for m, seed in zip(max_tokens, seeds, strict=True)]
        outputs = self.guard(
            "generate", self.llm.generate, [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        refuse_cut_short(outputs, self.gone)
        routes = self.guard("route capture", self.capture.collect_partial, self.llm, outputs) if self.capture else {}
        return _turns(outputs, routes)

    def reset_prefix_cache(self) -> None:
        """Forget cached KV (after a weight update: blocks computed with the old weights must not be reused)."""
        if self.prefix_caching:
            self.guard("reset_prefix_cache", self.llm.reset_prefix_cache)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        """Teacher-forced log-probs of each token given its prefix (entry 0 is 0)."""
        # heavy: vLLM, imported on first use
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        self.wake_up()
        outs = self.guard(
            "prompt_logprobs",
            self.llm.generate,
            [TokensPrompt(prompt_token_ids=s) for s in sequences],
            params,
            use_tqdm=False,
        )
        result = []
        for s, o in zip(sequences, outs, strict=True):
            lp = np.zeros(len(s), dtype=np.float32)
            for t in range(1, len(s)):
                lp[t] = o.prompt_logprobs[t][s[t]].logprob
            result.append(lp)
        # capture of these forwards is not wanted
        if isinstance(self.capture, HookRouteCapture):
            self.rpc("moe_rl_take_routes", {})
        return result
