"""The engine worker as the tests see it: moe-rl's worker extension plus probes of the worker process's state,
started by `tests.engine.conftest.start_engine` (RolloutEngine's `worker_extension`)."""

from __future__ import annotations

import gc
import signal

import torch._dynamo
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
from vllm.v1.sample.ops.logprobs import batched_count_greater_than

from moe_rl.compat import vllm as compat_vllm
from moe_rl.rollout.worker_ext import MoeRLWorkerExtension


class ProbeExtension(MoeRLWorkerExtension):
    def moe_rl_busy_loop_s(self) -> list[float]:
        """The spin time of this worker's shared-memory message-queue readers (rollout.cpu_busy_loop_s)."""
        # type(), not isinstance(): the heap holds weak proxies, and isinstance() on a dead one raises ReferenceError
        return [o.busy_loop_s for o in gc.get_objects() if type(o) is SpinCondition and o.is_reader]

    def moe_rl_sampler_compiled(self) -> bool:
        """Whether this worker compiles its sampler's rank count with torch.compile (moe-rl's plugin: not on CPU). A
        forked engine inherits the function as its rank wrapped it; dynamo's disable flag then runs it eagerly."""
        return hasattr(batched_count_greater_than, "_torchdynamo_orig_callable") and not torch._dynamo.config.disable

    def moe_rl_forked_from_trainer(self) -> bool:
        """Whether this process was forked from a trainer rank (rollout.cpu_start_method=fork), which set the rank's
        torch.distributed world aside as it started (compat.vllm.engine_core_by_fork)."""
        return bool(compat_vllm._INHERITED_WORLDS)

    def moe_rl_signal_handler(self, name: str) -> str:
        """This process's handler of signal `name` (e.g. "SIGUSR1"): a forked engine does not keep the trainer's."""
        return str(signal.getsignal(getattr(signal, name)))

    def moe_rl_head_logits(self, seed: int) -> tuple[str, float, float]:
        """The model's logits for random hidden states (in the engine's dtype), against the same product summed and
        kept in fp32: (logits dtype, max |logits - fp32 product|, max |fp32 product|)."""
        model = self.model_runner.model
        weight = model.lm_head.weight
        g = torch.Generator().manual_seed(seed)
        hidden = torch.randn(8, weight.shape[1], generator=g).to(weight.dtype)
        logits = model.compute_logits(hidden)
        exact = hidden.float() @ weight.float().T
        return str(logits.dtype), (logits.float() - exact).abs().max().item(), exact.abs().max().item()
