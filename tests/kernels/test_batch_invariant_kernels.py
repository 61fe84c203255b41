"""The kernels trainer.true_on_policy turns on for the actor on GPU (megatron-core's batch-invariant aten mm,
addmm and log_softmax, through `moe_rl.actor.batch_invariant.enable`), run here by the Triton interpreter: a
row's result does not depend on how many rows share the call, and stays an fp32-accurate product. Transformer
Engine's patches are left out (no TE on CPU, none on the GPU check machine either); MOE_RL_KERNEL_DEVICE=cuda runs the
compiled kernels."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.kernels
SIZES = (1, 3, 17)


def _row_invariant(fn, x: torch.Tensor) -> None:
    outs = [fn(x[:n].contiguous()) for n in SIZES]
    for n, out in zip(SIZES[:-1], outs[:-1], strict=True):
        assert torch.equal(out, outs[-1][:n]), f"rows 0..{n - 1} differ between a batch of {n} and of {SIZES[-1]}"


def test_megatrons_batch_invariant_kernels_are_batch_invariant(monkeypatch, device):
    bik = pytest.importorskip("megatron.core.transformer.custom_layers.batch_invariant_kernels")
    monkeypatch.setattr(bik, "_te_patch_for_batch_invariant", lambda: None)
    monkeypatch.setattr(bik, "_te_unpatch_for_batch_invariant", lambda: None)
    seed = int(torch.randint(0, 2**31, ()).item())
    g = torch.Generator().manual_seed(seed)
    x, w, b = (torch.randn(*shape, generator=g).to(device) for shape in ((17, 512), (384, 512), (384,)))
    exact = x.double() @ w.double().T
    with bik.set_batch_invariant_mode(True):
        assert bik.is_batch_invariant_mode_enabled()
        _row_invariant(lambda a: a @ w.T, x)
        _row_invariant(lambda a: torch.nn.functional.linear(a, w, b), x)
        _row_invariant(lambda a: torch.log_softmax(a @ w.T, dim=-1), x)
        y = x @ w.T
    assert not bik.is_batch_invariant_mode_enabled()
    err = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    # On CUDA megatron's mm kernel calls tl.dot at its default precision, TF32 for fp32 inputs (10-bit mantissa:
    # 9e-4 measured on an H200); the interpreter multiplies in fp32.
    tol = 1e-5 if device.type == "cpu" else 3e-3
    assert err < tol, f"seed {seed}: batch-invariant mm is {err:.2e} off an fp64 product"
