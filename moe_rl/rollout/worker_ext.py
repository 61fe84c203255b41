"""Methods that run inside vLLM's worker (`worker_extension_cls`; the engine core process runs a CPU engine's
one worker), called through `LLM.collective_rpc("moe_rl_...")`: route capture here, weight updates in
`moe_rl.rollout.weight_receiver.WeightReceiver` (mixed in). What they use of vLLM:

- `MoERunner.layer_id` and `BaseRouter.set_capture_fn` (fused_moe): the routed expert ids;
- `model.load_weights` and `model_loader.reload` (weight_sync.py).

Everything else they need is private to vLLM and goes through `moe_rl.compat.vllm`, the one
place for that: the model runner's request order per step (`on_prepare_inputs`), the CPU
backend's AMX permission (`request_amx_permission`), and for weight updates the CPU experts'
repack (`repack_cpu_experts`) and the reload-warning filter. Outside compat/, vLLM is imported
only here, in weight_sync.py (the receiver mixed in here) and in rollout/engine.py (`LLM` and
its request and error types).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from moe_rl.rollout.route_capture import RouteAssembler
from moe_rl.rollout.weight_receiver import WeightReceiver


class MoeRLWorkerExtension(WeightReceiver):
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's model runner."""

    def moe_rl_ping(self) -> int:
        return os.getpid()

    def moe_rl_init_worker(self) -> bool:
        """Per-process CPU setup (runs in each worker process, hence a method here)."""
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import flatten_cpu_rope_heads, keep_seeded_samples_across_chunks, request_amx_permission

        flatten_cpu_rope_heads(self.model_runner.model)
        keep_seeded_samples_across_chunks(self.model_runner)
        return request_amx_permission()

    def moe_rl_store_file(self) -> str | None:
        """The file of the worker's torch.distributed FileStore (vLLM's one-worker engines rendezvous through
        a file in the temp folder), which only its destructor removes: the reaper removes it once the
        engine's processes, killed at shutdown, are gone. None for other rendezvous."""
        init = self.distributed_init_method or ""
        return init.removeprefix("file://") if init.startswith("file://") else None

    def moe_rl_install_capture(self, moe_layers: list[int], topk: int, dtype: str) -> list[int]:
        # heavy: vLLM, imported on first use; compat.vllm registers an at-fork hook: imported where an engine runs
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        from moe_rl.compat.vllm import on_prepare_inputs

        runner = self.model_runner
        self._moe_rl_assembler = RouteAssembler(moe_layers, topk, np.dtype(dtype))
        on_prepare_inputs(runner, lambda *step: self._moe_rl_assembler.begin_step(*step))
        bound = []
        decoder_layers = runner.model_config.hf_config.num_hidden_layers
        for module in runner.model.modules():
            # Multi-token-prediction layers (DeepSeek num_nextn_predict_layers) are numbered after the
            # decoder's; they draft tokens and are never captured (their routes overwrote layer 0 for peers).
            if isinstance(module, MoERunner) and module.layer_id < decoder_layers:
                if not isinstance(module.router, BaseRouter):
                    raise RuntimeError(
                        f"layer {module.layer_id}: router {type(module.router).__name__} has no "
                        "capture hook; use native capture (GPU) instead"
                    )
                layer_id = module.layer_id

                def capture(topk_ids: torch.Tensor, layer_id=layer_id) -> None:
                    self._moe_rl_assembler.add_layer(layer_id, topk_ids.detach().cpu().numpy())

                module.router.set_capture_fn(capture)
                bound.append(layer_id)
        return bound

    def moe_rl_capture_request_ids(self) -> list[str]:
        return list(self._moe_rl_assembler.rows)

    def moe_rl_take_routes(
        self, rows_per_request: dict[str, int], partial: bool = False, keep_others: bool = False
    ) -> dict[str, tuple[bytes, tuple[int, ...], bytes | None]]:
        """Routes of the given requests as (bytes, shape, computed-mask bytes or None); everything else
        captured is dropped unless `keep_others` (requests still in flight). `partial`: positions served from the
        prefix cache are allowed (and masked)."""
        a = self._moe_rl_assembler
        out = {}
        try:
            for req, rows in rows_per_request.items():
                if partial:
                    arr, computed = a.take_partial(req, rows)
                    out[req] = (arr.tobytes(), arr.shape, computed.tobytes())
                else:
                    arr = a.take(req, rows)
                    out[req] = (arr.tobytes(), arr.shape, None)
        finally:
            if not keep_others:
                a.clear()
        return out
