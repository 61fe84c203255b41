"""Process groups for the Megatron actor: torch.distributed init and megatron-core parallel state."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_rl.actor.config import COLLECTIVE_TIMEOUT_S, ParallelConfig
from moe_rl.compat.megatron_cpu import apply_cpu_shims, cpu_model_parallel_seed
from moe_rl.compat.versions import check_versions


def torchrun_store(timeout: timedelta):
    """A client of the store torchrun's agent keeps for the job (it outlives the ranks of an attempt); None when the
    ranks were not started by torchrun's agent."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


def _attempt_store(timeout: timedelta):
    """Under torchrun, its agent's store with this attempt's keys apart (None elsewhere: init_process_group's env://).

    The agent's store outlives its workers. After a restart (`torchrun --max-restarts`), the new ranks found the
    old attempt's gloo addresses there and failed to connect: 3 of 3 restarted training jobs, and 4 of 8 restarts of
    a bare 2-rank gloo script (8 of 8 connected with this prefix). torch's rendezvous prefixed the keys per attempt
    before it shared its store (pytorch/pytorch#135712). Across nodes each agent counts its own restarts, so the
    prefix only separates attempts that every agent restarts alike (one node: always)."""
    if (store := torchrun_store(timeout)) is None:
        return None
    return dist.PrefixStore(f"moe_rl/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def init_distributed(parallel: ParallelConfig, seed: int = 1234, timeout_s: int = COLLECTIVE_TIMEOUT_S) -> None:
    """Initialise torch.distributed (gloo on CPU, nccl on GPU) and megatron-core's groups.

    Works under `torchrun` (reads RANK/WORLD_SIZE/MASTER_ADDR) and standalone (world of 1).
    """
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    check_versions()  # the patches of megatron-core and vLLM (moe_rl/compat): once per process
    on_cpu = apply_cpu_shims()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        # On GPU both: NCCL for megatron's CUDA tensors, gloo for the small CPU tensors the loop reduces (metrics,
        # world_max, all_finite, signals) and the weight sync's CPU point-to-point; NCCL alone refuses those.
        backend = "gloo" if on_cpu else "cpu:gloo,cuda:nccl"
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = timedelta(seconds=timeout_s)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend=backend, timeout=timeout, store=_attempt_store(timeout), rank=rank, world_size=world
        )
    world = dist.get_world_size()
    parallel.data_parallel_size(world)  # raises a clear error for an impossible layout
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        create_gloo_process_groups=not on_cpu,
    )
    if on_cpu:
        cpu_model_parallel_seed(seed)
    else:
        # heavy: megatron-core, imported on first use
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on localhost now (a rendezvous for a process group of our own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
