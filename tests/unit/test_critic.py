"""The Megatron MoE critic (moe_rl/critic): a fresh value head starts at V = 0 on real tokens only; its
update regresses the values onto fixed returns (the value loss falls, explained variance rises); under R2
the update replays its own values pass's routes exactly; a checkpoint round trip restores its values."""

from __future__ import annotations

import torch

from moe_rl.common.batch import PaddedBatch
from moe_rl.config import TrainConfig
from moe_rl.objectives.value import value_stats
from tests.reference import random_batch


def _batch(vocab: int) -> PaddedBatch:
    ids, attn = random_batch(vocab, batch=8, length=14, seed=int(torch.randint(0, 2**31, ()).item()), min_len=8)
    loss_mask = attn.float().clone()
    loss_mask[:, :4] = 0  # 4 prompt tokens
    return PaddedBatch(ids, attn, loss_mask, torch.zeros(ids.shape), None)


def test_critic_learns_fixed_returns_with_its_own_routes_replayed(tiny_models, world1, tmp_path):
    from moe_rl.critic.critic import Critic
    from moe_rl.trainer import checkpoint

    cfg = TrainConfig()
    cfg.critic.lr = 1e-2
    sections = cfg.critic, cfg.model, cfg.parallel, cfg.actor, tiny_models["qwen3_moe"]
    critic = Critic(*sections)
    padded = _batch(critic.layout.num_experts * 0 + 512)
    old = critic.values(padded)
    assert torch.equal(old["values"], torch.zeros_like(old["values"]))  # a fresh head: V = 0
    assert old["routes"].shape[:2] == padded.input_ids.shape
    returns = (torch.rand(8, 1) + 0.5 * torch.randn(8, 14)) * padded.loss_mask  # per-sample level + noise
    history = []
    for _ in range(8):
        old = critic.values(padded)
        critic.replay.dispatch_check(reset=True)
        m = critic.train(padded, old, returns, clip=None, mini_batches=2)
        checked, mismatched = critic.replay.dispatch_check()
        assert checked > 0 and mismatched == 0  # the update routed exactly as its values pass
        explained = value_stats(old["values"], returns, padded.loss_mask)["explained_variance"]
        history.append((m["critic/value_loss"], explained))
    assert history[-1][0] < 0.5 * history[0][0], history
    assert history[-1][1] > history[1][1], history
    assert set(m) >= {"critic/value_loss", "critic/vf_clipfrac", "critic/values_mean", "critic/grad_norm"}
    values = critic.values(padded)["values"]
    assert torch.equal(values * (1 - padded.attention_mask), torch.zeros_like(values))  # nothing on padding
    # checkpoint round trip: a new critic restored from it gives the same values
    path = checkpoint.save(tmp_path, 8, critic.chunks, critic.optimizer, {})
    restored = Critic(*sections)
    checkpoint.load(path, restored.chunks, restored.optimizer)
    assert torch.equal(restored.values(padded)["values"], values)
