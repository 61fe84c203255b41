"""vLLM's CPU kernels for the actor's engine-op forward (trainer.true_on_policy, actor/engine_ops.py): the private
`vllm._custom_ops` and the IR ops, loaded here so that the actor imports no vLLM module itself. Importing this module
loads nothing (each function imports vLLM on first use)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType


def custom_ops() -> ModuleType:
    """`vllm._custom_ops` (onednn_mm, cpu_fused_moe, cpu_attention_with_kv_cache, rotary_embedding, ...): the
    Python wrappers of vLLM's compiled ops."""
    # heavy: vLLM, imported on first use
    import vllm._custom_ops as ops  # loads torch.ops._C

    return ops


def native_rms_norms() -> tuple[Callable, Callable]:
    """vLLM IR's `rms_norm` and `fused_add_rms_norm`, native provider (torch, fp32 inside): (rms, fused_add_rms)."""
    # heavy: vLLM, imported on first use
    import vllm.ir.ops  # noqa: F401  registers the IR ops
    from vllm import ir

    return ir.ops.rms_norm.impls["native"].impl_fn, ir.ops.fused_add_rms_norm.impls["native"].impl_fn


def vllm_version() -> str:
    """`vllm.__version__` of the vLLM this process imports."""
    # heavy: vLLM, imported on first use
    import vllm

    return vllm.__version__
