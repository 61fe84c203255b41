"""Fused GSPO kernel (Triton interpreter) vs its torch reference vs moe_rl.objectives (padded)."""

from __future__ import annotations

import pytest
import torch
from moe_rl.kernels.gspo_loss import fused_gspo_loss, gspo_loss_reference

from moe_rl import objectives as O

pytestmark = pytest.mark.kernels


def _packed(lens, scale, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    n = int(cu[-1])
    old = -torch.rand(n, generator=g) * 3
    logp = old + scale * torch.randn(n, generator=g)
    roll = old + 0.7 * torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.25).float()
    adv = torch.randn(len(lens), generator=g)
    return logp, old, roll, mask, adv, cu


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


@pytest.mark.parametrize("lens", [[5, 1, 300, 0, 9], [1], [77, 3, 129]])
@pytest.mark.parametrize("correction", ["none", "icepop", "tis"])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_triton_equals_reference_values_grads_metrics(lens, correction, agg):
    seed = int(torch.randint(0, 2**31, ()).item())
    for scale in (1e-4, 0.05):  # mostly unclipped / mostly clipped
        logp, old, roll, mask, adv, cu = _packed(lens, scale, seed)
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        kw = dict(correction=correction, agg=agg, horizon=max(lens))
        l1, m1 = fused_gspo_loss(a, old, adv, mask, cu, roll, use_triton=True, block=64, **kw)
        l2, m2 = gspo_loss_reference(b, old, adv, mask, cu, roll, **kw)
        l1.backward()
        l2.backward()
        # relative to the loss scale (same loss with A = -|A|, all terms >= 0): the signed sum can cancel
        scale_ = gspo_loss_reference(logp, old, -adv.abs(), mask, cu, roll, **kw)[0].item()
        assert abs(l1.item() - l2.item()) <= 1e-5 * max(scale_, 1e-6), (seed, scale)
        if b.grad.abs().max() > 0:
            assert _rel(a.grad, b.grad) <= 1e-5, (seed, scale)
        else:
            assert a.grad.abs().max() == 0
        for k in m2:
            assert abs(m1[k].item() - m2[k].item()) <= 1e-5 * max(1.0, abs(m2[k].item())), (k, seed)


@pytest.mark.parametrize("correction", ["none", "icepop", "tis"])
def test_reference_equals_padded_objectives(correction):
    lens = [6, 0, 13, 2]
    logp, old, roll, mask, adv, cu = _packed(lens, 1e-3, seed=3)
    t = max(lens)

    def pad(x):
        return torch.stack(
            [
                torch.nn.functional.pad(x[cu[i] : cu[i + 1]], (0, t - lens[i]))  # noqa: E731
                for i in range(len(lens))
            ]
        )

    w = {
        "none": None,
        "icepop": O.icepop_weights(pad(old), pad(roll), pad(mask)),
        "tis": O.tis_weights(pad(old), pad(roll), pad(mask)),
    }[correction]
    x = pad(logp).clone().requires_grad_(True)
    ref, ref_m = O.gspo_loss(x, pad(old), adv, pad(mask), weights=w)
    y = logp.clone().requires_grad_(True)
    got, got_m = fused_gspo_loss(y, old, adv, mask, cu, roll, correction=correction, use_triton=True, block=4)
    ref.backward()
    got.backward()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(pad(y.grad), x.grad, rtol=1e-5, atol=1e-9)
    assert torch.allclose(got_m["clipfrac"], ref_m["clipfrac"]) and torch.allclose(got_m["ppo_kl"], ref_m["ppo_kl"])


def test_bad_inputs_are_refused():
    logp, old, roll, mask, adv, cu = _packed([3, 4], 1e-3, 0)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at N=7"):
        fused_gspo_loss(logp, old, adv, mask, torch.tensor([0, 3, 6]), roll)
    with pytest.raises(ValueError, match="one entry per sequence"):
        fused_gspo_loss(logp, old, adv[:1], mask, cu, roll)
    with pytest.raises(ValueError, match="needs rollout_logp"):
        fused_gspo_loss(logp, old, adv, mask, cu, None, correction="icepop")
    with pytest.raises(ValueError, match="unknown correction 'seq-tis'"):
        fused_gspo_loss(logp, old, adv, mask, cu, roll, correction="seq-tis")
