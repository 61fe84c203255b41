"""Norm modules for the local (non-Transformer-Engine) layer spec.

megatron-core's local spec uses `WrappedTorchNorm`, which refuses sequence parallel; MoE with
tensor parallel needs sequence parallel. These norms take megatron's `(config, hidden_size, eps)`
signature and mark their parameters so megatron all-reduces their gradients over TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, sum_sq: torch.Tensor | None = None, width: int | None = None
) -> torch.Tensor:
    # Same arithmetic as HF's RMSNorm: statistics in fp32, gain applied in the input dtype.
    dtype = x.dtype
    xf = x.float()
    if sum_sq is None:
        variance = xf.pow(2).mean(-1, keepdim=True)
    else:
        variance = sum_sq / width
    return weight * (xf * torch.rsqrt(variance + eps)).to(dtype)


class RMSNorm(torch.nn.Module):
    """RMSNorm over the last dim; parameters flagged `sequence_parallel` when SP is on."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Read by megatron's finalize_model_grads: grads of this weight are summed over TP ranks,
        # each of which saw a different slice of the sequence (or of the heads, for q/k norms).
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


class _FullWidthNorm(torch.nn.Module):
    """RMSNorm over all heads of q (or k) at once, as OLMoE does (`q_norm(q_proj(x))`).

    megatron's attention calls q/k norms per head on `[s, b, heads_local, head_dim]`; this
    norm flattens the heads, reduces the sum of squares over TP ranks (heads are TP-sharded)
    and keeps its weight TP-sharded like the heads.
    """

    heads_attr: str = ""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        self.eps = eps
        self.tp = ps.get_tensor_model_parallel_world_size()
        heads = getattr(config, self.heads_attr) or config.num_attention_heads
        self.width = heads * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(self.width // self.tp, dtype=config.params_dtype))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        self.weight.partition_stride = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # heavy: megatron-core, imported on first use
        from megatron.core import parallel_state as ps

        shape = x.shape
        flat = x.reshape(*shape[:-2], shape[-2] * shape[-1])
        sum_sq = flat.float().pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            # Autograd-aware all-reduce: the statistic depends on every rank's heads.
            sum_sq = dist.nn.functional.all_reduce(sum_sq, group=ps.get_tensor_model_parallel_group())
        return _rms_norm(flat, self.weight, self.eps, sum_sq=sum_sq, width=self.width).reshape(shape)


class FullWidthQNorm(_FullWidthNorm):
    heads_attr = "num_attention_heads"


class FullWidthKNorm(_FullWidthNorm):
    heads_attr = "num_query_groups"
