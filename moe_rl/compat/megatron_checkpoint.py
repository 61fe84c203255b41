"""Workaround for megatron-core's (0.16.x) torch_dist checkpoint writer: the one place that
reaches into its process-global state. Delete when upstream lets a synchronous save report
its write results without a Manager process."""

from __future__ import annotations

import queue


def results_in_this_process() -> None:
    """megatron's torch_dist writer reports its write results through one process-global queue
    (filesystem_async._results_queue), by default a queue of a spawned multiprocessing Manager: a
    process that imports torch to unpickle the results (about 5 s of CPU per rank, on every run's
    first save here, docs/performance.md), and that breaks every later save with BrokenPipeError if
    it dies (killed with other children of this process). moe-rl saves synchronously
    (`dist_checkpointing.save` without async_sharded_save): the results are put and taken in this
    process, so a plain in-process queue carries them. A new one per save: nothing a failed save
    left behind can be read by the next."""
    # heavy: megatron-core, imported on first use
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()
