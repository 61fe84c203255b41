"""Workarounds for megatron-core's (0.16.x) checkpointing: the one place that reaches into its torch_dist writer's
process-global state and its optimizers' parameter mapping. Delete each when upstream stops needing it."""

from __future__ import annotations

import functools
import queue


def writes_in_this_process() -> None:
    """Called before each save. megatron's torch_dist writer (filesystem_async.FileSystemWriterAsync) forks a process
    per file it writes (2 per `dist_checkpointing.save` on each rank: the model's and the optimizer's 4 a checkpoint),
    so that an asynchronous save can go on beside training. moe-rl saves synchronously (`dist_checkpointing.save`
    without async_sharded_save), where the forks only cost: forking a rank that holds torch, vLLM and the model
    took about 0.7 s of CPU over the default run's 3 checkpoints (docs/performance.md). Here the same per-file
    function (`write_preloaded_data`: the same bytes, fsync'd) runs in this process, file after file, and reports
    its results as the forked workers did.

    The writer reports through one process-global queue (filesystem_async._results_queue), by default a queue of a
    spawned multiprocessing Manager: a process that imports torch to unpickle the results (about 5 s of CPU per rank
    on every run's first save here), and that breaks every later save with BrokenPipeError if it dies (killed with
    other children of this process). Written and read in this process, a plain queue carries them: a new one per
    save, so nothing a failed save left behind can be read by the next."""
    # heavy: megatron-core, imported on first use
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = queue.Queue()
    writer = filesystem_async.FileSystemWriterAsync
    if getattr(writer.write_preloaded_data_multiproc, "in_this_process", False):
        return

    def write_in_this_process(transform_list, use_msc, rank, write_buckets, global_results_queue) -> None:
        results: queue.Queue = queue.Queue()
        done: queue.Queue = queue.Queue()  # the workers' count queue: each takes one item and marks it done
        outcome: dict | Exception = {}
        for i, bucket in enumerate(write_buckets):
            done.put(i)
            writer.write_preloaded_data(
                transform_list, i, bucket, results, done, True, **({"use_msc": True} if use_msc else {})
            )
            index, written = results.get_nowait()
            if isinstance(written, Exception):
                outcome = written
                break
            outcome[index] = written
        global_results_queue.put(outcome)

    write_in_this_process.in_this_process = True
    writer.write_preloaded_data_multiproc = staticmethod(write_in_this_process)


def optimizers_map_their_own_parameters() -> None:
    """megatron's FP32Optimizer and Float16OptimizerWithFloat16Params find their parameters' sharded tensors with
    `get_param_id_to_sharded_param_map(model_sharded_state_dict, params)`, which formats every model tensor the
    optimizer does not hold into a debug message (an f-string: built whether or not debug logging is on). moe-rl
    chains a dense and an expert optimizer, so each optimizer's part of every save and load printed the other's
    parameters in full: about 30 tensor reprs per save on the built-in model (29 ms of a 0.6 s save, float32), and the
    only work an optimizer save did on the parameters themselves (a repr makes views of them; the rare rank-0 save
    failure "Attempted to make a tensor into a differentiable view" stopped a run in its optimizer's write at least
    once, cause not found). Here each optimizer is shown the model tensors of its own parameters only: the same
    mapping, nothing formatted. Idempotent."""
    # heavy: megatron-core, imported on first use
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.optimizer import optimizer as megatron_optimizer

    original = megatron_optimizer.get_param_id_to_sharded_param_map
    if getattr(original, "own_parameters_only", False):
        return

    @functools.wraps(original)
    def own_parameters_only(model_sharded_state_dict, optim_params_iter):
        params = list(optim_params_iter)  # their order numbers the optimizer's state
        ids = {id(p) for p in params}

        def held(v) -> bool:
            return isinstance(v, (ShardedTensor, ShardedTensorFactory)) and id(v.data) in ids

        own, _ = extract_matching_values(model_sharded_state_dict, held)
        return original(own, params)

    own_parameters_only.own_parameters_only = True
    megatron_optimizer.get_param_id_to_sharded_param_map = own_parameters_only
