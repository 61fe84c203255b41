"""moe-rl's vLLM general plugin (setup.py entry point `vllm.general_plugins`): vLLM loads it in every process it
starts — the engine core and each worker, where the settings below take effect. It changes nothing unless a
moe-rl RolloutEngine started the engine and set the variables (rollout/engine.py `_set_vllm_env`)."""

from __future__ import annotations

import multiprocessing
import os
import sys

BUSY_LOOP_ENV = "MOE_RL_VLLM_BUSY_LOOP_S"  # rollout.cpu_busy_loop_s
CPU_ENGINE_ENV = "MOE_RL_VLLM_CPU_ENGINE"  # "1": a moe-rl RolloutEngine on CPU started this engine
ENGINE_ENV = "MOE_RL_VLLM_ENGINE"  # "1": a moe-rl RolloutEngine started this engine (CPU or GPU)


def register() -> None:
    if os.environ.get(ENGINE_ENV) == "1" and multiprocessing.current_process().name.startswith("EngineCore"):
        # vLLM loads this plugin in each of its processes: compat.vllm (an at-fork hook) only where asked
        from moe_rl.compat.vllm import trigger_shutdown_once

        trigger_shutdown_once()
    if os.environ.get(CPU_ENGINE_ENV) == "1" and multiprocessing.current_process().name.startswith(
        ("EngineCore", "VllmWorker")
    ):
        # The model already runs eagerly on CPU (enforce_eager); what vLLM still compiles is the sampler's rank count
        # (`batched_count_greater_than`, integer results either way), whose inductor compile took 1.4 of the first
        # rollout's 1.5 s. The engine processes only, never the trainer's: set before the worker imports torch, or
        # on dynamo's config where the engine was forked from a rank that had imported it.
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
        if "torch._dynamo" in sys.modules:  # an engine core forked from a rank (compat.vllm.engine_core_by_fork)
            sys.modules["torch._dynamo"].config.disable = True
        # vLLM loads this plugin in each of its processes: compat.vllm (an at-fork hook) only where asked
        from moe_rl.compat.vllm import bind_memory_only_across_numa_nodes

        bind_memory_only_across_numa_nodes()
    value = os.environ.get(BUSY_LOOP_ENV)
    if not value:
        return
    # vLLM loads this plugin in each of its processes: compat.vllm (an at-fork hook) only where asked
    from moe_rl.compat.vllm import shorten_busy_loop

    if not shorten_busy_loop(float(value)):
        print(
            f"[moe-rl] WARNING: rollout.cpu_busy_loop_s={value} not applied: this vLLM's shm_broadcast.SpinCondition "
            "has another signature than 0.32's (its engine processes spin for 1 s after each message)",
            file=sys.stderr,
            flush=True,
        )
