"""DeepSeek-V3-style routing (GLM-4.5 tiny) in the Megatron actor: refused configs, expert-bias update,
and the routing semantics against transformers' own router on fresh random inputs."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_rl.actor.config import ParallelConfig
from moe_rl.actor.model import ModelOptions, build_model, load_hf_config
from moe_rl.actor.train_step import update_expert_bias
from moe_rl.actor.weights import load_hf_weights


def _glm(tiny_models, **config):
    cfg = copy.deepcopy(load_hf_config(tiny_models["glm4_moe"]))
    for k, v in config.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize(
    "config,msg",
    [
        (dict(norm_topk_prob=False), "norm_topk_prob=false .*always renormalises"),
        (
            dict(n_group=4, topk_group=2, num_experts_per_tok=6),
            "n_group=4, topk_group=2, num_experts_per_tok=6: .*top-2 .*top num_experts_per_tok // topk_group = 3",
        ),
    ],
)
def test_router_settings_megatron_cannot_match_are_refused(config, msg, tiny_models, world1):
    with pytest.raises(ValueError, match=msg):
        build_model(_glm(tiny_models, **config), ParallelConfig())


def test_group_scoring_that_agrees_is_accepted(tiny_models, world1):
    # top-4 of 4 groups keeping 2: megatron sums the top 4 // 2 = 2 per group, as transformers does
    chunks, _ = build_model(_glm(tiny_models, n_group=4, topk_group=2, num_experts_per_tok=4), ParallelConfig())
    assert (chunks[0].config.moe_router_num_groups, chunks[0].config.moe_router_group_topk) == (4, 2)
    # every group kept: no group limit at all
    chunks, _ = build_model(_glm(tiny_models, n_group=2, topk_group=2, num_experts_per_tok=3), ParallelConfig())
    assert chunks[0].config.moe_router_num_groups is None


def _forward_with_grad(chunks, seed):
    from moe_rl.actor.forward import run_schedule, split_microbatches

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (2, 16), generator=g)
    mbs = split_microbatches(ids, torch.ones_like(ids), micro_batch_size=2)
    run_schedule(chunks, mbs, lambda logits, mb: (logits.float().mean(), {}), forward_only=False)


def test_expert_bias_moves_only_when_its_rate_is_set(tiny_models, world1):
    path = tiny_models["glm4_moe"]
    for rate in (0.0, 0.05):
        chunks, conv = build_model(load_hf_config(path), ParallelConfig(), ModelOptions(expert_bias_update_rate=rate))
        load_hf_weights(chunks, conv, path)
        routers = [layer.mlp.router for layer in chunks[0].decoder.layers if hasattr(layer.mlp, "router")]
        before = [r.expert_bias.clone() for r in routers]
        _forward_with_grad(chunks, seed=int(torch.randint(0, 2**31, ())))
        counts = [r.local_tokens_per_expert.clone() for r in routers]
        assert all(int(c.sum()) == 2 * 16 * 2 for c in counts)  # tokens x top-2
        update_expert_bias(chunks)
        for r, b, c in zip(routers, before, counts, strict=True):
            # megatron's aux-loss-free rule: +rate for experts under the mean load, -rate above it
            expected = b + rate * torch.sign(c.mean() - c)
            assert torch.equal(r.expert_bias, expected)
            assert (r.local_tokens_per_expert == 0).all()
        if rate:
            assert any(not torch.equal(r.expert_bias, b) for r, b in zip(routers, before, strict=True))


def test_expert_bias_rate_on_a_model_without_bias_is_refused(tiny_models, world1):
    with pytest.raises(ValueError, match="actor.expert_bias_update_rate=0.1: model_type='mixtral' has no expert bias"):
        build_model(load_hf_config(tiny_models["mixtral"]), ParallelConfig(), ModelOptions(expert_bias_update_rate=0.1))
