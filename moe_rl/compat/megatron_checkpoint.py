"""Workarounds for megatron-core's (0.16.x) checkpointing: the one place that reaches into its torch_dist writer's
process-global state and its optimizers' parameter mapping. Delete each when upstream stops needing it."""

from __future__ import annotations

import functools
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
