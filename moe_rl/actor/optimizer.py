"""megatron-core's optimizer for the actor: one optimizer (torch AdamW inside) for dense parameters and one for
expert parameters, chained so that gradients are clipped by their joint norm (megatron's ChainedOptimizer), and
checkpointed through their sharded state dicts. fp32 parameters: megatron's FP32Optimizer on the parameters
themselves. bf16 parameters: megatron's Float16OptimizerWithFloat16Params, as on a GPU: AdamW updates fp32 master
weights from fp32 copies of the gradients and the bf16 parameters are refreshed from them, so an update smaller than
half a bf16 step accumulates instead of being rounded away.

As megatron's `get_megatron_optimizer` splits them (experts recognised by name): dense grad
statistics reduce over the model-parallel group, expert ones over the expert tensor/model/pipeline group, with the
expert-tensor-parallel group deciding which expert grads are duplicates. It is built here
without megatron's DDP wrapper because on CPU gradients are synchronised by
`train_step.sync_gradients` (gloo). GPU (`actor.distributed_optimizer`): megatron's DDP gradient
buffers and distributed optimizer (`build_distributed_optimizer`), optionally with a share of its states in host
memory and updated on the CPU (`actor.optimizer_offload`: megatron's HybridDeviceOptimizer).
"""

from __future__ import annotations

import torch

from moe_rl.compat.megatron_cpu import float16_optimizer


def is_expert(name: str) -> bool:
    """A routed expert's parameter (megatron names them `...mlp.experts...`)."""
    return ".mlp.experts." in name


def init_adam_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Zero Adam state for every parameter (megatron's init_state_fn: the sharded layout must
    exist before a checkpoint is loaded into it)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def build_optimizer(chunks: list[torch.nn.Module], lr: float, weight_decay: float = 0.0, grad_clip: float = 1.0):
    """megatron ChainedOptimizer over [dense, expert] optimizers: FP32Optimizers for fp32 parameters,
    Float16OptimizerWithFloat16Params (fp32 master weights) for bf16 ones. `step()` returns (success, grad norm
    before clipping, None); grad_clip=0 disables clipping."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    named = [(n, p) for c in chunks for n, p in c.named_parameters() if p.requires_grad]
    bf16 = any(p.dtype == torch.bfloat16 for _, p in named)
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=grad_clip,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    # Experts by name, not by megatron's allreduce=False (set only when EP > 1): under TP > 1 with
    # ETP = 1 the experts are replicated over TP, and counting them in the dense optimizer's
    # model-parallel norm would add each TP rank's copy.
    dense = [p for n, p in named if not is_expert(n)]
    expert = [p for n, p in named if is_expert(n)]
    parts = []
    for group, experts, stats_group, tp_group in (
        (dense, False, ps.get_model_parallel_group(), ps.get_tensor_model_parallel_group()),
        (expert, True, ps.get_expert_tensor_model_pipeline_parallel_group(), ps.get_expert_tensor_parallel_group()),
    ):
        if not group:
            continue
        # the keys megatron's checkpoint loading matches param groups by
        keys = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": experts, "is_decoupled_lr": False}
        adam = torch.optim.AdamW(
            [{"params": group, **keys}],
            lr=lr,
            weight_decay=weight_decay,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
        )
        opt = float16_optimizer(adam, config, init_adam_state) if bf16 else FP32Optimizer(adam, config, init_adam_state)
        opt.grad_stats_parallel_group = stats_group
        opt.tp_group = tp_group
        parts.append(opt)
    return ChainedOptimizer(parts)


def offload_options(offload) -> dict:
    """megatron OptimizerConfig's CPU-offload fields for `actor.optimizer_offload` (moe_rl.actor.config
    .OptimizerOffloadConfig); none when its fraction is 0. megatron builds the HybridDeviceOptimizer on the path of
    use_precision_aware_optimizer (Megatron-LM's arguments require the two together): the fp32 master weights are then
    the hybrid optimizer's own, on the host for the offloaded share, instead of the distributed optimizer's on the
    GPU."""
    if offload is None or not offload.fraction > 0:
        return {}
    return {
        "optimizer_cpu_offload": True,
        "optimizer_offload_fraction": float(offload.fraction),
        "overlap_cpu_optimizer_d2h_h2d": bool(offload.overlap),
        "use_precision_aware_optimizer": True,
    }


def build_distributed_optimizer(
    chunks: list[torch.nn.Module], lr: float, weight_decay: float, grad_clip: float, offload=None
):
    """GPU: the chunks wrapped in megatron's DistributedDataParallel (gradients in contiguous buffers, reduced
    by `finalize_model_grads`) and `get_megatron_optimizer`'s distributed optimizer (Adam state sharded over
    data-parallel ranks). Returns (ddp_chunks, optimizer); the chunks stay what the forward runs (the DDP
    hooks sit on their parameters).

    Losses here are already divided by the global token/sequence counts, so gradients are summed over
    data-parallel ranks (`calculate_per_token_loss`: megatron then scales by 1, not 1/DP). `offload`:
    actor.optimizer_offload (`offload_options`)."""
    # heavy: megatron-core, imported on first use
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=False, overlap_param_gather=False
    )
    config = chunks[0].config
    config.calculate_per_token_loss = True  # sum, not average (see above); one config object for every chunk
    ddp = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        clip_grad=grad_clip,
        bf16=config.bf16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=True,
        **offload_options(offload),
    )
    return ddp, get_megatron_optimizer(opt_config, ddp)


def build_actor_optimizer(chunks: list[torch.nn.Module], actor) -> tuple:
    """(DDP wrappers or None, optimizer) of the actor's chunks from its config section (moe_rl.config.ActorConfig):
    the distributed optimizer (with actor.optimizer_offload) under actor.distributed_optimizer, else the CPU path's."""
    a = actor
    if a.distributed_optimizer:
        return build_distributed_optimizer(chunks, a.lr, a.weight_decay, a.grad_clip, a.optimizer_offload)
    return None, build_optimizer(chunks, a.lr, a.weight_decay, a.grad_clip)
