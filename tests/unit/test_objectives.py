"""Objectives against independent reference math (plain per-sequence / per-token loops in
float64 written from the published formulas), on fresh random inputs: values and gradients."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from moe_rl import objectives as O
from moe_rl.objectives.config import GeoMaskConfig, GSPOConfig, IcePopConfig, PPOConfig, SeqMaskConfig


def _rand_batch(b=6, t=9, scale=1e-3, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ()).item()))
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + scale * torch.randn(b, t, generator=g, dtype=torch.float64)
    roll = old + 0.5 * torch.randn(b, t, generator=g, dtype=torch.float64)
    lens = torch.randint(2, t + 1, (b,), generator=g)  # >= 1 response token (row 1 is emptied below)
    mask = (torch.arange(t)[None] < lens[:, None]).double()
    mask[:, 0] = 0  # prompt token
    mask[1] = 0  # an empty response
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    return logp, old, roll, mask, adv


def _rows(mask):
    return [i for i in range(mask.shape[0]) if mask[i].sum() > 0]


# ---- advantages -----------------------------------------------------------------------------


def test_grpo_drgrpo_rloo_reinforce_match_reference():
    r = torch.randn(12, dtype=torch.float64)
    g = r.numpy().reshape(3, 4)
    ref = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    np.testing.assert_allclose(O.grpo_advantages(r, 4).numpy(), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(
        O.drgrpo_advantages(r, 4).numpy(), (g - g.mean(1, keepdims=True)).reshape(-1), rtol=1e-6, atol=1e-6
    )
    rloo = [g[i, j] - (g[i].sum() - g[i, j]) / 3 for i in range(3) for j in range(4)]
    np.testing.assert_allclose(O.rloo_advantages(r, 4).numpy(), rloo, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(O.reinforce_advantages(r).numpy(), r.numpy() - r.numpy().mean(), rtol=1e-5, atol=1e-6)


def test_advantage_edge_cases_are_finite():
    assert torch.equal(O.grpo_advantages(torch.tensor([1.0, 2.0]), 1), torch.zeros(2))  # group of one
    assert torch.equal(O.grpo_advantages(torch.ones(4), 4), torch.zeros(4))  # zero variance
    assert torch.equal(O.rloo_advantages(torch.tensor([3.0]), 1), torch.zeros(1))
    with pytest.raises(ValueError, match="not a whole number of groups of 4"):
        O.grpo_advantages(torch.ones(6), 4)
    with pytest.raises(ValueError, match="unknown advantage estimator 'gea'.*grpo"):
        O.ADVANTAGES.get("gea")


# ---- aggregation ----------------------------------------------------------------------------


def test_aggregation_modes_match_loops():
    loss = torch.randn(5, 7, dtype=torch.float64)
    _, _, _, mask, _ = _rand_batch(5, 7)
    rows = _rows(mask)
    tok = sum(loss[i, j] * mask[i, j] for i in range(5) for j in range(7)) / mask.sum()
    per_mean = [sum(loss[i, j] * mask[i, j] for j in range(7)) / mask[i].sum() for i in rows]
    per_sum = [sum(loss[i, j] * mask[i, j] for j in range(7)) for i in rows]
    assert torch.allclose(O.aggregate(loss, mask, "token-mean"), tok)
    assert torch.allclose(O.aggregate(loss, mask, "seq-mean-token-mean"), sum(per_mean) / len(rows))
    assert torch.allclose(O.aggregate(loss, mask, "seq-mean-token-sum"), sum(per_sum) / len(rows))
    assert torch.allclose(O.aggregate(loss, mask, "seq-mean-token-sum-norm"), sum(per_sum) / len(rows) / 7)
    assert torch.allclose(O.aggregate(loss, mask, "token-mean", num_tokens=100.0), tok * mask.sum() / 100)
    with pytest.raises(ValueError, match="unknown loss aggregation 'sum'"):
        O.aggregate(loss, mask, "sum")


# ---- GSPO -----------------------------------------------------------------------------------


def _gspo_sequence_form(logp, old, adv, mask, eps_l, eps_h):
    """GSPO paper, sequence form: mean_i max(-A s_i, -A clip(s_i)), s_i = exp(mean_t(logp - old))."""
    total, n = 0.0, 0
    for i in _rows(mask):
        m = mask[i].bool()
        s = torch.exp(torch.clamp((logp[i][m] - old[i][m]).mean(), max=10.0))
        total = total + torch.maximum(-adv[i] * s, -adv[i] * torch.clamp(s, 1 - eps_l, 1 + eps_h))
        n += 1
    return total / n


@pytest.mark.parametrize("scale", [1e-4, 1e-3, 0.3])
def test_gspo_token_form_equals_sequence_form_value_and_gradient(scale):
    logp, old, _, mask, adv = _rand_batch(8, 11, scale=scale)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    loss, metrics = O.gspo_loss(a, old, adv, mask)
    ref = _gspo_sequence_form(b, old, adv, mask, 3e-4, 4e-4)
    loss.backward()
    ref.backward()
    assert torch.allclose(loss, ref, rtol=1e-10, atol=1e-12)
    assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-12)
    assert a.grad[mask == 0].abs().max() == 0
    # clipfrac and ppo_kl from their definitions
    s = torch.stack(
        [torch.exp((logp[i] - old[i])[mask[i].bool()].mean()) if mask[i].sum() else torch.tensor(1.0) for i in range(8)]
    ).double()
    a_tok = adv[:, None].expand_as(logp)
    clipped = (-a_tok * s[:, None].clamp(1 - 3e-4, 1 + 4e-4)) > (-a_tok * s[:, None])
    assert torch.allclose(metrics["clipfrac"], (clipped.double() * mask).sum() / mask.sum())
    assert torch.allclose(metrics["ppo_kl"], ((old - logp) * mask).sum() / mask.sum())


def test_gspo_with_weights_matches_token_loop():
    logp, old, roll, mask, adv = _rand_batch(5, 8, scale=1e-3)
    w = O.icepop_weights(old, roll, mask)
    x = logp.clone().requires_grad_(True)
    loss, _ = O.gspo_loss(x, old, adv, mask, weights=w, agg="token-mean")
    total = 0.0
    for i in range(5):
        m = mask[i].bool()
        if not m.any():
            continue
        s_i = math.exp(float((logp[i][m] - old[i][m]).mean()))
        for t in torch.nonzero(m).flatten().tolist():
            st = min(s_i, math.exp(10))
            v = max(-adv[i].item() * st, -adv[i].item() * min(max(st, 1 - 3e-4), 1 + 4e-4))
            total += v * w[i, t].item()
    assert loss.item() == pytest.approx(total / mask.sum().item(), rel=1e-9, abs=1e-12)


def test_gspo_edge_cases_stay_finite():
    logp, old, _, mask, adv = _rand_batch(4, 6)
    # huge log-ratios: s clamps at exp(10), gradients finite
    x = (old + 1e4).clone().requires_grad_(True)
    loss, m = O.gspo_loss(x, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    # fully masked batch: zero loss, zero gradient, finite metrics
    z = torch.zeros_like(mask)
    x = logp.clone().requires_grad_(True)
    loss, m = O.gspo_loss(x, old, adv, z)
    loss.backward()
    assert loss.item() == 0 and x.grad.abs().max() == 0 and all(torch.isfinite(v) for v in m.values())
    with pytest.raises(ValueError, match="advantages has 3 rows"):
        O.gspo_loss(logp, old, adv[:3], mask)


# ---- PPO ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_matches_token_loop(dual_clip):
    logp, old, _, mask, adv = _rand_batch(6, 7, scale=0.5)
    x = logp.clone().requires_grad_(True)
    loss, metrics = O.ppo_loss(x, old, adv, mask, dual_clip=dual_clip)
    total = 0.0
    for i in range(6):
        for t in range(7):
            if not mask[i, t]:
                continue
            r = math.exp(logp[i, t] - old[i, t])
            a = adv[i].item()
            v = max(-a * r, -a * min(max(r, 0.8), 1.2))
            if dual_clip and a < 0:
                v = min(v, -a * dual_clip)
            total += v
    assert loss.item() == pytest.approx(total / mask.sum().item(), rel=1e-9)
    loss.backward()
    # gradient of an unclipped token: -A r / N
    r = (logp - old).exp()
    free = (r > 0.8) & (r < 1.2) & (mask > 0)
    expected = (-adv[:, None] * r / mask.sum()).expand_as(r)
    assert torch.allclose(x.grad[free], expected[free])


# ---- corrections ----------------------------------------------------------------------------


def test_icepop_tis_and_sequence_corrections_match_loops():
    _, old, roll, mask, _ = _rand_batch(7, 10)
    ice = O.icepop_weights(old, roll, mask)
    tis = O.tis_weights(old, roll, mask)
    stis = O.seq_tis_weights(old, roll, mask)
    for i in range(7):
        rho = math.exp(sum((old[i, t] - roll[i, t]).item() for t in range(10) if mask[i, t]))
        n = int(mask[i].sum())
        geo = math.exp(sum((old[i, t] - roll[i, t]).item() for t in range(10) if mask[i, t]) / max(n, 1))
        for t in range(10):
            k = math.exp(old[i, t] - roll[i, t])
            on = bool(mask[i, t])
            assert ice[i, t].item() == pytest.approx(k if on and 0.5 <= k <= 5.0 else 0.0, rel=1e-12)
            assert tis[i, t].item() == pytest.approx(min(k, 2.0) if on else 0.0, rel=1e-12)
            assert stis[i, t].item() == pytest.approx(min(rho, 2.0) if on else 0.0, rel=1e-9)
        keep = O.seq_reject_mask(old, roll, mask, 0.5, 2.0)[i]
        assert torch.equal(keep, mask[i] * float(0.5 <= rho <= 2.0))
        keep_geo = O.seq_reject_mask(old, roll, mask, 0.9, 1.1, geometric=True)[i]
        assert torch.equal(keep_geo, mask[i] * float(0.9 <= geo <= 1.1 if n else True))


def test_corrections_handle_huge_log_ratios_and_bad_bands():
    _, old, _, mask, _ = _rand_batch(3, 5)
    roll = old - 1e4  # k = e^{1e4}
    assert torch.isfinite(O.icepop_weights(old, roll, mask)).all()
    assert O.icepop_weights(old, roll, mask).max() == 0
    assert torch.allclose(O.tis_weights(old, roll, mask), 2.0 * mask)
    assert torch.allclose(O.seq_tis_weights(old, roll, mask), 2.0 * mask)
    with pytest.raises(ValueError, match="0 < low <= high"):
        O.icepop_weights(old, roll, mask, low=2.0, high=1.0)


def test_correction_registry_selects_by_name():
    _, old, roll, mask, _ = _rand_batch(4, 6)
    assert {"none", "icepop", "tis", "seq-tis", "seq-mask", "geo-mask"} <= set(O.CORRECTIONS.names())
    c = O.CORRECTIONS.get("icepop")(old, roll, mask, IcePopConfig(low=0.5, high=5.0))
    assert torch.equal(c.weights, O.icepop_weights(old, roll, mask)) and torch.equal(c.mask, mask)
    zero = ((c.weights == 0).double() * mask).sum() / mask.sum()
    assert torch.allclose(c.metrics["masked_fraction"], zero)
    r = O.CORRECTIONS.get("seq-mask")(old, roll, mask, SeqMaskConfig())
    assert r.weights is None and torch.equal(r.mask, O.seq_reject_mask(old, roll, mask, 0.5, 2.0))
    with pytest.raises(ValueError, match="unknown mismatch correction 'mis'.*icepop"):
        O.CORRECTIONS.get("mis")

    assert O.CORRECTIONS.config_class("geo-mask")() == GeoMaskConfig(low=0.999, high=1.001)


def test_a_new_loss_is_one_function_and_its_config():
    """A registry of the test's own (the global one is left as it was)."""

    @dataclass
    class ReinforceConfig:
        scale: float = 1.0

    losses = O.Registry("policy loss")

    @losses.register("reinforce", config=ReinforceConfig)
    def reinforce(x: O.LossInputs, cfg: ReinforceConfig):
        return -cfg.scale * (x.advantages[:, None] * x.logp * x.mask).sum() / x.num_tokens, {}

    assert losses.get("reinforce") is reinforce and losses.name_of(ReinforceConfig(2.0)) == "reinforce"
    with pytest.raises(ValueError, match="already registered"):
        losses.register("reinforce")(reinforce)
    with pytest.raises(ValueError, match="not the config of any registered"):
        losses.name_of(GSPOConfig())
    losses.unregister("reinforce")
    assert "reinforce" not in losses
    assert "reinforce" not in O.POLICY_LOSSES


@pytest.mark.parametrize("preset", ["gspo", "ppo"])
def test_registered_losses_equal_the_tensor_functions(preset):
    """The registered form (typed inputs + config) is the tensor function with the config's values."""
    logp, old, roll, mask, adv = _rand_batch(4, 6)
    cfg = {"gspo": GSPOConfig(), "ppo": PPOConfig()}[preset]
    x = O.LossInputs(logp, old, roll, adv, mask, None, float(mask.sum()), float((mask.sum(-1) > 0).sum()))
    got, _ = O.POLICY_LOSSES.get(preset)(x, cfg)
    if preset == "gspo":
        want, _ = O.gspo_loss(logp, old, adv, mask, 3e-4, 4e-4, agg="seq-mean-token-mean")
    else:
        want, _ = O.ppo_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0, agg="token-mean")
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_objective_uses_the_fused_gspo_loss_with_global_counts(agg):
    """algorithm.fused_loss=true (default) sends GSPO through the fused kernel's path: same loss,
    gradient and metrics as the torch loss, on padded rows (one without response tokens), with
    IcePop weights and mini-batch counts other than this micro-batch's."""
    from moe_rl.config import AlgorithmConfig

    logp, old, roll, mask, adv = _rand_batch(5, 9)
    mask[2] = 0
    counts = {"num_tokens": float(mask.sum()) * 3, "num_seqs": 11.0}
    mb = O.LossInputs(old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, **counts)
    mb.weights = O.icepop_weights(old, roll, mask)
    out = {}
    for fused in (True, False):
        obj = O.Objective(AlgorithmConfig(loss=GSPOConfig(agg=agg), fused_loss=fused), group_size=5)
        assert obj.fused is fused and obj.fused_note is None
        x = logp.clone().requires_grad_(True)
        loss, metrics = obj.loss(x, mb)
        loss.backward()
        out[fused] = (loss, x.grad, metrics)
    (l1, g1, m1), (l2, g2, m2) = out[True], out[False]
    assert torch.allclose(l1, l2, rtol=1e-6, atol=1e-8) and torch.allclose(g1, g2, rtol=1e-5, atol=1e-9)
    assert m1.keys() == m2.keys()
    for k in m1:
        assert torch.allclose(m1[k], m2[k], rtol=1e-6, atol=1e-8), k


def test_the_fused_gspo_loss_over_a_packed_row_equals_it_over_padded_rows():
    """`mb["packed"]` (the row a packed forward ran as): the fused loss runs over the packed tokens with the row's
    cu_seqlens (a sample without response tokens, a tail of padding) and gives the padded rows' loss, gradient and
    metrics."""
    from moe_rl.actor.packing import pack_bin
    from moe_rl.config import AlgorithmConfig
    from moe_rl.objectives.policy_loss import PackedRows

    logp, old, roll, mask, adv = _rand_batch(5, 9)
    lengths = (mask.sum(-1) + 1).long()  # each sample's tokens: its prompt token, then its response
    _, pack, _ = pack_bin(torch.zeros(5, 9, dtype=torch.long), lengths, list(range(5)), int(lengths.sum()) + 3, {})
    assert pack.cu_seqlens.numel() == 5 + 2  # five samples, then the padding
    counts = {"num_tokens": float(mask.sum()) * 2, "num_seqs": 9.0}
    mb = O.LossInputs(old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, **counts)
    mb.weights = O.icepop_weights(old, roll, mask)
    obj = O.Objective(AlgorithmConfig(), group_size=5)
    out = []
    for packed in (PackedRows(pack.gather, pack.valid, pack.cu_seqlens, pack.sample.shape[0]), None):
        x = logp.clone().requires_grad_(True)
        loss, metrics = obj.loss(x, replace(mb, packed=packed))
        loss.backward()
        out.append((loss, x.grad, metrics))
    (l1, g1, m1), (l2, g2, m2) = out
    assert torch.allclose(l1, l2, rtol=1e-12, atol=0) and torch.allclose(g1, g2, rtol=1e-12, atol=0)
    assert m1.keys() == m2.keys() and all(torch.allclose(m1[k], m2[k], rtol=1e-12, atol=0) for k in m1)


def test_a_loss_without_fused_kernel_says_so_once():
    from moe_rl.config import AlgorithmConfig

    obj = O.Objective(AlgorithmConfig(loss=PPOConfig()), group_size=4)
    assert not obj.fused
    assert obj.fused_note == (
        "algorithm.fused_loss: loss 'ppo' has no fused kernel (fused: ['gspo']); it runs as the torch loss"
    )
    assert O.Objective(AlgorithmConfig(loss=PPOConfig(), fused_loss=False), group_size=4).fused_note is None


# ---- KL -------------------------------------------------------------------------------------


def test_kl_estimators():
    logp, old, _, mask, _ = _rand_batch(4, 6, scale=0.4)
    ref = old
    assert torch.allclose(O.kl_penalty(logp, ref, "k1"), logp - ref)
    d = ref - logp
    assert torch.allclose(O.kl_penalty(logp, ref, "k3"), torch.exp(d) - d - 1)
    assert (O.kl_penalty(logp, ref, "k3") >= 0).all()


def _verl_kl_penalty(logprob, ref_logprob, kind):
    """verl's core_algos.kl_penalty (kl, low_var_kl branches), transcribed."""
    if kind == "kl":
        return logprob - ref_logprob
    kl = (ref_logprob - logprob).clamp(min=-20, max=20)
    ratio = torch.exp(kl)
    return torch.clamp(ratio - kl - 1, min=-10, max=10)


def test_low_var_kl_is_verls():
    logp, old, _, _, _ = _rand_batch(5, 8, scale=3.0)  # log-ratios large enough to reach the clamp
    logp[0, 0] = old[0, 0] - 3.0  # and one surely does (k3 = e^3 - 4 = 16)
    assert (O.kl_penalty(logp, old, "k3") > 10).any()
    assert torch.equal(O.kl_penalty(logp, old, "low_var_kl"), _verl_kl_penalty(logp, old, "low_var_kl"))
    assert torch.equal(O.kl_penalty(logp, old, "k1"), _verl_kl_penalty(logp, old, "kl"))


@pytest.mark.parametrize("kind", ["k1", "k3", "low_var_kl"])
def test_objective_adds_the_reference_kl_and_the_entropy_bonus(kind):
    """loss = policy loss + kl_coef * sum(KL * mask) / num_tokens - entropy_coef * sum(H * mask) / num_tokens,
    in value and gradient; kl_ref is the micro-batch's token mean; pi_theta == pi_ref gives exactly 0."""
    from moe_rl.config import AlgorithmConfig

    logp, old, roll, mask, adv = _rand_batch(5, 9, scale=0.3)
    ref = old + 0.2 * torch.randn_like(old)
    ent = torch.rand_like(old) * 3
    counts = {"num_tokens": float(mask.sum()) * 2, "num_seqs": 7.0}
    mb = O.LossInputs(old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, weights=None, **counts)
    plain = O.Objective(AlgorithmConfig(fused_loss=False), group_size=5)
    both = O.Objective(AlgorithmConfig(fused_loss=False, kl_coef=0.3, kl_type=kind, entropy_coef=0.05), 5)
    x0, x1 = logp.clone().requires_grad_(True), logp.clone().requires_grad_(True)
    l0, _ = plain.loss(x0, replace(mb))
    l1, m1 = both.loss(x1, replace(mb, ref_logp=ref, entropy=ent))
    l0.backward()
    l1.backward()
    n = counts["num_tokens"]
    kl = {"k1": logp - ref, "k3": (ref - logp).exp() - (ref - logp) - 1}.get(kind)
    kl = _verl_kl_penalty(logp, ref, "low_var_kl") if kind == "low_var_kl" else kl
    want = l0 + 0.3 * (kl * mask).sum() / n - 0.05 * (ent * mask).sum() / n
    assert torch.allclose(l1, want, rtol=1e-10, atol=1e-12)
    dkl = {"k1": torch.ones_like(logp)}.get(kind, 1 - (ref - logp).exp())
    assert torch.allclose(x1.grad - x0.grad, 0.3 * dkl * mask / n, rtol=1e-8, atol=1e-12)
    assert torch.allclose(m1["kl_ref"], (kl * mask).sum() / mask.sum())
    _, m_same = both.loss(logp, replace(mb, ref_logp=logp.clone(), entropy=ent))
    assert m_same["kl_ref"].item() == 0.0


def test_kl_in_reward_takes_the_shaped_total_from_each_reward():
    """algorithm.kl_in_reward: reward - kl_coef * sum_t KL_t(pi_old || ref) = the sequence total of the
    classic token-level shaping (-kl_coef * KL_t on every response token), and no KL loss term."""
    from moe_rl.config import AlgorithmConfig

    logp, old, roll, mask, adv = _rand_batch(6, 7, scale=0.3)
    mask[1, 3] = 1  # every row has a response (the shaping puts the reward on its last token)
    rewards = torch.randn(6, dtype=torch.float64)
    obj = O.Objective(AlgorithmConfig(kl_coef=0.2, kl_type="k1", kl_in_reward=True, fused_loss=False), 6)
    # classic RLHF shaping, summed over each response: -0.2 * KL_t on every response token, plus the reward
    shaped = rewards + (-0.2 * (logp - old) * mask).sum(-1)
    assert torch.allclose(rewards - obj.reward_kl(logp, old, mask), shaped)
    plain = O.Objective(AlgorithmConfig(fused_loss=False), 6)
    counts = {"num_tokens": float(mask.sum()), "num_seqs": 6.0}
    mb = O.LossInputs(old_logp=old, rollout_logp=roll, advantages=adv, mask=mask, weights=None, **counts)
    loss, metrics = obj.loss(logp, replace(mb, ref_logp=old))
    assert torch.equal(loss, plain.loss(logp, mb)[0]) and "kl_ref" in metrics


# ---- mismatch metrics -----------------------------------------------------------------------


def test_mismatch_metrics_match_definitions():
    _, old, roll, mask, _ = _rand_batch(6, 9, seed=None)
    same = torch.rand(old.shape) < 0.3
    same[0, 1], same[2, 1] = True, False  # response tokens of both kinds whatever the draw (position 1 of rows 0, 2)
    roll = torch.where(same, old, roll)  # some tokens bitwise equal
    roll = torch.where(mask.bool(), roll, roll + 100.0)  # a padding position's difference never counts
    got = {k: float(v) for k, v in O.mismatch_metrics(old, roll, mask).items()}
    assert set(got) == set(O.MISMATCH_KEYS)
    rows = _rows(mask)
    toks = [(i, t) for i in rows for t in range(9) if mask[i, t]]
    mo = {i: np.mean([old[i, t].item() for t in range(9) if mask[i, t]]) for i in rows}
    mr = {i: np.mean([roll[i, t].item() for t in range(9) if mask[i, t]]) for i in rows}
    k = {(i, t): math.exp(old[i, t] - roll[i, t]) for i, t in toks}
    d = [mr[i] - mo[i] for i in rows]
    ref = {
        "training_ppl": np.mean([math.exp(-mo[i]) for i in rows]),
        "training_log_ppl": np.mean([-mo[i] for i in rows]),
        "rollout_ppl": np.mean([math.exp(-mr[i]) for i in rows]),
        "rollout_log_ppl": np.mean([-mr[i] for i in rows]),
        "kl": np.mean([roll[i, t].item() - old[i, t].item() for i, t in toks]),
        "k3_kl": np.mean([k[x] - math.log(k[x]) - 1 for x in toks]),
        "log_ppl_diff": np.mean(d),
        "log_ppl_abs_diff": np.mean(np.abs(d)),
        "log_ppl_diff_max": max(d),
        "log_ppl_diff_min": min(d),
        "ppl_ratio": np.mean(np.exp(d)),
        "chi2_token": np.mean([k[x] ** 2 for x in toks]) - 1,
        "chi2_seq": np.mean([math.prod(k[(i, t)] for t in range(9) if mask[i, t]) ** 2 for i in rows]) - 1,
        "k_outside_0.5_2_fraction": np.mean([not 0.5 <= k[x] <= 2 for x in toks]),
        "k_outside_icepop_fraction": np.mean([not 0.5 <= k[x] <= 5 for x in toks]),
        "ess": np.mean(list(k.values())) ** 2 / np.mean([v * v for v in k.values()]),
        "exact_fraction": np.mean([old[x].item() == roll[x].item() for x in toks]),
        "logprob_abs_diff_max": max(abs(old[x].item() - roll[x].item()) for x in toks),
    }
    assert 0 < ref["exact_fraction"] < 1
    for key, v in ref.items():
        assert got[key] == pytest.approx(v, rel=1e-5, abs=1e-6), key


def test_k3_of_a_tiny_mismatch_keeps_its_sign_and_digits():
    """fp32 engine and actor differ by |log k| ~ 1e-5: k3 ~ 5e-11 per token, which exp(x) - 1 - x in float32 rounds
    to garbage of either sign; the metric must stay >= 0 and near the float64 value."""
    _, old, _, mask, _ = _rand_batch(4, 12)
    old = old.float()  # the engine's and the actor's log-probs arrive in float32
    roll = old + 1e-5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3))
    got = float(O.mismatch_metrics(old, roll, mask)["k3_kl"])
    lk = (old.double() - roll.double())[mask.bool()]
    ref = float((lk.exp() - 1 - lk).mean())
    assert got > 0 and got == pytest.approx(ref, rel=1e-2)


def test_mismatch_metrics_identical_policies_and_errors():
    _, old, _, mask, _ = _rand_batch(3, 5)
    m = O.mismatch_metrics(old, old.clone(), mask)
    for key in ("kl", "k3_kl", "log_ppl_diff", "chi2_token", "chi2_seq", "k_outside_icepop_fraction"):
        assert abs(float(m[key])) < 1e-6, key
    assert float(m["ess"]) == pytest.approx(1.0) and float(m["ppl_ratio"]) == pytest.approx(1.0)
    assert float(m["exact_fraction"]) == 1.0 and float(m["logprob_abs_diff_max"]) == 0.0
    with pytest.raises(ValueError, match="no response tokens"):
        O.mismatch_metrics(old, old, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="shape mismatch"):
        O.mismatch_metrics(old, old[:, :3], mask)
