"""Where a rank's engine runs relative to its trainer (rollout.placement).

colocated: the engine shares the trainer's cores (GPU: its device); with off-policy rollouts the overlap
then only hides host work. separate (CPU): the rank's cores are split in two halves, the trainer's
threads pinned to the first; the engine's processes, the engine worker's OpenMP threads (vLLM's
VLLM_CPU_OMP_THREADS_BIND) and the trainer-side thread that drives generation to the second, so
generation and training run side by side. Under torchrun each local rank
takes an equal, consecutive share of the cores the launcher gave the node.
"""

from __future__ import annotations

import os

import torch


def rank_cores(local_rank: int, local_world: int) -> list[int]:
    """This local rank's share of the process's allowed cores."""
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // max(1, local_world)
    return cores[local_rank * per : (local_rank + 1) * per]


def split_cores(local_rank: int, local_world: int) -> tuple[list[int], list[int]]:
    """(trainer cores, engine cores) for rollout.placement=separate."""
    cores = rank_cores(local_rank, local_world)
    if len(cores) < 2:
        raise ValueError(
            f"rollout.placement=separate needs at least 2 cores per rank; local rank {local_rank} of {local_world} "
            f"has {len(cores)} of this node's {len(os.sched_getaffinity(0))}: use fewer ranks per node or "
            "rollout.placement=colocated"
        )
    half = len(cores) // 2
    return cores[:half], cores[half:]


def bind_engine(cores: list[int]) -> None:
    """The engine built next binds its worker's OpenMP threads to `cores` (call before building it)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))


def pin(trainer: list[int], engine: list[int]) -> None:
    """Pin every thread of this process (torch's intra-op pool included) to the trainer's cores and every
    thread of its child processes (the engine's, started before) to the engine's."""
    # heavy: psutil, imported on first use
    import psutil

    _pin_threads(os.getpid(), trainer)
    for child in psutil.Process().children(recursive=True):
        _pin_threads(child.pid, engine)
    torch.set_num_threads(len(trainer))


def pin_this_thread(cores: list[int]) -> None:
    """The calling thread (and threads it starts later) on `cores`: the thread that drives the engine's
    generate loop (request handling and detokenizing run in the caller's process)."""
    os.sched_setaffinity(0, cores)


def _pin_threads(pid: int, cores: list[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):  # a thread or process that ended meanwhile
            pass
