"""Weight sync: the actor's updated weights into the rollout engine, once per step.

Phases: gather (`Actor.iter_weights`: HF-named full tensors; collective over the actor's
groups) -> send in buckets of at most `rollout.weight_sync_bucket_mb` -> finish (the engine
re-runs each layer's post-load processing). Transport `rpc` (CPU): each bucket is a
safetensors blob passed through vLLM's `collective_rpc` to `WeightReceiver`, which the engine's
worker extension mixes in. `cuda_ipc` (GPU) is not implemented yet.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch


class WeightSync:
    """actor -> engines, after every update and after a resume (the trainer has none without
    engines: from_dump). Every rank gathers (the weights' owners are spread over the layout);
    ranks that lead an engine push, the others (`engine` None) only take part in the gathers."""

    def __init__(self, actor, engine):
        self.actor, self.engine = actor, engine

    def __call__(self) -> dict[str, float]:
        named = self.actor.iter_weights()
        try:
            return {} if self.engine is None else push_weights(self.engine, named)
        finally:
            for _ in named:  # to the end, even when the push failed: the gathers are collective
                pass


def push_weights(engine, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Load HF-named tensors into a RolloutEngine in buckets of <= rollout.weight_sync_bucket_mb over
    rollout.weight_transport; returns bytes, tensors, buckets and seconds."""
    from safetensors.torch import save

    from moe_rl.rollout.engine import RolloutEngineError

    bucket_mb, transport = engine.cfg.weight_sync_bucket_mb, engine.cfg.weight_transport
    if transport != "rpc":
        raise NotImplementedError(
            f"rollout.weight_transport={transport!r} is not implemented on this build (GPU path not yet run); use rpc"
        )
    t0 = time.perf_counter()
    n_bytes = n_tensors = n_buckets = 0
    engine.rpc("moe_rl_begin_weight_update")
    for bucket in buckets(named_tensors, bucket_mb * 2**20):
        payload = save({k: v.detach().to("cpu").contiguous() for k, v in bucket})
        loaded = engine.rpc("moe_rl_load_weights", payload)
        if any(n != len(bucket) for n in loaded):
            raise RolloutEngineError(f"weight sync: engine loaded {loaded} of {len(bucket)} tensors")
        n_bytes += sum(v.numel() * v.element_size() for _, v in bucket)
        n_tensors += len(bucket)
        n_buckets += 1
    engine.rpc("moe_rl_finish_weight_update")
    return {"bytes": n_bytes, "tensors": n_tensors, "buckets": n_buckets, "seconds": time.perf_counter() - t0}


def buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most `limit` bytes (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


class WeightReceiver:
    """The engine side of the `rpc` transport, mixed into the vLLM worker extension (runs in the
    engine's worker process; `self.model_runner` is vLLM's).

    Updates use vLLM's layerwise reload (model_loader/reload): kernels that repack weights after
    loading (e.g. the CPU MoE path) drop the parameters' `weight_loader`, so a second plain
    `load_weights` fails; the reload restores the checkpoint-format parameters, loads, and
    re-runs each layer's post-load processing once all its tensors arrived."""

    def moe_rl_begin_weight_update(self) -> bool:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from moe_rl.compat.vllm import quiet_cache_only_reload_warning

        model = self.model_runner.get_model()
        quiet_cache_only_reload_warning(model)  # a rotary layer's cache is never loaded (see the filter)
        initialize_layerwise_reload(model)
        return True

    def moe_rl_load_weights(self, payload: bytes) -> int:
        """Load one bucket of HF-named tensors (a safetensors blob) into the model."""
        from safetensors.torch import load

        tensors = load(payload)
        self.model_runner.get_model().load_weights(weights=tensors.items())
        return len(tensors)

    def moe_rl_finish_weight_update(self) -> bool:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from moe_rl.compat.vllm import repack_cpu_experts

        runner = self.model_runner
        model = runner.get_model()
        finalize_layerwise_reload(model, runner.vllm_config.model_config)
        repack_cpu_experts(model)
        return True
