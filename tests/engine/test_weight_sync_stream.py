"""The streaming weight sync delivers the actor's weights into real vLLM engines under TP=2 (one
engine, shards gathered over TP, shared-memory transport) and EP=2 (two engines, each getting the
other rank's experts over gloo point-to-point, rpc transport): after the sync every engine scores
fixed sequences like the perturbed actor does (fp32), before it they differ. A model whose LM head is
tied to its embedding gets its head through the embedding (vLLM loads nothing into the head itself)."""

from __future__ import annotations

import pytest

from tests.conftest import read_json_results, torchrun

pytestmark = [pytest.mark.engine, pytest.mark.distributed]


@pytest.mark.parametrize(
    ("model", "layout", "transport", "engines", "tensors"),
    [
        ("qwen3_moe", "tp=2", "shm", 1, 113),
        ("qwen3_moe", "ep=2", "rpc", 2, 113),
        ("qwen3_moe_tied", "tp=2", "shm", 1, 112),  # no lm_head.weight: the embedding is the head
    ],
)
def test_streamed_weights_reach_every_engine(model, layout, transport, engines, tensors, tiny_models, tmp_path):
    args = [str(tiny_models[model]), "--layout", layout, "--transport", transport, "--out", str(tmp_path)]
    torchrun("tests.engine.weight_sync_worker", 2, args)
    results = read_json_results(tmp_path)
    assert len(results) == engines
    for r in results:
        assert r["before"] > 1e-2, r  # the perturbation is visible to an engine that was not synced
        assert r["after"] < 1e-4, r
        assert r["buckets"] >= 2 and r["tensors"] == tensors, r
