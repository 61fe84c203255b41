"""Padding-free packing (actor.packing): bins, the block-diagonal mask, and the actor's passes
packed vs padded at world size 1 (fp32), with the plain causal mask as the negative control."""

from __future__ import annotations

import random

import pytest
import torch

from moe_rl.actor.config import ParallelConfig
from moe_rl.actor.forward import compute_logprobs, run_schedule, split_microbatches
from moe_rl.actor.model import build_model, load_hf_config
from moe_rl.actor.packing import balanced_bins, check_packing_supported, plan_packing
from moe_rl.actor.replay import RouteReplay
from moe_rl.actor.weights import load_hf_weights
from moe_rl.routing.model_layout import moe_layout
from tests.reference import load_hf, untied_batch


def test_balanced_bins_cover_every_sample_within_the_budget():
    rng = random.Random()
    for _ in range(50):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(30, 200)
        bins = balanced_bins(lengths, budget)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        for b in bins:
            assert len(b) == 1 or sum(lengths[i] for i in b) <= budget
        over = sum(n >= budget for n in lengths)  # alone in their bins
        assert len(bins) >= over + -(-sum(n for n in lengths if n < budget) // budget)
        assert balanced_bins(lengths, budget) == bins  # deterministic
        more = balanced_bins(lengths, budget, min_bins=len(bins) + 2)
        assert len(more) == len(bins) + 2 and sorted(i for b in more for i in b) == list(range(len(lengths)))
    assert balanced_bins([500, 3, 4], budget=100) == [[0], [1, 2]]  # a sample over the budget: alone


def test_plan_groups_stay_within_their_mini_batch(world1):
    lengths = [5, 9, 3, 7, 12, 4, 6, 8]
    plan = plan_packing(lengths, budget=14, groups=2, pad_multiple=4)
    for g, bins in enumerate(plan.groups):
        assert sorted(i for b in bins for i in b) == list(range(4 * g, 4 * g + 4))
    for b, n in zip(plan.bins, plan.seq_lens, strict=True):
        assert n % 4 == 0 and sum(lengths[i] for i in b) <= n < sum(lengths[i] for i in b) + 4
    assert plan.group(1, 4).groups == [[[i - 4 for i in b] for b in plan.groups[1]]]
    assert plan.group(1, 4).seq_lens == plan.lengths[1]
    one = plan_packing(lengths, budget=14, groups=2, pad_multiple=4, one_length=True)
    assert set(one.seq_lens) == {max(plan.seq_lens)}


def _model(path):
    cfg = load_hf_config(path)
    chunks, conv = build_model(cfg, ParallelConfig())
    load_hf_weights(chunks, conv, path)
    return cfg, chunks


def _batch(path, vocab):
    """Fresh random samples with no token near a routing tie: packing moves a sample to other absolute
    positions, whose fp32 rounding (~1e-7) may flip a near-tied top-k and fail the comparison by chance."""
    seed = int(torch.randint(0, 2**31, ()).item())
    ids, mask, *_ = untied_batch(load_hf(str(path)), vocab, batch=8, length=23, seed=seed, min_len=2)
    return ids, mask


@pytest.mark.parametrize("fused", [True, False])
def test_packed_logprobs_equal_padded_and_a_causal_mask_leaks(fused, tiny_models, world1):
    cfg, chunks = _model(tiny_models["qwen3_moe"])
    ids, mask = _batch(tiny_models["qwen3_moe"], cfg.vocab_size)
    padded = compute_logprobs(chunks, ids, mask, micro_batch_size=3, fused=fused)
    plan = plan_packing(mask.sum(-1).tolist(), 40)  # several bins
    assert max(len(b) for b in plan.bins) > 1
    packed = compute_logprobs(chunks, ids, mask, fused=fused, pack=plan)
    for k in ("logprobs", "entropy"):  # fp32 rounding (RoPE at other absolute positions), relative
        scale = max(1.0, padded[k].abs().max().item())
        assert (packed[k] - padded[k]).abs().max().item() <= 5e-6 * scale, k
        assert (packed[k][mask == 0] == 0).all() and (packed[k][:, 0] == 0).all()

    # negative control: the same packs under a plain causal mask see the samples before them
    mbs = split_microbatches(ids, mask, 1, pack=plan)
    for mb in mbs:
        n = mb.input_ids.shape[1]
        mb.pack.attn_mask = torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), 1)
    leaked = torch.zeros_like(padded["logprobs"])
    with torch.no_grad():
        out = run_schedule(chunks, mbs, lambda lg, mb: (lg.new_zeros(()), {"lp": _lp(lg, mb, ids.shape[1])}), True)
    for mb, r in zip(mbs, out, strict=True):
        leaked[mb.index] = r["lp"]
    leaked = leaked * mask
    leaked[:, 0] = 0
    assert (leaked - padded["logprobs"]).abs().max().item() > 1e-2


def _lp(logits, mb, t):
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, mb.input_ids[:, 1:, None])[..., 0]
    return mb.aligned(lp, t)


def test_r2_routes_recorded_packed_replay_like_padded(tiny_models, world1):
    """R2: the routes a packed pass records are the padded pass's, and replaying them packed gives the
    padded replay's log-probs (filler ids on padding never reach a sample)."""
    path = tiny_models["qwen3_moe"]
    cfg, chunks = _model(path)
    layout = moe_layout(cfg)
    replay = RouteReplay(chunks, layout.moe_layers, verify=True)
    ids, mask = _batch(tiny_models["qwen3_moe"], cfg.vocab_size)
    lengths = mask.sum(-1).tolist()
    padded = compute_logprobs(chunks, ids, mask, 4, replay=replay, record=True)
    packed = compute_logprobs(chunks, ids, mask, replay=replay, record=True, pack=plan_packing(lengths, 50, groups=2))
    real = mask.bool()
    assert torch.equal(padded["routes"][real], packed["routes"][real])
    shape = padded["routes"].shape  # random distinct experts per token and layer
    routes = torch.rand(*shape[:-1], layout.num_experts).argsort(-1)[..., : layout.topk].to(padded["routes"].dtype)
    a = compute_logprobs(chunks, ids, mask, 4, replay=replay, routes=routes)["logprobs"]
    b = compute_logprobs(chunks, ids, mask, replay=replay, routes=routes, pack=plan_packing(lengths, 50))["logprobs"]
    assert (a - b).abs().max().item() <= 5e-6 * max(1.0, a.abs().max().item())


def test_packing_refuses_token_dropping():
    class Cfg:
        moe_expert_capacity_factor = 1.0
        moe_router_load_balancing_type = "seq_aux_loss"

    with pytest.raises(ValueError, match="moe_expert_capacity_factor=1.0 .*seq_aux_loss; set actor.packing=false"):
        check_packing_supported(Cfg())


def test_bin_counts_round_up_to_the_interleaved_multiple_with_empty_bins(tiny_models, world1):
    """count_multiple (the pipeline size under the interleaved schedule): more bins than samples leaves
    empty bins, a padding row each, which changes no sample's log-probs."""
    cfg, chunks = _model(tiny_models["qwen3_moe"])
    ids, mask = _batch(tiny_models["qwen3_moe"], cfg.vocab_size)
    lengths = mask.sum(-1).tolist()
    assert len(plan_packing(lengths, 60, groups=2).bins) < 10
    plan = plan_packing(lengths, 60, groups=2, count_multiple=5)
    assert all(len(g) == 5 for g in plan.groups) and sum(not b for b in plan.bins) == 2
    assert sorted(i for b in plan.bins for i in b) == list(range(8))
    a = compute_logprobs(chunks, ids, mask, 4, with_entropy=False)["logprobs"]
    b = compute_logprobs(chunks, ids, mask, with_entropy=False, pack=plan)["logprobs"]
    assert (a - b).abs().max().item() <= 5e-6 * max(1.0, a.abs().max().item())


def test_thd_sequences_match_the_mask_and_megatrons_thd_rope_matches_sample_positions():
    """The GPU path's wiring, checked on CPU: the THD sequences (cu_seqlens) of a pack are the mask's
    blocks on every real token, and megatron's own THD RoPE over them rotates each token at its position in
    its sample, as `sample_positions` does on the mask path. (Transformer Engine attention itself needs a GPU.)"""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
        _apply_rotary_pos_emb_thd,
    )

    from moe_rl.actor.packing import pack_bin, thd_params

    lengths = torch.tensor([5, 3, 7, 2])
    ids = torch.randint(1, 50, (4, 7))
    _, pack, _ = pack_bin(ids, lengths, [2, 0, 3], 16, {})
    _, thd, _ = pack_bin(ids, lengths, [2, 0, 3], 16, {}, thd=True)
    assert thd.attn_mask is None and thd.thd and torch.equal(thd.cu_seqlens, pack.cu_seqlens)
    assert thd.cu_seqlens.tolist() == [0, 7, 12, 14, 16] and thd.cu_seqlens.dtype == torch.int32
    params = thd_params(thd)
    assert params.qkv_format == "thd" and params.max_seqlen_q == params.max_seqlen_kv == 7
    assert params.cu_seqlens_q is thd.cu_seqlens and params.cu_seqlens_kv is thd.cu_seqlens

    cu = thd.cu_seqlens.long()
    segment = torch.bucketize(torch.arange(16), cu[1:], right=True)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    real = pack.sample >= 0
    assert torch.equal(~allowed[real], pack.attn_mask[0, 0][real])

    dim = 8
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(16).float(), inv)
    freqs = torch.cat([angles, angles], -1)[:, None, None, :]  # [max_s, 1, 1, d], megatron's layout
    q = torch.randn(16, 2, dim)
    single = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    rotated = _apply_rotary_pos_emb_thd(q, thd.cu_seqlens, freqs[:7], cp_group=single)
    expected = _apply_rotary_pos_emb_bshd(q[:, None], freqs[pack.position])[:, 0]
    assert torch.allclose(rotated[real], expected[real], atol=1e-6)  # padding: positions of no sample
    shifted = _apply_rotary_pos_emb_bshd(q[:, None], freqs[:16])[:, 0]  # row positions: the control
    assert not torch.allclose(rotated[7:], shifted[7:], atol=1e-3)


def test_routes_pack_in_token_order_and_routes_held_elsewhere_stay_zero_width():
    from moe_rl.actor.packing import pack_bin

    lengths, ids = torch.tensor([5, 3, 7]), torch.randint(1, 50, (3, 7))
    routes = torch.randint(0, 8, (3, 7, 2, 2), dtype=torch.uint8)
    _, _, out = pack_bin(ids, lengths, [2, 0], 16, {"routes": routes})
    assert out["routes"].shape == (1, 16, 2, 2)
    assert torch.equal(out["routes"][0, :7], routes[2]) and torch.equal(out["routes"][0, 7:12], routes[0, :5])
    # a tensor/context-parallel peer (actor/replay.py): its group's route holder packs and cuts for it
    _, _, peer = pack_bin(ids, lengths, [2, 0], 16, {"routes": routes[:, :0]})
    assert peer["routes"].shape == (1, 0, 2, 2)


def test_a_steps_passes_share_one_packing_plan(tiny_models, world1, monkeypatch, tmp_path):
    """The old-log-prob pass, the diagnostics' forward and the update of one batch plan its bins once (planning
    is two all-reduces); the next batch is planned anew."""
    from moe_rl.actor import packing
    from moe_rl.actor.actor import Actor
    from moe_rl.common.batch import PaddedBatch
    from moe_rl.config import TrainConfig
    from moe_rl.diagnostics.step_hooks import StepDiagnostics
    from moe_rl.objectives import Objective
    from tests.reference import random_batch

    plans = []
    monkeypatch.setattr(packing, "plan_packing", lambda *a, **k: plans.append(a) or plan_packing(*a, **k))
    cfg = TrainConfig()
    cfg.actor.router_replay, cfg.actor.mini_batches = "r2", 2
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, tiny_models["qwen3_moe"], record_routes=True)
    diagnostics = StepDiagnostics(actor, tmp_path, dump_every=0, agreement_every=1, dump_meta={})
    objective = Objective(cfg.algorithm, group_size=4)
    for step in range(2):
        ids, attn = random_batch(actor.hf_config.vocab_size, batch=8, length=12, seed=step, min_len=6)
        padded = PaddedBatch(ids, attn, attn.float(), torch.zeros(ids.shape), None)
        old = actor.old_logprobs(padded)
        padded.rollout_logprobs = old.logprobs.clone()
        diagnostics.routing_views(padded, old)
        actor.train(padded, old, torch.randn(8), objective, lambda skipped, i: skipped)
        assert len(plans) == step + 1


def test_the_fused_gspo_loss_runs_over_the_packed_rows(tiny_models, world1, monkeypatch):
    """With actor.packing the fused GSPO kernel gets each forward's packed row and its `cu_seqlens` (the samples
    back to back, then the row's tail padding), not the padded rows re-flattened."""
    from moe_rl.kernels import gspo_loss

    from moe_rl.actor.actor import Actor
    from moe_rl.common.batch import PaddedBatch
    from moe_rl.config import TrainConfig
    from moe_rl.objectives import Objective
    from tests.reference import random_batch

    calls = []
    kernel = gspo_loss.fused_gspo_loss
    monkeypatch.setattr(gspo_loss, "fused_gspo_loss", lambda *a, **k: calls.append(a) or kernel(*a, **k))
    cfg = TrainConfig()
    cfg.actor.mini_batches, cfg.actor.max_tokens_per_micro_batch = 2, 40
    actor = Actor(cfg.actor, cfg.model, cfg.parallel, tiny_models["qwen3_moe"], record_routes=False)
    objective = Objective(cfg.algorithm, group_size=4)
    assert objective.fused
    ids, attn = random_batch(actor.hf_config.vocab_size, batch=8, length=23, seed=0, min_len=6)
    padded = PaddedBatch(ids, attn, attn.float(), torch.zeros(ids.shape), None)
    old = actor.old_logprobs(padded)
    padded.rollout_logprobs = old.logprobs.clone()
    actor.train(padded, old, torch.randn(8), objective, lambda skipped, i: skipped)

    plan = actor.pack_plan(padded)
    packs = [
        mb.pack
        for i in range(2)
        for mb in split_microbatches(ids[i * 4 : i * 4 + 4], attn[i * 4 : i * 4 + 4], 1, pack=plan.group(i, i * 4))
    ]
    assert len(calls) == len(packs) == len(plan.bins) > 2
    for (logp, _, advantages, mask, cu_seqlens), pack in zip(calls, packs, strict=True):
        assert cu_seqlens.tolist() == pack.cu_seqlens.tolist()
        assert logp.shape == mask.shape == pack.sample.shape  # the packed row, not [n * T]
        assert advantages.shape == (len(cu_seqlens) - 1,)
        assert (mask[pack.sample < 0] == 0).all()  # nothing trains on the row's padding
