"""Replay guardrails and failure modes at world size 1 (design.md, "Failure modes seen in peer systems")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.actor.config import ParallelConfig
from moe_rl.actor.forward import compute_logprobs, split_microbatches
from moe_rl.actor.model import build_model, load_hf_config
from moe_rl.actor.replay import RouteReplay, check_replay_supported
from moe_rl.actor.weights import load_hf_weights
from moe_rl.routing.layout import rank_positions, zigzag_indices
from moe_rl.routing.model_layout import moe_layout
from moe_rl.routing.records import RouteError
from tests.reference import random_batch, random_routes


@pytest.fixture(scope="module")
def actor(tiny_models, world1):
    path = tiny_models["mixtral"]
    cfg = load_hf_config(path)
    chunks, conv = build_model(cfg, ParallelConfig())
    load_hf_weights(chunks, conv, path)
    lay = moe_layout(cfg)
    return cfg, chunks, RouteReplay(chunks, lay.moe_layers, verify=True), lay


def test_guardrails_refuse_settings_that_skip_or_undo_replay(actor):
    _, chunks, _, _ = actor
    cfg = chunks[0].config
    for field, value, msg in [
        ("moe_router_fusion", True, "fused top-k never calls the replay hook"),
        ("moe_expert_capacity_factor", 1.0, "token dropping"),
        ("moe_router_load_balancing_type", "sinkhorn", "sinkhorn"),
    ]:
        old = getattr(cfg, field)
        setattr(cfg, field, value)
        try:
            with pytest.raises(ValueError, match=msg):
                check_replay_supported(cfg)
        finally:
            setattr(cfg, field, old)


def test_routes_must_be_consumed_exactly_once(actor):
    cfg, chunks, replay, lay = actor
    ids, mask = random_batch(cfg.vocab_size, 4, 10, seed=1)
    routes = random_routes(4, 10, len(lay.moe_layers), lay.topk, lay.num_experts, seed=2)
    mbs = split_microbatches(ids, mask, 2, extra={"routes": routes})
    with pytest.raises(RouteError, match="not consumed exactly once"):
        with replay.replay(mbs):
            pass  # no forward ran: every queued route is left over
    # a forward with no queued routes is an error too (never silently live routing)
    with pytest.raises(RouteError, match="found no routes to replay"):
        with replay.replay(mbs[:1]):
            compute_logprobs(chunks, ids, mask, micro_batch_size=2)
    with pytest.raises(RouteError, match="carries no 'routes'"):
        with replay.replay(split_microbatches(ids, mask, 2)):
            pass


def test_wrong_route_shapes_are_refused(actor):
    cfg, chunks, replay, lay = actor
    ids, mask = random_batch(cfg.vocab_size, 2, 8, seed=3)
    bad_k = random_routes(2, 8, len(lay.moe_layers), lay.topk + 1, lay.num_experts, seed=0)
    with pytest.raises(RouteError, match="expected \\[b, T, 4, 2\\]"):
        compute_logprobs(chunks, ids, mask, replay=replay, routes=bad_k)
    too_long = random_routes(2, 9, len(lay.moe_layers), lay.topk, lay.num_experts, seed=0)
    with pytest.raises(RouteError, match="9 positions for a 8-token micro-batch"):
        compute_logprobs(chunks, ids, mask, replay=replay, routes=too_long)
    with pytest.raises(ValueError, match="need a RouteReplay"):
        compute_logprobs(chunks, ids, mask, routes=too_long)


def test_short_routes_are_padded_with_distinct_ids_not_duplicates(actor):
    """Padding rows with duplicate ids break megatron's dispatchers; ours hold 0..K-1."""
    cfg, chunks, replay, lay = actor
    ids, mask = random_batch(cfg.vocab_size, 2, 8, seed=4)
    routes = random_routes(2, 5, len(lay.moe_layers), lay.topk, lay.num_experts, seed=5)  # 3 rows short
    targets = replay._targets(routes, 8, replay.share.layouts[0])
    for t in targets.values():
        rows = t.reshape(8, 2, -1)[5:]
        assert (rows == torch.arange(lay.topk)).all()
    out = compute_logprobs(chunks, ids, mask, replay=replay, routes=routes)
    assert torch.isfinite(out["logprobs"]).all()


def test_the_route_holder_refuses_zero_width_routes(actor):
    """Zero-width routes stand for routes another rank holds; the rank that should hold them says so instead of
    replaying filler."""
    cfg, chunks, replay, lay = actor
    ids, mask = random_batch(cfg.vocab_size, 2, 8, seed=4)
    elsewhere = random_routes(2, 8, len(lay.moe_layers), lay.topk, lay.num_experts, seed=5)[:, :0]
    assert replay.share.is_holder  # one rank: it holds its own
    with pytest.raises(RouteError, match="holds the routes of its tensor/context-parallel group but was given zero"):
        compute_logprobs(chunks, ids, mask, replay=replay, routes=elsewhere)


def test_recorded_routes_replay_bit_identically_with_other_microbatching(actor):
    """R2: record with one micro-batching, replay with another (what the update passes do)."""
    cfg, chunks, replay, _ = actor
    ids, mask = random_batch(cfg.vocab_size, 6, 11, seed=6)
    live = compute_logprobs(chunks, ids, mask, micro_batch_size=6, replay=replay, record=True)
    assert live["routes"].shape == (6, 11, 4, 2) and live["routes"].dtype == torch.uint8
    same = compute_logprobs(chunks, ids, mask, micro_batch_size=6, replay=replay, routes=live["routes"])
    assert torch.equal(same["logprobs"], live["logprobs"])
    # another micro-batching changes matmul shapes (fp32 rounding), not the routes
    again = compute_logprobs(chunks, ids, mask, micro_batch_size=2, replay=replay, record=True)
    assert torch.equal(again["routes"][mask.bool()], live["routes"][mask.bool()])
    replayed = compute_logprobs(chunks, ids, mask, micro_batch_size=2, replay=replay, routes=live["routes"])
    assert torch.allclose(replayed["logprobs"], live["logprobs"], atol=1e-5)


def test_zigzag_layouts():
    assert zigzag_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_indices(8, 2, 1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible by 2\\*cp"):
        zigzag_indices(10, 2, 0)
    assert rank_positions(8, tp=2, tp_rank=1, cp=2, cp_rank=0, sequence_parallel=True).tolist() == [6, 7]


def _expected_positions(s: int, tp: int, tp_rank: int, cp: int, cp_rank: int) -> list[int]:
    """Written out from megatron's conventions: context parallel gives rank c the zig-zag chunks
    c and 2cp-1-c of 2cp; sequence parallel then splits that rank's tokens into tp contiguous parts."""
    chunk = s // (2 * cp)
    mine = [
        *range(cp_rank * chunk, (cp_rank + 1) * chunk),
        *range((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk),
    ]
    part = len(mine) // tp
    return mine[tp_rank * part : (tp_rank + 1) * part]


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)])
def test_only_this_ranks_slice_reaches_the_device(actor, tp, cp):
    """Each rank's targets hold exactly its own positions (s_local * b rows per layer, no
    full-batch broadcast), and the ranks of a (tp, cp) group cover every position once."""
    _, _, replay, lay = actor
    b, s = 4, 16
    routes = random_routes(b, s, len(lay.moe_layers), lay.topk, lay.num_experts, seed=7)
    seen = []
    for c in range(cp):
        for t in range(tp):
            layout = dict(tp=tp, tp_rank=t, cp=cp, cp_rank=c, sequence_parallel=tp > 1)
            targets = replay._targets(routes, s, layout)
            pos = _expected_positions(s, tp, t, cp, c)
            seen += pos
            assert sorted(targets) == lay.moe_layers
            for layer, got in targets.items():
                col = lay.moe_layers.index(layer)
                want = routes[:, pos, col].transpose(0, 1).reshape(-1, lay.topk)  # token s_i * b + b_i
                assert torch.equal(got, want), (tp, cp, t, c, layer)
    assert sorted(seen) == list(range(s))


def test_rows_without_a_recorded_route_are_routed_live(actor):
    """rollout.multi_turn.missing_routes=live: a marked row (`missing_row`) takes the live router's top-k, the
    others replay as given; the dispatch check compares against what was actually used."""
    from moe_rl.routing.records import missing_row, missing_rows, validate_routes

    cfg, chunks, replay, lay = actor
    ids, mask = random_batch(cfg.vocab_size, 3, 9, seed=8)
    live = compute_logprobs(chunks, ids, mask, micro_batch_size=3, replay=replay, record=True)
    marked = live["routes"].clone()
    row = torch.from_numpy(missing_row(len(lay.moe_layers), lay.topk, np.uint8))
    marked[0, 2] = marked[2, 5] = row
    assert missing_rows(marked).all(-1).sum() == 2
    out = compute_logprobs(chunks, ids, mask, micro_batch_size=3, replay=replay, routes=marked)
    assert torch.equal(out["logprobs"], live["logprobs"])  # the marked rows were routed as the live router does
    other = live["routes"].clone()
    other[0, 2] = torch.tensor(
        [[(a + 2) % lay.num_experts, (b + 2) % lay.num_experts] for a, b in other[0, 2].tolist()]
    )
    moved = compute_logprobs(chunks, ids, mask, micro_batch_size=3, replay=replay, routes=other)
    assert not torch.equal(moved["logprobs"][0], live["logprobs"][0])  # a replayed row does change the result
    rec = marked[0].numpy()
    with pytest.raises(RouteError, match="duplicate expert ids"):
        validate_routes(rec, num_tokens=9, num_experts=lay.num_experts, num_moe_layers=4, topk=lay.topk)
    validate_routes(rec, num_tokens=9, num_experts=lay.num_experts, num_moe_layers=4, topk=lay.topk, allow_missing=True)
