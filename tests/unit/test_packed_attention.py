"""A packed row's attention per sample (actor/packed_attention.py) against megatron-core's DotProductAttention
over the whole row with the packing mask: same outputs and gradients up to fp32 rounding, on fresh random rows
(samples of mixed lengths, single-token samples, tail padding, grouped-query heads and MLA's wider keys); any
other mask runs megatron's forward itself, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from moe_rl.actor.packed_attention import packed_row_attention, row_plan
from moe_rl.actor.packing import _block_causal_mask


def _attention(base, heads: int, groups: int, head_dim: int, bf16: bool = False):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        kv_channels=head_dim,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
    )
    return base(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def _row(rng: random.Random) -> tuple[torch.Tensor, list[int]]:
    """A packed row's `sample` index (-1: tail padding), as actor/packing.py lays it out."""
    lengths = [rng.choice([1, 2, rng.randint(3, 12), rng.randint(20, 70)]) for _ in range(rng.randint(2, 9))]
    tail = rng.choice([0, 0, 1, rng.randint(2, 30)])
    sample = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((tail,), -1)])
    return sample, lengths


def _run(module, q, k, v, mask):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    grad = torch.randn_like(out, generator=torch.Generator().manual_seed(1))
    (out * grad).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("heads,groups,key_dim,value_dim", [(4, 2, 32, 32), (4, 4, 16, 16), (2, 2, 24, 16)])
def test_a_packed_row_per_sample_equals_megatrons_masked_row(heads, groups, key_dim, value_dim, world1):
    """(2, 2, 24, 16): MLA's shape, wider query/key than value heads (LocalMLACoreAttention as the base)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from moe_rl.compat.megatron_cpu import LocalMLACoreAttention

    base = LocalMLACoreAttention if key_dim != value_dim else DotProductAttention
    reference = _attention(base, heads, groups, value_dim)
    packed = _attention(packed_row_attention(base), heads, groups, value_dim)
    packed.softmax_scale = reference.softmax_scale = key_dim**-0.5
    rng = random.Random()
    for _ in range(6):
        sample, lengths = _row(rng)
        s = sample.shape[0]
        mask = _block_causal_mask(sample)
        plan = row_plan(mask)
        assert plan is not None and sum(int(v.sum()) for _, v, _ in plan.classes) == s
        q = torch.randn(s, 1, heads, key_dim)
        k = torch.randn(s, 1, groups, key_dim)
        v = torch.randn(s, 1, groups, value_dim)
        want, want_grads = _run(reference, q, k, v, mask)
        got, got_grads = _run(packed, q, k, v, mask)
        assert got.shape == want.shape == (s, 1, heads * value_dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"lengths {lengths}")
        for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"d{name}, lengths {lengths}")


def test_every_other_mask_runs_megatrons_forward_bit_for_bit(world1):
    """The padded path's causal mask (one sample), a batch of rows, and masks that are not block-diagonal causal."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    reference = _attention(DotProductAttention, 4, 2, 32)
    packed = _attention(packed_row_attention(DotProductAttention), 4, 2, 32)
    s = 40
    causal = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    sliding = causal | ~torch.ones(s, s, dtype=torch.bool).triu(-8)[None, None]  # not per sample: a window
    blocks = _block_causal_mask(torch.tensor([0] * 20 + [1] * 20))
    for b, mask in [(1, causal), (1, sliding), (3, causal), (3, blocks)]:
        if b == 1:
            assert row_plan(mask) is None
        q, k, v = torch.randn(s, b, 4, 32), torch.randn(s, b, 2, 32), torch.randn(s, b, 2, 32)
        want, want_grads = _run(reference, q, k, v, mask)
        got, got_grads = _run(packed, q, k, v, mask)
        assert torch.equal(got, want) and all(map(torch.equal, got_grads, want_grads))


def test_bf16_rows_stay_within_bf16_rounding_of_megatrons(world1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    reference = _attention(DotProductAttention, 4, 2, 32, bf16=True)
    packed = _attention(packed_row_attention(DotProductAttention), 4, 2, 32, bf16=True)
    sample, lengths = _row(random.Random())
    s = sample.shape[0]
    mask = _block_causal_mask(sample)
    q, k, v = (
        torch.randn(s, 1, 4, 32).bfloat16(),
        torch.randn(s, 1, 2, 32).bfloat16(),
        torch.randn(s, 1, 2, 32).bfloat16(),
    )
    want, _ = _run(reference, q, k, v, mask)
    got, _ = _run(packed, q, k, v, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2, msg=f"lengths {lengths}")
