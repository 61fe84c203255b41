"""CPU shims for megatron-core (0.16.x): the one place that reaches into its CUDA assumptions.

Applied by `apply_cpu_shims()` only when CUDA is absent (but for the one fix a GPU without Transformer Engine
needs too). Each shim names the megatron-core call
that needs it; delete a shim when upstream stops needing it (re-run tests/distributed).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import types

import torch

_APPLIED = False


class CPURNGStatesTracker:
    """Stand-in for `tensor_parallel.random.CudaRNGStatesTracker` that forks the CPU generator.

    Needed by: `DotProductAttention.forward` (attention dropout under
    `get_cuda_rng_tracker().fork()`), `model_parallel_cuda_manual_seed` (CUDA generator state).
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def reset(self):
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self):
        return self._is_initialized

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise RuntimeError(f"rng state {name!r} or seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name!r} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def cpu_model_parallel_seed(seed: int) -> None:
    """CPU version of `tensor_parallel.model_parallel_cuda_manual_seed` (same seed offsets)."""
    # heavy: megatron-core, imported on first use
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tp_rank = ps.get_tensor_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    torch.manual_seed(seed)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _te_general_gemm_without_te() -> None:
    """moe_utils.router_gating_linear references `te_general_gemm`, which 0.16.x only defines when Transformer
    Engine imports (NameError otherwise): on CPU, and on a GPU without TE (seen on an H200, 2026-11-27)."""
    # heavy: megatron-core, imported on first use
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply_cpu_shims() -> bool:
    """Patch megatron-core for CPU execution when CUDA is unavailable. Idempotent.

    Returns True when the shims are active.
    """
    global _APPLIED
    _te_general_gemm_without_te()
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    # torch.cuda.current_device(): called for `device=` by the router (moe/router.py buffers),
    # RoPE (rotary_pos_embedding.py), GlobalMemoryBuffer (sequence-parallel all-gather) and
    # tensor_parallel.layers weight allocation. On CPU it must name the CPU.
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    _cpu_rng_tracker()
    _cuda_tensors_on_cpu()
    _cpu_context_parallel_rope()
    _mla_without_te()
    _rows_bucketed_linears()
    _APPLIED = True
    return True


def _cpu_rng_tracker() -> None:
    """tensor_parallel.random: the CUDA RNG tracker cannot add or fork states without CUDA."""
    # heavy: megatron-core, imported on first use
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recompute (CheckpointFunction via _get_all_rng_states/_set_all_rng_states)
    # saves and restores the CUDA generator; the CPU generator is already saved beside it.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def _cuda_tensors_on_cpu() -> None:
    """pipeline_parallel.schedules allocates its token counter with a literal device="cuda", and
    p2p_communication calls torch.cuda.synchronize(): give those two modules a `torch`
    stand-in that maps "cuda" to the CPU and makes synchronize a no-op.
    dist_checkpointing's torch_dist save path does the same: torch.cuda.synchronize() before
    writing (filesystem_async, async_utils) and device="cuda" flags for its consistency
    all-reduces (state_dict_saver).
    megatron.core.optimizer: FP32Optimizer allocates its loss scale with device="cuda" and
    clip_grads.get_grad_norm_fp32 its norm buffers; the non-apex l2-norm fallback
    (utils.local_multi_tensor_l2_norm) returns a CUDA tensor; clip_grad_by_total_norm_fp32
    asserts `grad.type() == "torch.cuda.FloatTensor"`. Same formulas, CPU tensors."""
    # heavy: megatron-core, imported on first use
    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async, state_dict_saver
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    for mod in (schedules, p2p_communication, async_utils, filesystem_async, state_dict_saver, clip_grads, moptimizer):
        mod.torch = _torch_cuda_as_cpu()
    clip_grads.l2_norm_impl = _l2_norm
    moptimizer.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm


def _cpu_context_parallel_rope() -> None:
    """rope_utils.get_pos_emb_on_this_cp_rank (context parallel: this rank's zig-zag rows of the RoPE table)
    builds its index with pin_memory=True(...).cuda(); the two modules that imported it get a CPU copy."""
    # heavy: megatron-core, imported on first use
    from megatron.core.models.common.embeddings import rotary_pos_embedding, yarn_rotary_pos_embedding

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank
    yarn_rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank


def _mla_without_te() -> None:
    """multi_latent_attention imports TELinear & co. from megatron.core.extensions.transformer_engine, which
    without Transformer Engine defines them as MagicMock placeholders: the import succeeds, HAVE_TE is
    True, and MLASelfAttention's `isinstance(self.linear_proj, TELinear)` raises TypeError."""
    # heavy: megatron-core, imported on first use
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False


def _rows_bucketed_linears() -> None:
    """tensor_parallel.layers: every linear (attention, dense and expert MLPs) in 16-bit runs oneDNN's bf16 GEMM,
    which builds (JIT-compiles) a kernel per new matrix shape: ~0.4 ms each, more than the product itself at
    these sizes, and the row count changes with every batch and every expert's token count."""
    # heavy: megatron-core, imported on first use
    from megatron.core.tensor_parallel import layers

    for name in ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight"):
        setattr(layers, name, _rows_bucketed(getattr(layers, name)))


def bucket_rows(n: int) -> int:
    """`n` rounded up to one of a few sizes: multiples of 16 up to 128, then 4 sizes per doubling (at most 25% more
    rows, 9% on average over 128-4096). oneDNN compiles a GEMM kernel per shape; with these it compiles each once
    per run."""
    step = 16 if n < 128 else 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x` [n, ...] with zero rows appended up to `rows`."""
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])]) if rows > x.shape[0] else x


def _rows_bucketed(linear):
    """megatron's linear function, run on `bucket_rows` rows for 16-bit inputs on CPU (zero rows appended, their
    outputs dropped; their gradients are zero). float32 (MKL's GEMM, no per-shape kernels) and sequence-parallel
    inputs (gathered over ranks along the rows) pass through unchanged."""

    @functools.wraps(linear)  # with its attributes: megatron's function reads `.warned` through its global name
    def bucketed(input, weight, *args, sequence_parallel=False, **kwargs):
        if input.dtype not in (torch.bfloat16, torch.float16) or sequence_parallel:
            return linear(input, weight, *args, sequence_parallel=sequence_parallel, **kwargs)
        rows = input.reshape(-1, input.shape[-1])
        n = rows.shape[0]
        out = linear(pad_rows(rows, bucket_rows(n)), weight, *args, sequence_parallel=False, **kwargs)
        return out[:n].reshape(*input.shape[:-1], out.shape[-1])

    return bucketed


def _pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    cp, rank = cp_group.size(), cp_group.rank()  # megatron's formula, CPU index
    idx = torch.tensor([rank, 2 * cp - rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def _l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    norms = torch.stack([t.float().norm() for t in tensor_lists[0]])
    return norms.norm().reshape(1), None


def _clip_grad_by_total_norm(parameters, max_norm, total_norm, use_decoupled_grad=False):
    coeff = max_norm / (total_norm + 1.0e-6)  # megatron's clip_grad_by_total_norm_fp32
    if coeff < 1.0:
        for p in parameters if isinstance(parameters, list) else [parameters]:
            grad = p.decoupled_grad if use_decoupled_grad else p.grad
            if grad is not None:
                grad.mul_(coeff)


def _torch_cuda_as_cpu() -> types.ModuleType:
    """A module proxying `torch` where tensor factories map device="cuda" to CPU."""
    proxy = types.ModuleType("torch_cpu_proxy")
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})

    def _wrap(fn):
        def inner(*args, **kwargs):
            dev = kwargs.get("device")
            if dev is not None and "cuda" in str(dev):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return inner

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange"):
        setattr(proxy, name, _wrap(getattr(torch, name)))
    cuda = types.SimpleNamespace(**{k: getattr(torch.cuda, k) for k in dir(torch.cuda) if not k.startswith("__")})
    cuda.synchronize = lambda *a, **k: None
    cuda.current_device = _cpu_device
    proxy.cuda = cuda
    return proxy


def _local_mla_core_attention():
    # heavy: megatron-core, imported on first use
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class LocalMLACoreAttention(DotProductAttention):
        """megatron-core's local (non-TE) attention for multi-latent attention: MLASelfAttention passes
        `k_channels` / `v_channels`, which only TEDotProductAttention accepts. The local class needs
        neither: query/key widths come from the tensors, the output width from `kv_channels`
        (= v_head_dim), and MLA passes its own softmax scale."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)

    return LocalMLACoreAttention


def _expert_row_parallel_linear():
    # heavy: megatron-core, imported on first use
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    class ExpertRowParallelLinear(RowParallelLinear):
        """An expert's linear_fc2 whose output megatron's MLP may add its bias to in place. Without expert parallelism
        megatron returns the matmul's output through an identity autograd Function (the TP reduce of a 1-rank group),
        and MLP.forward's `output += bias * probs` on it raises under autograd ("a view ... modified inplace"): the
        experts with biases (GPT-OSS) could not train at parallel.ep=1. A copy of the output, only then."""

        def forward(self, input_, *args, **kwargs):
            output, bias = super().forward(input_, *args, **kwargs)
            if bias is not None and output.requires_grad and output._is_view():
                output = output.clone()
            return output, bias

    return ExpertRowParallelLinear


_LAZY_CLASSES = {
    "LocalMLACoreAttention": _local_mla_core_attention,
    "ExpertRowParallelLinear": _expert_row_parallel_linear,
}


def __getattr__(name: str):
    if name in _LAZY_CLASSES:  # built on first use: importing megatron here would be eager
        cls = _LAZY_CLASSES[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def float16_optimizer(optimizer: torch.optim.Optimizer, config, init_state_fn):
    """megatron's Float16OptimizerWithFloat16Params (fp32 master weights, fp32 main gradients, the 16-bit parameters
    refreshed from the masters after each step) over `optimizer`, whose parameters may be CPU tensors: megatron's
    constructor takes a parameter as 16-bit only if `param.type()` names a CUDA tensor type and refuses any other. Each
    16-bit CPU parameter answers with the CUDA name during the constructor only; everything else is megatron's (the
    tensors it allocates with device="cuda" are CPU ones under apply_cpu_shims). bf16 only: no loss scaler."""
    # heavy: megatron-core, imported on first use
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    params = [p for group in optimizer.param_groups for p in group["params"]]
    if other := sorted({str(p.dtype) for p in params if p.dtype != torch.bfloat16}):
        # megatron then takes each one's gradient from `main_grad`, which only its DDP wrapper (GPU) allocates
        raise ValueError(f"a bf16 model with {', '.join(other)} parameters: the CPU optimizer path needs all bf16")
    params = [p for p in params if not p.is_cuda]
    for p in params:
        p.type = lambda: "torch.cuda.BFloat16Tensor"  # an instance attribute over Tensor.type, removed below
    try:
        return Float16OptimizerWithFloat16Params(optimizer, config, None, init_state_fn)
    finally:
        for p in params:
            del p.type
