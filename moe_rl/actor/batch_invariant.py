"""trainer.true_on_policy on GPU: both sides run batch-invariant kernels.

On CPU the mode reproduces the engine's own ops (`engine_ops`). On CUDA it instead asks each library
for kernels whose reductions do not depend on the batch: the engine runs with `VLLM_BATCH_INVARIANT=1`
(vLLM's persistent matmul, log_softmax, mean and RMSNorm kernels and its attention backends with one
KV split; compute capability >= 8.0), the actor with megatron-core's `batch_invariant_mode` (Transformer
Engine FlashAttention with one split) and its `enable_batch_invariant_mode` (aten mm, addmm, _log_softmax,
mean.dim and TE's GEMM and RMSNorm routed through Triton kernels adapted from the same Thinking Machines
batch_invariant_ops). Log-probs take the full-vocabulary path (fused kernel off) as the engine does.
Whether the two sides then agree bit for bit is what `mismatch/exact_fraction` measures each step.
"""

from __future__ import annotations


def engine_environment() -> dict[str, str]:
    """What the rollout engine needs (read by vllm.envs when the engine starts)."""
    return {"VLLM_BATCH_INVARIANT": "1"}


def transformer_config_kwargs() -> dict:
    """megatron-core TransformerConfig settings of the mode (its post-init refuses the flag with any
    attention backend but flash)."""
    # heavy: megatron-core, imported on first use
    from megatron.core.transformer.enums import AttnBackend

    return {"batch_invariant_mode": True, "attention_backend": AttnBackend.flash}


def enable() -> None:
    """Route aten and TE kernels through megatron's batch-invariant ones, process-wide: every actor pass
    (old log-probs, the update, the reference) then reduces in one order whatever its batch."""
    try:
        # heavy: megatron-core, imported on first use
        from megatron.core.transformer.custom_layers.batch_invariant_kernels import enable_batch_invariant_mode
    except ImportError as e:
        # heavy: megatron-core, imported on first use
        import megatron.core

        raise RuntimeError(
            f"trainer.true_on_policy on GPU needs megatron-core's batch-invariant kernels; megatron-core "
            f"{megatron.core.__version__} has none (megatron/core/transformer/custom_layers/batch_invariant_kernels.py)"
        ) from e
    enable_batch_invariant_mode()
