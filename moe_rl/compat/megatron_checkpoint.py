"""Workaround for megatron-core's (0.16.x) torch_dist checkpoint writer: the one place that
reaches into its process-global state. Delete when upstream recreates a dead results queue."""

from __future__ import annotations


def drop_dead_results_queue() -> None:
    """megatron's torch_dist writer reports through one process-global multiprocessing Manager
    queue (filesystem_async._results_queue), created on the first save. If that manager process
    has died since (killed with other children of this process), every later save fails with
    BrokenPipeError; forget it so the writer starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is None:
        return
    try:
        queue.qsize()
    except (OSError, EOFError):
        filesystem_async._results_queue = None
