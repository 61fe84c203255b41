"""The vLLM reload-warning filter: vLLM's real layerwise reload emits the warning for a rotary
layer (and nothing else), puts its cache back untouched, and the filter drops exactly that."""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from moe_rl.compat.vllm import (
    _CacheOnlyReloadFilter,
    cache_only_layers,
    quiet_cache_only_reload_warning,
    shared_layers,
)

LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _attention_like():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = nn.Linear(4, 4, bias=False)
            self.o_proj.weight.weight_loader = default_weight_loader
            self.rotary_emb = get_rope(32, 64, True, {"rope_type": "default", "rope_theta": 10000.0}, torch.float32)

    with set_current_vllm_config(VllmConfig()):
        return Attn()


def test_only_layers_without_parameters_are_cache_only():
    model = _attention_like()
    assert cache_only_layers(model) == {type(model.rotary_emb).__name__} == {"RotaryEmbedding"}
    record = logging.LogRecord(LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", ("Linear",), None)
    assert _CacheOnlyReloadFilter(frozenset({"RotaryEmbedding"})).filter(record)  # a real missing weight shows


@pytest.mark.parametrize("quiet", [False, True])
def test_layerwise_reload_warns_only_for_the_rotary_cache_and_keeps_it(quiet):
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    model = _attention_like()
    record_metadata_for_reloading(model)
    cache = model.rotary_emb.cos_sin_cache
    value = cache.clone()
    log = logging.getLogger(LOGGER)
    before = list(log.filters)
    records: list[logging.LogRecord] = []
    grab = logging.Handler(logging.WARNING)
    grab.emit = records.append  # a handler on the logger itself sees what its filters let through
    try:
        if quiet:
            quiet_cache_only_reload_warning(model)
            quiet_cache_only_reload_warning(model)
            assert sum(isinstance(f, _CacheOnlyReloadFilter) for f in log.filters) == 1
        log.addHandler(grab)
        initialize_layerwise_reload(model)
        model.o_proj.weight.weight_loader(model.o_proj.weight, torch.ones(4, 4))
        finalize_layerwise_reload(model, None)
    finally:
        log.filters[:] = before
        log.removeHandler(grab)
    if quiet:
        assert records == []
    else:
        assert [(r.msg, r.args) for r in records] == [("%s: Failed to load weights", ("RotaryEmbedding",))]
    assert model.rotary_emb.cos_sin_cache is cache and torch.equal(cache, value)  # restored untouched
    assert torch.equal(model.o_proj.weight, torch.ones(4, 4))  # the real weight did load


def test_a_layer_with_parameters_that_loads_nothing_is_remembered_for_the_weight_sync():
    """What the weight sync raises on (rollout/weight_receiver.py): vLLM only warns and keeps the old weights."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )

    model = _attention_like()
    record_metadata_for_reloading(model)
    log = logging.getLogger(LOGGER)
    before = list(log.filters)
    try:
        watch = quiet_cache_only_reload_warning(model)
        initialize_layerwise_reload(model)  # and o_proj is never sent
        finalize_layerwise_reload(model, None)
        assert watch.take() == ["Linear"] and watch.take() == []  # the rotary cache is not a failure
    finally:
        log.filters[:] = before


def test_a_tied_head_loads_nothing_by_design_and_is_neither_warned_about_nor_a_failure():
    """An LM head tied to the embedding (vLLM's `tie_weights`: the head holds the embedding's Parameter) gets its
    weight through the embedding; the reload's "Failed to load weights" for it is expected, not a stale layer."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
        record_metadata_for_reloading,
    )
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.embed.weight.weight_loader = default_weight_loader
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    assert shared_layers(model) == [model.head] and shared_layers(_attention_like()) == []
    record_metadata_for_reloading(model)
    log = logging.getLogger(LOGGER)
    before = list(log.filters)
    records: list[logging.LogRecord] = []
    grab = logging.Handler(logging.WARNING)
    grab.emit = records.append
    try:
        watch = quiet_cache_only_reload_warning(model)
        log.addHandler(grab)
        initialize_layerwise_reload(model)
        model.embed.weight.weight_loader(model.embed.weight, torch.ones(8, 4))
        finalize_layerwise_reload(model, None)
        assert watch.take() == [] and records == []
    finally:
        log.filters[:] = before
        log.removeHandler(grab)
    assert model.head.weight is model.embed.weight and torch.equal(model.head.weight, torch.ones(8, 4))


@pytest.mark.parametrize("neox", [False, True])
def test_cpu_rope_on_multi_head_3d_tensors_matches_the_native_rope(neox):
    """vLLM's CPU rotary op gets [tokens, heads, dim] inputs with several heads wrong (the DeepSeek MLA
    call); after `flatten_cpu_rope_heads` the layer agrees with vLLM's own native (PyTorch) rope."""
    from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from moe_rl.compat.vllm import flatten_cpu_rope_heads

    eager = VllmConfig(compilation_config=CompilationConfig(custom_ops=["all"]))  # custom ops on, as in our engines
    with set_current_vllm_config(eager):
        rope = get_rope(64, 2048, neox, {"rope_type": "default", "rope_theta": 1e4}, torch.float32)
        model = nn.ModuleDict({"rope": rope})
    positions = torch.randint(0, 2048, (7,))
    q_full, latent = torch.randn(7, 4, 96), torch.randn(7, 1, 576)  # MLA: rope part of q and of the shared key
    q, k = q_full[..., 32:], latent[..., 512:]
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())

    bug_q, _ = rope(positions, q.clone(), k.clone())
    assert (bug_q - want_q).abs().max() > 0.1  # the upstream bug this works around; delete the fix when this fails
    assert flatten_cpu_rope_heads(model) == 1
    got_q, got_k = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    flat_q = q.contiguous().reshape(7, -1).clone()
    got_flat, _ = rope(positions, flat_q, k.clone())  # 2-D inputs (most models) are unchanged
    torch.testing.assert_close(got_flat, want_q.reshape(7, -1), rtol=1e-5, atol=1e-5)


def test_busy_loop_plugin_sets_the_spin_only_when_asked(monkeypatch):
    """rollout.cpu_busy_loop_s reaches an engine's processes as MOE_RL_VLLM_BUSY_LOOP_S, read by moe-rl's vLLM
    plugin: set, the message-queue readers those processes create spin that long; null (unset), vLLM's default stays."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from moe_rl.compat import vllm_plugin

    # a default of this test's own (undone after): an engine started in this process earlier ran the plugin here too
    monkeypatch.setattr(SpinCondition.__init__, "__defaults__", (7.0,))
    monkeypatch.delenv(vllm_plugin.BUSY_LOOP_ENV, raising=False)
    vllm_plugin.register()
    assert SpinCondition.__init__.__defaults__ == (7.0,)  # untouched: vLLM's own
    monkeypatch.setenv(vllm_plugin.BUSY_LOOP_ENV, "0.05")
    vllm_plugin.register()
    assert SpinCondition.__init__.__defaults__ == (0.05,)


def test_a_cpu_engine_on_one_numa_node_skips_the_memory_binding_and_its_warning():
    """vLLM's CPU worker binds memory to a NUMA node through a C++ op that warns on stderr (no logging setting
    reaches it): a line per engine on every run's first screen. moe-rl's plugin, in a CPU engine's process on a
    machine of one node, replaces the op by nothing; the real op, called before, printed its line."""
    from vllm.utils.cpu_resource_utils import get_visible_memory_node

    if len(get_visible_memory_node()) > 1:
        pytest.skip("the binding runs, and warns, where several NUMA nodes are visible")
    script = (
        "import multiprocessing, torch, vllm._C\n"
        "torch.ops._C.init_cpu_memory_env([0])\n"
        "print('--- plugin', flush=True)\n"
        "multiprocessing.current_process().name = 'EngineCore_DP0'\n"
        "from moe_rl.compat import vllm_plugin\n"
        "vllm_plugin.register()\n"
        "torch.ops._C.init_cpu_memory_env([0])\n"
    )
    env = {**os.environ, "MOE_RL_VLLM_ENGINE": "1", "MOE_RL_VLLM_CPU_ENGINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    before, after = out.split("--- plugin")  # one pipe, in the order written
    if "NUMA binding" not in before:
        pytest.skip("vLLM's op binds nothing here (no NUMA support in this machine or build), so it says nothing")
    assert "NUMA binding" not in after


def test_an_engine_is_forked_only_from_a_process_with_one_openmp_thread(monkeypatch, capsys):
    """rollout.cpu_start_method=fork forks the engine core only where OpenMP has never run a team of threads
    (libgomp's pool does not cross fork: a child forked from pytest hung in its first parallel region); elsewhere
    the engine is spawned and a line says why. The fork context wraps vLLM-CPU's config check only while the engine
    starts, and puts back the caller's start method."""
    from contextlib import nullcontext

    from vllm.platforms.cpu import CpuPlatform

    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.engine import _engine_start

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert isinstance(_engine_start(RolloutConfig()), nullcontext)
    assert "this engine is spawned instead" in capsys.readouterr().out
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert isinstance(_engine_start(RolloutConfig(cpu_start_method="spawn")), nullcontext)
    with pytest.raises(ValueError, match="rollout.cpu_start_method='forkserver'"):
        _engine_start(RolloutConfig(cpu_start_method="forkserver"))
    assert capsys.readouterr().out == ""

    original = CpuPlatform.__dict__["check_and_update_config"]
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    fork = _engine_start(RolloutConfig())
    assert not isinstance(fork, nullcontext)
    with fork:
        assert CpuPlatform.__dict__["check_and_update_config"] is not original
    assert CpuPlatform.__dict__["check_and_update_config"] is original
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


class _SignalInside:
    """An Event's lock that sends this process SIGUSR2 the first time the main thread takes it, so the handler runs
    while the lock is held: a second stop signal landing inside the first handler's `Event.set`. A blocking take
    that waits `wait_s` fails (TimeoutError) instead of waiting for ever."""

    def __init__(self, wait_s: float):
        self.lock, self.wait_s, self.sent = threading.Lock(), wait_s, False

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not blocking:
            return self.lock.acquire(False)
        if not self.lock.acquire(timeout=self.wait_s if timeout < 0 else timeout):
            raise TimeoutError("waited for a lock this thread holds")
        if not self.sent and threading.current_thread() is threading.main_thread():
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR2)  # its handler runs here, the lock held
        return True

    def release(self) -> None:
        self.lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


def _callback_with_signal_inside(wait_s: float):
    """vLLM's SignalCallback (built as its __init__ does) whose Event's lock is a _SignalInside, and a count of the
    times its callback ran."""
    from vllm.v1.engine.utils import SignalCallback

    ran: list[int] = []
    callback = SignalCallback.__new__(SignalCallback)
    callback._callback, callback._stopped = lambda: ran.append(1), False
    callback._event = threading.Event()
    callback._event._cond = threading.Condition(_SignalInside(wait_s))
    callback._thread = threading.Thread(target=callback._run, daemon=True)
    callback._thread.start()
    return callback, ran


def test_a_second_stop_signal_inside_the_first_does_not_hang_the_engine_core(monkeypatch):
    """vLLM's engine core sets a SignalCallback's Event from its SIGTERM handler. Under Slurm a second SIGTERM lands
    within a millisecond (scancel's and torchrun's): inside the first handler's Event.set, vLLM's own trigger waits
    for the lock its thread holds, for ever (an engine core and its rank hung in CI). In an engine core of
    moe-rl's (the plugin, MOE_RL_VLLM_ENGINE=1) the repeat returns, and the shutdown callback runs once."""
    from vllm.v1.engine.utils import SignalCallback

    from moe_rl.compat import vllm_plugin

    monkeypatch.setattr(SignalCallback, "trigger", SignalCallback.trigger)  # vLLM's, put back after
    handler = signal.getsignal(signal.SIGUSR2)
    try:
        callback, _ = _callback_with_signal_inside(wait_s=1.0)
        signal.signal(signal.SIGUSR2, lambda signum, frame: callback.trigger())
        with pytest.raises(TimeoutError):  # vLLM's own: the repeat waits on the first one's lock
            callback.trigger()

        monkeypatch.setenv(vllm_plugin.ENGINE_ENV, "1")
        vllm_plugin.register()  # not in an engine core: vLLM's own trigger stays
        assert not getattr(SignalCallback.trigger, "once", False)
        monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP0")
        vllm_plugin.register()
        assert SignalCallback.trigger.once

        callback, ran = _callback_with_signal_inside(wait_s=30.0)
        signal.signal(signal.SIGUSR2, lambda signum, frame: callback.trigger())
        callback.trigger()
        callback._thread.join(timeout=5)
        assert ran == [1] and callback._event._cond._lock.sent
    finally:
        signal.signal(signal.SIGUSR2, handler)


class _Marker:
    """An object of the parent's heap, found (or not) among the collector's objects in a forked child."""


def test_an_engine_forked_from_a_rank_freezes_the_heap_it_inherits(monkeypatch):
    """In an engine core forked from a rank (compat.vllm.engine_core_by_fork) the rank's objects are frozen before
    vLLM runs anything, so the engine's full collections skip them; objects the engine makes are collected as
    usual. Another fork of the rank (megatron's checkpoint writer) keeps its heap as it is."""
    from moe_rl.compat import vllm as compat_vllm

    marker = _Marker()

    def child_sees(forking_engine: bool) -> list[bool]:
        monkeypatch.setattr(compat_vllm, "_FORKING_ENGINE", forking_engine)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the at-fork hook has run; report and leave without pytest's teardown
            fresh = _Marker()
            tracked = {id(o) for o in gc.get_objects() if type(o) is _Marker}
            os.write(write, bytes([id(marker) in tracked, id(fresh) in tracked]))
            os._exit(0)
        os.close(write)
        seen = os.read(read, 2)
        os.close(read)
        assert os.waitpid(pid, 0)[1] == 0
        return [bool(b) for b in seen]

    assert child_sees(forking_engine=True) == [False, True]
    assert child_sees(forking_engine=False) == [True, True]


def test_a_float32_mla_engine_on_a_cpu_with_amx_gets_the_reference_mla_attention(tiny_models, monkeypatch):
    """vLLM-CPU's AMX MLA attention takes 16-bit weights only (a float32 DeepSeek-V3 engine failed to start on an
    AMX CPU): there a float32 MLA engine asks for CPU_MLA; bf16, models without MLA and CPUs without AMX keep vLLM's
    choice. tests/engine/test_rollout_engine.py starts the float32 DeepSeek-V3 engine on whatever CPU runs it."""
    from moe_rl.compat.vllm import mla_backend_for_dtype

    mla, plain = tiny_models["deepseek_v3"], tiny_models["qwen3_moe"]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert mla_backend_for_dtype(mla, "float32") == {"attention_backend": "CPU_MLA"}
    assert mla_backend_for_dtype(mla, "bfloat16") == {} and mla_backend_for_dtype(plain, "float32") == {}
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert mla_backend_for_dtype(mla, "float32") == {}
