"""The engine side of the weight sync (moe_rl/weight_sync.py sends): mixed into the vLLM worker extension
(rollout/worker_ext.py), it loads each bucket of HF-named tensors into the engine's model. A bucket is raw bytes
and a manifest of (name, dtype name, shape, byte offset) per tensor; `bucket_tensors` reads it back, on either
side."""

from __future__ import annotations

import functools
import pickle
import time
from collections.abc import Iterator
from multiprocessing.connection import Listener

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from moe_rl.common.distributed import tensor_nbytes
from moe_rl.common.hf_names import ExpertStacker


def map_shared(path: str, nbytes: int) -> torch.Tensor:
    """The /dev/shm bucket file at `path` as a uint8 tensor sharing its memory."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def bucket_tensors(data: torch.Tensor, manifest: list) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) views of a bucket's bytes `data` that its manifest describes."""
    for name, dtype, shape, offset in manifest:
        n = tensor_nbytes(shape, dtype)
        yield name, data[offset : offset + n].view(getattr(torch, dtype)).view(shape)


def _under_vllm_config(method):
    """Run an engine-side update step under the worker's vLLM config, as vLLM runs its own weight updates
    (v1/worker/gpu_worker.py start/update/finish_weight_update): post-load kernel setup may read it."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        # heavy: vLLM, imported on first use
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.model_runner.vllm_config):
            return method(self, *args, **kwargs)

    return run


class WeightReceiver:
    """The engine side of the `rpc` transport, mixed into the vLLM worker extension (runs in the
    engine's worker process; `self.model_runner` is vLLM's).

    Updates use vLLM's layerwise reload (model_loader/reload): kernels that repack weights after
    loading (e.g. the CPU MoE path) drop the parameters' `weight_loader`, so a second plain
    `load_weights` fails; the reload restores the checkpoint-format parameters, loads, and
    re-runs each layer's post-load processing once all its tensors arrived."""

    def moe_rl_check_weight_update(self) -> bool:
        """Refuse an engine whose weights this path cannot update (also at the start of every update)."""
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import refuse_padded_cpu_experts

        refuse_padded_cpu_experts(self.model_runner.get_model())
        return True

    def moe_rl_expect_partial_updates(self) -> bool:
        """From now on an update may carry some layers only (a LoRA actor sends the linears its adapters changed,
        whole: every tensor of each vLLM layer it touches); the others keep their weights."""
        self._moe_rl_partial = True
        return True

    @_under_vllm_config
    def moe_rl_begin_weight_update(self) -> bool:
        # heavy: vLLM, imported on first use; compat.vllm registers an at-fork hook: imported where an engine runs
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from moe_rl.compat.vllm import quiet_cache_only_reload_warning

        self.moe_rl_check_weight_update()  # before anything is loaded
        model = self.model_runner.get_model()
        # a rotary layer's cache is never loaded (see the filter); a layer with parameters that loads nothing is
        # remembered, and the finish refuses it
        self._moe_rl_reload_log = quiet_cache_only_reload_warning(model)
        self._moe_rl_reload_log.partial = getattr(self, "_moe_rl_partial", False)
        self._moe_rl_reload_log.take()
        initialize_layerwise_reload(model)
        self._moe_rl_stacker = ExpertStacker()  # GPT-OSS: experts come one by one, vLLM loads them stacked
        return True

    def _moe_rl_load(self, tensors) -> None:
        """Load (name, tensor) pairs, expert slices once their stacked tensor is whole."""
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import gpt_oss_direct_tensors

        stacker, model = self._moe_rl_stacker, self.model_runner.get_model()
        whole = gpt_oss_direct_tensors(model, [item for name, t in tensors for item in stacker.add(name, t)])
        if whole:
            model.load_weights(weights=whole)

    @_under_vllm_config
    def moe_rl_load_weights(self, payload: bytes) -> int:
        """Load one bucket of HF-named tensors (a safetensors blob) into the model."""
        # heavy: safetensors, imported on first use
        from safetensors.torch import load

        tensors = load(payload)
        self._moe_rl_load(tensors.items())
        return len(tensors)

    @_under_vllm_config
    def moe_rl_load_shm_stream(self, address: str, key: bytes) -> dict:
        """One whole weight update (begin, buckets, finish) from the buckets the leader announces on this
        worker's socket (`_ShmStream`) as (shared-memory file, its size, manifest), until it says None: copy
        each out of the mapping (the layerwise reload keeps a layer's tensors until all of them arrived,
        possibly in a later bucket), acknowledge (the leader then reuses the buffer), load it while the leader
        writes the next. Returns the tensors loaded, the seconds spent in vLLM's load and finish, and in the
        CPU experts' repack (part of the finish)."""
        self.moe_rl_begin_weight_update()  # refuses before listening: the leader gets the error, not a hang
        loaded, seconds = 0, 0.0
        with Listener(f"{address}.{self.rank}", family="AF_UNIX", authkey=key) as listener:
            with listener.accept() as conn:
                while (bucket := conn.recv()) is not None:
                    path, nbytes, manifest = bucket
                    tensors = [(name, t.clone()) for name, t in bucket_tensors(map_shared(path, nbytes), manifest)]
                    conn.send(len(tensors))
                    t0 = time.perf_counter()
                    self._moe_rl_load(tensors)
                    seconds += time.perf_counter() - t0
                    loaded += len(tensors)
        t0 = time.perf_counter()
        repack = self.moe_rl_finish_weight_update()
        return {"tensors": loaded, "load_seconds": seconds + time.perf_counter() - t0, "repack_seconds": repack}

    @_under_vllm_config
    def moe_rl_load_cuda_ipc(self, payload: bytes, manifest: list) -> int:
        """Load one bucket from the leader's device buffer (cuda_ipc). `payload`: the
        pickled {GPU UUID: the buffer's `reduce_tensor` arguments}; rebuilt on this worker's device index as
        vLLM's IPCWeightTransferEngine does, then copied out like the shm bucket (the leader reuses the buffer
        once this returns, so the copies are waited for)."""
        handles = pickle.loads(payload)  # from the trainer's leader rank, as vLLM's IPC engine trusts it
        index = self.device.index
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        if uuid not in handles:
            raise ValueError(
                f"weight sync (cuda_ipc): this engine worker's GPU {uuid} is not the leader's {list(handles)}; "
                "cuda_ipc needs the engine on its leader's device (rollout.tensor_parallel_size=1, colocated)"
            )
        args = list(handles[uuid])
        args[6] = index  # reduce_tensor's device index, as this process numbers the device
        data = rebuild_cuda_tensor(*args)
        tensors = [(name, t.clone()) for name, t in bucket_tensors(data, manifest)]
        torch.cuda.current_stream().synchronize()  # copied out before the leader writes the next bucket
        del data
        self._moe_rl_load(tensors)
        return len(tensors)

    @_under_vllm_config
    def moe_rl_finish_weight_update(self) -> float:
        """Finish the layerwise reload; the seconds the CPU experts' repack took (0 without CPU experts)."""
        # heavy: vLLM, imported on first use; compat.vllm registers an at-fork hook: imported where an engine runs
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        from moe_rl.compat.vllm import repack_cpu_experts, retie_shared_heads

        self._moe_rl_stacker.finish()
        runner = self.model_runner
        model = runner.get_model()
        finalize_layerwise_reload(model, runner.vllm_config.model_config)
        retie_shared_heads(model)  # a tied LM head: its weight came through the embedding
        failed = self._moe_rl_reload_log.take()
        if failed and not getattr(self, "_moe_rl_partial", False):
            raise RuntimeError(
                f"weight sync: vLLM loaded nothing into {sorted(set(failed))} and would keep serving their old weights "
                "(a loader that copies past vLLM's layerwise reload, as GPT-OSS's did: moe_rl/compat/vllm.py)"
            )
        t0 = time.perf_counter()
        repack_cpu_experts(model)
        return time.perf_counter() - t0
