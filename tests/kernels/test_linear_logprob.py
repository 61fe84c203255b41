"""Fused linear -> log-prob/entropy: Triton (interpreter, or CUDA) and chunked torch vs full logits."""

from __future__ import annotations

import pytest
import torch

from kernels.linear_logprob import fused_linear_logprob, linear_logprob_reference
from tests.conftest import read_json_results, torchrun

pytestmark = pytest.mark.kernels


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n,d,v", [(1, 45, 301), (37, 64, 300), (53, 33, 517)])
def test_values_and_gradients_match_full_logits(backend, n, d, v, device):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    h = torch.randn(n, d, generator=g).to(device)
    w = (torch.randn(v, d, generator=g) * 0.3).to(device)
    y = torch.randint(0, v, (n,), generator=g).to(device)
    g_lp, g_ent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    a, wa = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    b, wb = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = fused_linear_logprob(a, wa, y, backend=backend, chunk_tokens=7)
    (lp * g_lp + ent * g_ent).sum().backward()
    lr, er = linear_logprob_reference(b, wb, y)
    (lr * g_lp + er * g_ent).sum().backward()
    for got, ref in ((lp, lr), (ent, er), (a.grad, b.grad), (wa.grad, wb.grad)):
        assert _rel(got, ref) <= 1e-5


def test_logprob_only_gradient_and_errors(device, monkeypatch):
    h, w = torch.randn(9, 32, device=device), torch.randn(100, 32, device=device)
    y = torch.randint(0, 100, (9,), device=device)
    a = h.clone().requires_grad_(True)
    lp, _ = fused_linear_logprob(a, w, y, backend="triton")
    lp.sum().backward()
    b = h.clone().requires_grad_(True)
    linear_logprob_reference(b, w, y)[0].sum().backward()
    assert _rel(a.grad, b.grad) <= 1e-5
    with pytest.raises(ValueError, match="must be \\[N, D\\] and \\[V, D\\]"):
        fused_linear_logprob(h, w[:, :5], y)
    with pytest.raises(ValueError, match="targets"):
        fused_linear_logprob(h, w, y[:3])
    with pytest.raises(ValueError, match="backend='cuda': choose torch or triton"):
        fused_linear_logprob(h, w, y, backend="cuda")
    if device.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="backend='triton' needs Triton and CUDA tensors"):
            fused_linear_logprob(h, w, y, backend="triton")


@pytest.mark.distributed
def test_vocab_parallel_matches_full_vocab(tmp_path):
    torchrun("tests.kernels.vocab_parallel_worker", 2, [str(tmp_path)])
    results = read_json_results(tmp_path)
    assert len(results) == 2 * 2  # 2 ranks x 2 backends
    for r in results:
        for key in ("logp", "entropy", "grad_hidden", "grad_weight_shard"):
            assert r[key] <= 1e-5, r
