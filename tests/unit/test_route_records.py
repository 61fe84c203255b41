"""The route-record contract: validation, native/SGLang adapters, step-wise assembly."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from moe_rl.common.batch import RolloutBatch
from moe_rl.rollout.route_capture import RouteAssembler, child_request_ids
from moe_rl.routing.records import (
    RouteError,
    from_native,
    from_sglang,
    route_dtype,
    validate_routes,
)


def _routes(t, layers, k, experts, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in range(layers)]) for _ in range(t)])


def test_valid_engine_record_gets_filled_last_row_and_contract_dtype():
    r = _routes(6, 3, 2, 8)
    out = validate_routes(r, num_tokens=7, num_experts=8, num_moe_layers=3, topk=2, sample=4)
    assert out.dtype == np.uint8 and out.shape == (7, 3, 2)
    assert (out[:6] == r).all() and (out[6] == [0, 1]).all()
    big = validate_routes(_routes(4, 2, 3, 300), num_tokens=4, num_experts=300, num_moe_layers=2, topk=3)
    assert big.dtype == np.int16 and big.max() < 300
    assert route_dtype(256) == np.uint8 and route_dtype(257) == np.int16
    with pytest.raises(RouteError, match="32767"):
        route_dtype(40000)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda r: r[:4], "sample 3: routes have 4 rows for 7 tokens"),
        (lambda r: r[:, :2], "routes have 2 layers, the model has 3 MoE layers"),
        (lambda r: r.astype(np.float32), "integer expert ids"),
        (
            lambda r: np.where(np.arange(r.size).reshape(r.shape) == 7, 8, r),
            "sample 3, MoE layer 0, token 1: expert id 8 out",
        ),
        (lambda r: np.concatenate([r[:2], np.full((1, 3, 2), 5), r[3:]]), "sample 3, MoE layer 0, token 2: duplicate"),
    ],
)
def test_malformed_routes_are_refused_naming_sample_and_layer(mutate, msg):
    r = _routes(6, 3, 2, 8)
    with pytest.raises(RouteError, match=msg):
        validate_routes(mutate(r), num_tokens=7, num_experts=8, num_moe_layers=3, topk=2, sample=3)


def test_native_adapter_drops_dense_layers_and_keeps_uint16_ids():
    # 4 decoder layers, layer 1 dense (zeros), 300 experts -> uint16 as vLLM returns it
    moe = _routes(9, 3, 4, 300, seed=1).astype(np.uint16)
    native = np.zeros((9, 4, 4), dtype=np.uint16)
    native[:, [0, 2, 3]] = moe
    out = from_native(native, moe_layers=[0, 2, 3], sample=2)
    assert out.dtype == np.int16 and (out == moe).all()
    rec = validate_routes(out, num_tokens=10, num_experts=300, num_moe_layers=3, topk=4)
    assert rec.shape == (10, 3, 4)
    bad = native.copy()
    bad[5, 1, 0] = 3
    with pytest.raises(RouteError, match="sample 2, decoder layer 1: the model config says dense"):
        from_native(bad, moe_layers=[0, 2, 3], sample=2)
    with pytest.raises(RouteError, match="MoE layer 4 does not exist"):
        from_native(native, moe_layers=[0, 4])


def test_sglang_base64_int32_decodes_to_the_same_record():
    moe = _routes(5, 2, 2, 64, seed=3)
    full = np.zeros((5, 3, 2), dtype="<i4")
    full[:, [0, 2]] = moe
    b64 = base64.b64encode(full.tobytes()).decode()
    out = from_sglang(b64, num_tokens=6, num_layers=3, topk=2, moe_layers=[0, 2])
    assert (out == moe).all() and out.dtype == np.uint8
    # int32 + base64 is 4 * 4/3 = 5.3x the uint8 record
    assert len(b64) / out.nbytes > 5
    with pytest.raises(RouteError, match="bytes of routes, expected"):
        from_sglang(b64, num_tokens=7, num_layers=3, topk=2, moe_layers=[0, 2])
    with pytest.raises(RouteError, match="not valid base64"):
        from_sglang("@@@", num_tokens=6, num_layers=3, topk=2, moe_layers=[0, 2])


def test_assembler_places_rows_by_request_and_position():
    a = RouteAssembler(moe_layers=[0, 2], topk=2, dtype=np.uint8)
    # step 1: prefill of two requests (3 and 2 tokens); step 2: one decode token each
    a.begin_step(["r1", "r2"], [3, 2], [0, 0])
    rows1 = np.arange(10, dtype=np.int32).reshape(5, 2)
    a.add_layer(0, rows1)
    a.add_layer(2, rows1 + 100)
    a.begin_step(["r2", "r1"], [1, 1], [2, 3])
    rows2 = np.array([[50, 51], [60, 61]])
    a.add_layer(0, rows2)
    a.add_layer(2, rows2 + 100)
    r1 = a.take("r1", 4)
    assert (r1[:3, 0] == rows1[:3]).all() and (r1[3, 0] == [60, 61]).all() and (r1[:, 1] == r1[:, 0] + 100).all()
    r2 = a.take("r2", 3)
    assert (r2[:2, 0] == rows1[3:]).all() and (r2[2, 0] == [50, 51]).all()
    with pytest.raises(RouteError, match="not an MoE layer"):
        a.add_layer(1, rows2)
    a.begin_step(["r3"], [2], [0])
    a.add_layer(0, np.zeros((2, 2)))
    with pytest.raises(RouteError, match="r3: routes captured for 0 positions, 2 needed"):
        a.take("r3", 2)  # layer 2 never captured: a forward bypassed the hook


def test_child_request_ids():
    ids = ["1_7-ab", "0_7-cd", "0_8-ef", "9-xx"]
    assert child_request_ids("7", 2, ids) == ["0_7-cd", "1_7-ab"]
    assert child_request_ids("9", 1, ids) == ["9-xx"]
    with pytest.raises(RouteError, match="expected one engine request"):
        child_request_ids("8", 2, ids)


def test_rollout_batch_padding_aligns_tokens_logprobs_and_routes():
    r0 = validate_routes(_routes(4, 2, 2, 8), num_tokens=5, num_experts=8, num_moe_layers=2, topk=2)
    r1 = validate_routes(_routes(2, 2, 2, 8, seed=1), num_tokens=3, num_experts=8, num_moe_layers=2, topk=2)
    b = RolloutBatch(
        [[1, 2], [3]],
        [[4, 5, 6], [7, 8]],
        [np.array([-1.0, -2.0, -3.0]), np.array([-4.0, -5.0])],
        ["length", "stop"],
        np.array([0, 1]),
        np.array([0, 0]),
        [r0, r1],
        [0, 2],
        8,
        2,
    )
    p = b.to_padded(pad_to_multiple=4)
    assert p.input_ids.tolist() == [[1, 2, 4, 5, 6, 0, 0, 0], [3, 7, 8, 0, 0, 0, 0, 0]]
    assert p.loss_mask.tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]]
    assert p.rollout_logprobs[0, 2:5].tolist() == [-1, -2, -3] and p.rollout_logprobs[1, 1:3].tolist() == [-4, -5]
    assert p.routes.shape == (2, 8, 2, 2) and (p.routes[0, :5].numpy() == r0).all()
    # padding rows hold distinct ids (never duplicates, which break dispatchers)
    assert (p.routes[1, 3:].numpy() == [0, 1]).all()
    # a pipeline stage gets its own MoE layers' routes only
    stage = b.only_layers([2])
    assert stage.moe_layers == [2] and [r.shape for r in stage.routes] == [(5, 1, 2), (3, 1, 2)]
    assert (stage.routes[0][:, 0] == r0[:, 1]).all() and (stage.routes[1][:, 0] == r1[:, 1]).all()
    assert stage.to_padded(pad_to_multiple=4).routes.shape == (2, 8, 1, 2)
    assert b.only_layers([0, 2]) is b
    with pytest.raises(ValueError, match=r"MoE layers \[1\] are not among the route layers \[0, 2\]"):
        b.only_layers([1])
    # a tensor/context-parallel peer gets no route bytes: zero-width routes, in its stage's layers and dtype
    from moe_rl.rollout.source import share_of

    peer = share_of(b, [2], holds_routes=False)
    assert [r.shape for r in peer.routes] == [(0, 1, 2), (0, 1, 2)] and peer.routes[0].dtype == r0.dtype
    padded = peer.to_padded(pad_to_multiple=4)
    assert padded.routes.shape == (2, 0, 1, 2) and padded.input_ids.tolist() == p.input_ids.tolist()
    holder = share_of(b, [2], holds_routes=True)
    assert all((h == s).all() for h, s in zip(holder.routes, stage.routes, strict=True))
