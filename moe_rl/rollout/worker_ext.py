"""Methods that run inside vLLM's worker process (`worker_extension_cls`), called through
`LLM.collective_rpc("moe_rl_...")`. This file and `route_capture.py` are the only places that
reach into vLLM internals; each reach names what it needs:

- `model_runner._prepare_inputs(scheduler_output, num_scheduled_tokens)` (V1 GPU/CPU model
  runner): the step's request order (`input_batch.req_ids`), token counts and start
  positions (`input_batch.num_computed_tokens_cpu`);
- `MoERunner.layer_id` and `BaseRouter.set_capture_fn` (fused_moe): the routed expert ids;
- `model.load_weights(iterable of (HF name, tensor))`: weight updates.
"""

from __future__ import annotations

import os

import numpy as np


class MoeRLWorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is the worker's model runner."""

    def moe_rl_ping(self) -> int:
        return os.getpid()

    def moe_rl_init_worker(self) -> bool:
        """Per-process CPU setup. vLLM's CPU attention picks its AMX kernels for bf16 when the
        CPU has AMX tiles (`cpu_attn._get_attn_isa`) but never asks the kernel for permission to
        use them (arch_prctl ARCH_REQ_XCOMP_PERM); the first bf16 forward then dies with SIGILL.
        `torch.cpu._init_amx()` makes that request for this process."""
        import torch

        if not torch.cuda.is_available() and torch.cpu._is_amx_tile_supported():
            return bool(torch.cpu._init_amx())
        return True

    def moe_rl_install_capture(self, moe_layers: list[int], topk: int, dtype: str) -> list[int]:
        import torch
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        from moe_rl.rollout.route_capture import RouteAssembler

        runner = self.model_runner
        assembler = RouteAssembler(moe_layers, topk, np.dtype(dtype))
        self._moe_rl_assembler = assembler
        if not getattr(runner, "_moe_rl_wrapped", False):
            orig = runner._prepare_inputs

            def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
                batch = runner.input_batch
                n = batch.num_reqs
                self._moe_rl_assembler.begin_step(
                    list(batch.req_ids[:n]),
                    [int(x) for x in num_scheduled_tokens[:n]],
                    [int(x) for x in batch.num_computed_tokens_cpu[:n]],
                )
                return orig(scheduler_output, num_scheduled_tokens, *args, **kwargs)

            runner._prepare_inputs = prepare_inputs
            runner._moe_rl_wrapped = True
        bound = []
        for module in runner.model.modules():
            if isinstance(module, MoERunner):
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

    def moe_rl_take_routes(self, rows_per_request: dict[str, int]) -> dict[str, tuple[bytes, tuple[int, ...]]]:
        """Routes of the given requests as (bytes, shape); everything else captured is dropped."""
        a = self._moe_rl_assembler
        out = {}
        try:
            for req, rows in rows_per_request.items():
                arr = a.take(req, rows)
                out[req] = (arr.tobytes(), arr.shape)
        finally:
            a.clear()
        return out

    # Weight updates use vLLM's layerwise reload (model_loader/reload): kernels that repack
    # weights after loading (e.g. the CPU MoE path) drop the parameters' `weight_loader`, so a
    # second plain `load_weights` fails; the reload restores the checkpoint-format parameters,
    # loads, and re-runs each layer's post-load processing once all its tensors arrived.
    def moe_rl_begin_weight_update(self) -> bool:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())
        return True

    def moe_rl_load_weights(self, payload: bytes) -> int:
        """Load one bucket of HF-named tensors (a safetensors blob) into the model."""
        from safetensors.torch import load

        tensors = load(payload)
        self.model_runner.get_model().load_weights(weights=tensors.items())
        return len(tensors)

    def moe_rl_finish_weight_update(self) -> bool:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        runner = self.model_runner
        model = runner.get_model()
        finalize_layerwise_reload(model, runner.vllm_config.model_config)
        # vLLM 0.32 bug: on a weight update UnquantizedFusedMoEMethod._setup_kernel skips
        # `fused_experts.process_weights_after_loading`, which is where the CPU experts
        # (experts/cpu_moe.py) pad and prepack w13/w2 into their grouped-GEMM layout; the
        # reloaded weights stay in checkpoint layout and the kernel reads garbage. Re-run it.
        # Remove when `is_weight_update` re-runs the experts' post-load step upstream.
        for module in model.modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and type(experts).__module__.endswith("experts.cpu_moe"):
                experts.process_weights_after_loading(module)
        return True
