"""moe_rl/compat/megatron_cpu.py's bucketed rows for 16-bit linears on CPU: megatron's linear function run on
zero-padded rows gives the rows' outputs and gradients, reaches the GEMM with few distinct row counts, and leaves
float32 and sequence-parallel inputs alone."""

from __future__ import annotations

import random

import pytest
import torch

from moe_rl.compat.megatron_cpu import _rows_bucketed, bucket_rows


def test_bucket_rows_bounds_padding_and_the_number_of_shapes():
    sizes = [bucket_rows(n) for n in range(20_000)]
    assert sizes[0] == 0 and sizes == sorted(sizes)
    for n, b in enumerate(sizes):
        assert n <= b <= max(n + 15, n * 1.25), (n, b)
        assert bucket_rows(b) == b  # a bucket is its own bucket
    assert len(set(sizes[1:4097])) <= 48  # 1..4096 rows: 8 multiples of 16, then 4 sizes per doubling


def _linear(bucketed: bool, seen: list[tuple[int, ...]]):
    from megatron.core.tensor_parallel import layers

    def spy(input, weight, *args, **kwargs):
        seen.append(tuple(input.shape))
        return layers.linear_with_grad_accumulation_and_async_allreduce.__wrapped__(input, weight, *args, **kwargs)

    return _rows_bucketed(spy) if bucketed else spy


def _run(linear, x, w, b, sequence_parallel=False):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    flags = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=sequence_parallel)
    out = linear(x, w, b, **flags)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(out.numel())).to(out.dtype)
    (out.float() * grad.float()).sum().backward()
    return out.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bucketed_rows_give_the_rows_outputs_and_gradients(dtype, world1):
    rng = random.Random()
    for _ in range(6):
        rows, k, n = rng.randint(1, 700), rng.choice([32, 64, 128]), rng.choice([16, 96, 256])
        shape = (rows, k) if rng.random() < 0.5 else (rows, rng.randint(1, 3), k)  # experts' 2-D, [s, b, h] 3-D
        x, w, b = torch.randn(shape).to(dtype), (torch.randn(n, k) / k**0.5).to(dtype), torch.randn(n).to(dtype)
        seen: list[tuple[int, ...]] = []
        got = _run(_linear(True, seen), x, w, b)
        want = _run(_linear(False, []), x, w, b)
        m = x.numel() // k
        assert seen == [(bucket_rows(m), k)]
        for g, r in zip(got, want, strict=True):
            assert g.shape == r.shape
            torch.testing.assert_close(g, r)


def test_float32_and_sequence_parallel_inputs_pass_through(world1):
    x, w, b = torch.randn(37, 2, 64), torch.randn(48, 64), torch.randn(48)
    seen: list[tuple[int, ...]] = []
    got = _run(_linear(True, seen), x, w, b)
    want = _run(_linear(False, []), x, w, b)
    assert seen == [(37, 2, 64)]
    for g, r in zip(got, want, strict=True):
        assert torch.equal(g, r)

    def gathered(input, weight, bias, sequence_parallel, **kwargs):  # stands in for the rows' gather over ranks
        seen.append((tuple(input.shape), sequence_parallel))
        return torch.matmul(input, weight.t()) + bias

    seen.clear()
    _run(_rows_bucketed(gathered), x.bfloat16(), w.bfloat16(), b.bfloat16(), sequence_parallel=True)
    _run(_rows_bucketed(gathered), x.bfloat16(), w.bfloat16(), b.bfloat16(), sequence_parallel=False)
    assert seen == [((37, 2, 64), True), ((bucket_rows(74), 64), False)]


def test_the_shim_is_installed_on_megatrons_linears(world1):
    from megatron.core.tensor_parallel import layers

    for name in ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight"):
        fn = getattr(layers, name)
        assert fn.__wrapped__.__name__ == name and fn is not fn.__wrapped__
