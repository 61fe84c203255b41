"""Fused GSPO kernel (Triton interpreter, or CUDA) vs its torch reference vs moe_rl.objectives (padded).

Imports the kernels from the source tree (`kernels.*`) and moe_rl.objectives (torch only) plainly: a moe_rl module
that fails to import fails these tests instead of skipping them."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.gspo_loss import fused_gspo_loss, gspo_loss_reference
from moe_rl import objectives
from moe_rl.objectives import corrections

pytestmark = pytest.mark.kernels


def _packed(lens, scale, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    n = int(cu[-1])
    old = -torch.rand(n, generator=g) * 3
    logp = old + scale * torch.randn(n, generator=g)
    roll = old + 0.7 * torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.25).float()
    adv = torch.randn(len(lens), generator=g)
    tensors = _off_the_clip_edges(logp, old, mask, cu), old, roll, mask, adv, cu
    return tuple(t.to(device) for t in tensors)


def _off_the_clip_edges(logp, old, mask, cu, clip_low=3e-4, clip_high=4e-4, margin=1e-5):
    """Move a sequence whose mean log-ratio lies within `margin` of a clip edge 2 margins away: the
    implementations round that mean differently in float32 (~1e-7), so such a sequence (about 1 draw in
    500) is clipped in one and not the other and its whole gradient differs. The default clip range."""
    logp = logp.clone()
    for i in range(len(cu) - 1):
        tokens = slice(int(cu[i]), int(cu[i + 1]))
        m = mask[tokens].double()
        if m.sum() == 0:
            continue
        mean = float(((logp[tokens].double() - old[tokens].double()) * m).sum() / m.sum())
        for edge in (math.log1p(clip_high), math.log1p(-clip_low)):
            if abs(mean - edge) < margin:
                logp[tokens] += 2 * margin if mean >= edge else -2 * margin
    return logp


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def _weights(correction, old, roll, mask):
    """The token weights the product passes (moe_rl.objectives.corrections, on the packed tokens), or None."""
    if correction == "none":
        return None
    return {"icepop": corrections.icepop_weights, "tis": corrections.tis_weights}[correction](old, roll, mask)


@pytest.mark.parametrize("lens", [[5, 1, 300, 0, 9], [1], [77, 3, 129]])
@pytest.mark.parametrize("correction", ["none", "icepop", "tis"])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_triton_equals_reference_values_grads_metrics(lens, correction, agg, device):
    """Without weights, and with IcePop weights (zeros outside the band) and TIS weights (capped) as token weights."""
    seed = int(torch.randint(0, 2**31, ()).item())
    for scale in (1e-4, 0.05):  # mostly unclipped / mostly clipped
        logp, old, roll, mask, adv, cu = _packed(lens, scale, seed, device)
        a, b = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
        kw = dict(token_weights=_weights(correction, old, roll, mask), agg=agg, horizon=max(lens))
        l1, m1 = fused_gspo_loss(a, old, adv, mask, cu, use_triton=True, block=64, **kw)
        l2, m2 = gspo_loss_reference(b, old, adv, mask, cu, **kw)
        l1.backward()
        l2.backward()
        # relative to the loss scale (same loss with A = -|A|, all terms >= 0): the signed sum can cancel
        scale_ = gspo_loss_reference(logp, old, -adv.abs(), mask, cu, **kw)[0].item()
        assert abs(l1.item() - l2.item()) <= 1e-5 * max(scale_, 1e-6), (seed, scale)
        if b.grad.abs().max() > 0:
            assert _rel(a.grad, b.grad) <= 1e-5, (seed, scale)
        else:
            assert a.grad.abs().max() == 0
        for k in m2:
            assert abs(m1[k].item() - m2[k].item()) <= 1e-5 * max(1.0, abs(m2[k].item())), (k, seed)


@pytest.mark.parametrize("counts", ["local", "global"])
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("correction", ["none", "icepop", "tis", "seq-tis"])
def test_kernel_equals_padded_objectives(correction, agg, counts, device):
    """The packed kernel is a drop-in for moe_rl.objectives.gspo_loss on padded rows: same loss,
    gradient and metrics, with the correction's token weights (IcePop, TIS, sequence-level TIS) or none,
    and with the global token/sequence counts a DP/micro-batch split passes."""
    lens = [6, 0, 13, 2]
    logp, old, roll, mask, adv, cu = _packed(lens, 1e-3, int(torch.randint(0, 2**31, ()).item()), device)
    t = max(lens)

    def pad(x):
        return torch.stack([torch.nn.functional.pad(x[cu[i] : cu[i + 1]], (0, t - lens[i])) for i in range(len(lens))])

    def unpad(x):
        return torch.cat([x[i, : lens[i]] for i in range(len(lens))])

    w = {
        "none": None,
        "icepop": objectives.icepop_weights(pad(old), pad(roll), pad(mask)),
        "tis": objectives.tis_weights(pad(old), pad(roll), pad(mask)),
        "seq-tis": objectives.seq_tis_weights(pad(old), pad(roll), pad(mask), cap=1.5),
    }[correction]
    kw = {"num_tokens": float(mask.sum()) * 2.5, "num_seqs": 7.0} if counts == "global" else {}
    x = pad(logp).clone().requires_grad_(True)
    ref, ref_m = objectives.gspo_loss(x, pad(old), adv, pad(mask), weights=w, agg=agg, **kw)
    y = logp.clone().requires_grad_(True)
    tw = None if w is None else unpad(w)
    got, got_m = fused_gspo_loss(y, old, adv, mask, cu, token_weights=tw, agg=agg, use_triton=True, block=4, **kw)
    ref.backward()
    got.backward()
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert torch.allclose(pad(y.grad), x.grad, rtol=1e-5, atol=1e-9)
    for k in ("clipfrac", "ppo_kl", "seq_ratio_mean"):
        assert torch.allclose(got_m[k], ref_m[k], rtol=1e-5, atol=1e-7), k


def test_bad_inputs_are_refused(device):
    logp, old, roll, mask, adv, cu = _packed([3, 4], 1e-3, 0, device)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at N=7"):
        fused_gspo_loss(logp, old, adv, mask, torch.tensor([0, 3, 6], device=device))
    with pytest.raises(ValueError, match="one entry per sequence"):
        fused_gspo_loss(logp, old, adv[:1], mask, cu)
    with pytest.raises(ValueError, match=r"token_weights \(3,\) != logp \(7,\)"):
        fused_gspo_loss(logp, old, adv, mask, cu, token_weights=mask[:3])
    # no in-kernel corrections: rollout log-probs are no argument, a positional sixth one is not taken for weights
    with pytest.raises(TypeError, match="positional"):
        fused_gspo_loss(logp, old, adv, mask, cu, roll)
    with pytest.raises(TypeError, match="correction"):
        fused_gspo_loss(logp, old, adv, mask, cu, token_weights=roll, correction="icepop")
