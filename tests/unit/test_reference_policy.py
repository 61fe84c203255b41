"""The reference policy of algorithm.kl_coef: frozen initial weights in the actor's layout, routed
like the actor; actor/kl_ref is exactly 0 while pi_theta = pi_ref and grows as the actor moves."""

from __future__ import annotations

import pytest
import torch

from moe_rl.actor.actor import Actor
from moe_rl.common.batch import PaddedBatch
from moe_rl.config import TrainConfig
from moe_rl.objectives import Objective
from tests.reference import random_batch


def _batch(vocab: int, routes_from=None) -> PaddedBatch:
    ids, attn = random_batch(vocab, batch=8, length=14, seed=int(torch.randint(0, 2**31, ()).item()), min_len=8)
    loss_mask = attn.float().clone()
    loss_mask[:, :4] = 0  # 4 prompt tokens
    return PaddedBatch(ids, attn, loss_mask, torch.zeros(ids.shape), routes_from)


@pytest.mark.parametrize("replay", ["r2", "off"])
def test_kl_ref_is_zero_on_the_first_minibatch_then_grows(replay, tiny_models, world1):
    cfg = TrainConfig()
    cfg.actor.router_replay, cfg.actor.mini_batches, cfg.actor.micro_batch_size = replay, 2, 4
    cfg.actor.lr = 3e-2
    cfg.algorithm.kl_coef = 0.1
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, tiny_models["qwen3_moe"], record_routes=False, reference=True)
    ref_chunks, _ = actor.reference
    assert all(not p.requires_grad for c in ref_chunks for p in c.parameters())
    frozen = [p.detach().clone() for c in ref_chunks for p in c.parameters()]
    objective = Objective(cfg.algorithm, group_size=4)
    padded = _batch(actor.hf_config.vocab_size)
    padded.rollout_logprobs = actor.old_logprobs(padded).logprobs  # mu = pi_old: no correction at play
    kls = []
    for step in range(3):
        old = actor.old_logprobs(padded)
        ref = actor.ref_logprobs(padded, old)
        if step == 0:  # same weights and routes: the old log-probs (bitwise where both passes route live;
            # under R2 the old pass records and the reference replays, fp32 rounding of the padding's experts)
            assert torch.allclose(ref, old.logprobs, rtol=0, atol=0 if replay == "off" else 1e-5)
        adv = torch.randn(8)
        m = actor.train(padded, old, adv, objective, lambda skipped, i: skipped, ref)
        kls.append((m["actor/first_minibatch_kl_ref"], m["actor/kl_ref"]))
    assert kls[0][0] == 0.0 and kls[0][1] > 0.0  # the second mini-batch follows an update
    assert kls[2][0] > kls[0][1] > 0.0, kls  # the actor moves away from the reference
    assert all(torch.equal(a, p) for a, p in zip(frozen, (p for c in ref_chunks for p in c.parameters()), strict=True))
    assert not torch.equal(actor.old_logprobs(padded).logprobs, ref)


def test_no_reference_without_kl(tiny_models, world1):
    cfg = TrainConfig()
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, tiny_models["qwen3_moe"], record_routes=False)
    assert actor.reference is None
