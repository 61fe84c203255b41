"""GAE and the clipped value loss (objectives/value.py) against hand-computed cases: gamma and lambda at
0 and 1, a mask with a gap (an observation token inside the response), the clipped branch of the value loss."""

from __future__ import annotations

import pytest
import torch

from moe_rl.objectives.value import gae_advantages, masked_whiten, value_loss, value_stats

# one prompt token, then three response tokens; the outcome reward on the last
REWARDS = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
VALUES = torch.tensor([[9.0, 0.5, 0.6, 0.7]])  # the prompt token's value must not enter
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "gamma,lam,advantages,returns",
    [
        (1.0, 1.0, [0, 0.5, 0.4, 0.3], [0, 1, 1, 1]),  # Monte Carlo: A_t = sum of rewards - V_t
        (1.0, 0.0, [0, 0.1, 0.1, 0.3], [0, 0.6, 0.7, 1.0]),  # one-step TD: A_t = r_t + V_{t+1} - V_t
        (0.0, 1.0, [0, -0.5, -0.6, 0.3], [0, 0, 0, 1]),  # gamma 0: A_t = r_t - V_t
        (0.5, 0.5, [0, -0.5 + 0.3 + 0.25 * (-0.6 + 0.35 + 0.25 * 0.3), -0.6 + 0.35 + 0.25 * 0.3, 0.3], None),
    ],
)
def test_gae_hand_computed(gamma, lam, advantages, returns):
    adv, ret = gae_advantages(REWARDS, VALUES, MASK, gamma, lam)
    assert torch.allclose(adv, torch.tensor([advantages], dtype=torch.float), atol=1e-6), adv
    want = torch.tensor([advantages]) + VALUES * MASK if returns is None else torch.tensor([returns], dtype=torch.float)
    assert torch.allclose(ret, want, atol=1e-6), ret


def test_gae_carries_over_a_gap_in_the_mask():
    """An observation token (mask 0) between sampled tokens: its value (99) and reward (5) do not enter; the
    token before it bootstraps from the next sampled token."""
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    values = torch.tensor([[0.2, 0.4, 99.0, 0.8], [0.3, 0.1, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])  # row 2: a shorter response, padded
    g, lam = 0.9, 0.8
    a3 = 1 - 0.8
    a1 = (0.9 * 0.8 - 0.4) + g * lam * a3
    a0 = (0.9 * 0.4 - 0.2) + g * lam * a1
    b1 = 1 - 0.1
    b0 = (0.9 * 0.1 - 0.3) + g * lam * b1
    adv, ret = gae_advantages(rewards, values, mask, g, lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, 0, a3], [b0, b1, 0, 0]]), atol=1e-6), adv
    assert torch.allclose(ret, torch.tensor([[a0 + 0.2, a1 + 0.4, 0, a3 + 0.8], [b0 + 0.3, b1 + 0.1, 0, 0]]), atol=1e-6)


def test_gae_rejects_bad_input():
    with pytest.raises(ValueError, match=r"values \(1, 3\).* must all be \[B, T\]"):
        gae_advantages(REWARDS, VALUES[:, :3], MASK, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma=1.5 and lam=1.0 must be in"):
        gae_advantages(REWARDS, VALUES, MASK, 1.5, 1.0)


def test_value_loss_hand_computed():
    values = torch.tensor([[0.9, 2.0, 1.5, 50.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.5, 1.2, 1.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is padding
    loss, m = value_loss(values, old, returns, mask, clip=0.2)
    # squared errors: unclipped 0.36, 0.64, 0.01; clipped (V_old +- 0.2) 0.36, 0.0, 0.16 -> max 0.36, 0.64, 0.16
    assert loss.item() == pytest.approx(0.5 * (0.36 + 0.64 + 0.16) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)  # only the third: the clipped error is larger
    assert m["values_mean"].item() == pytest.approx((0.9 + 2.0 + 1.5) / 3)
    loss.backward()  # d/dV of 0.5 * mean: (V - R) / 3 on the unclipped branch, 0 where the clip holds V
    assert torch.allclose(values.grad, torch.tensor([[(0.9 - 1.5) / 3, (2.0 - 1.2) / 3, 0.0, 0.0]]), atol=1e-6)
    unclipped, _ = value_loss(values, old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (0.36 + 0.64 + 0.01) / 3)
    with pytest.raises(ValueError, match="value clip -1 must be > 0"):
        value_loss(values, old, returns, mask, clip=-1)


def test_whiten_and_explained_variance():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = masked_whiten(x, mask)
    assert w[0, 3] == 0 and w[0, :3].mean().abs() < 1e-6 and w[0, :3].pow(2).mean() == pytest.approx(1, abs=1e-6)
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    assert value_stats(returns, returns, mask)["explained_variance"] == pytest.approx(1.0)
    flat = value_stats(torch.full_like(returns, 2.0), returns, mask)  # float32 moments: ~3e-7 off 0
    assert flat["explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert value_stats(returns, returns, mask)["returns_mean"] == pytest.approx(2.0)


def test_gae_is_a_registered_advantage_that_puts_each_reward_on_its_last_response_token():
    from moe_rl.objectives import ADVANTAGES

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    values = torch.tensor([[0.0, 0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    assert ADVANTAGES.meta("gae")["needs_values"]
    adv, ret = ADVANTAGES.get("gae")(torch.tensor([1.0, 2.0, 3.0]), 1, mask=mask, values=values, gamma=1.0, lam=1.0)
    # gamma = lambda = 1: every response token's return is its sample's reward; advantage = return - value
    assert torch.equal(ret, torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(adv, (ret - values) * mask)  # a sample without response tokens gets nothing
