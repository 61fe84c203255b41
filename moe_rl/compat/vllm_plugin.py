"""moe-rl's vLLM general plugin (setup.py entry point `vllm.general_plugins`): vLLM loads it in every process it
starts — the engine core and each worker, where the settings below take effect. It changes nothing unless a
moe-rl RolloutEngine started the engine and set the variables (rollout/engine.py `_set_vllm_cpu_env`)."""

from __future__ import annotations

import os
import sys

BUSY_LOOP_ENV = "MOE_RL_VLLM_BUSY_LOOP_S"  # rollout.cpu_busy_loop_s


def register() -> None:
    value = os.environ.get(BUSY_LOOP_ENV)
    if not value:
        return
    from moe_rl.compat.vllm import shorten_busy_loop

    if not shorten_busy_loop(float(value)):
        print(
            f"[moe-rl] WARNING: rollout.cpu_busy_loop_s={value} not applied: this vLLM's shm_broadcast.SpinCondition "
            "has another signature than 0.32's (its engine processes spin for 1 s after each message)",
            file=sys.stderr,
            flush=True,
        )
