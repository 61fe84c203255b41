"""Megatron actor vs transformers under real torchrun/gloo parallel layouts (fp32)."""

from __future__ import annotations

import pytest

from tests.conftest import read_json_results, torchrun

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "ep2": (2, ["--ep", "2"]),
    "tp2_sp": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "tp2_etp2": (2, ["--tp", "2", "--etp", "2"]),
    "tp2_ep2": (4, ["--tp", "2", "--ep", "2"]),
    "pp2_ep2": (4, ["--pp", "2", "--ep", "2"]),
    "cp2": (2, ["--cp", "2"]),  # the local spec's context-parallel attention (actor/context_parallel.py)
    "tp2_cp2_ep2": (4, ["--tp", "2", "--cp", "2", "--ep", "2"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_parity_with_transformers(layout, tiny_models, tmp_path):
    nproc, args = LAYOUTS[layout]
    models = [str(tiny_models[a]) for a in ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3")]
    torchrun("tests.distributed.parity_worker", nproc, [*args, "--out", str(tmp_path), *models])
    results = read_json_results(tmp_path)
    assert len(results) == len(models) * nproc, f"expected one result per model and rank, got {len(results)}"
    last_stage = 0
    for r in results:
        where = f"{r['model']} rank {r['rank']} ({layout})"
        if "logits_max_abs_diff" in r:
            last_stage += 1
            assert r["logits_max_abs_diff"] <= 1e-4 * max(1.0, r["logits_scale"]), where
        assert r["logprobs_max_abs_diff"] <= 1e-4, where
        assert r["router_compared"] > 0, where
        assert sum(r["router_mismatches"].values()) == 0, f"{where}: {r['router_mismatches']}"
        assert r["roundtrip"] == {"missing": [], "extra": [], "unequal": [], "n": r["roundtrip"]["n"]}, where
    assert last_stage >= len(models)
    # every MoE layer was checked on some rank (pipeline stages split them)
    for model in {r["model"] for r in results}:
        layers = set().union(*(r["moe_layers_on_rank"] for r in results if r["model"] == model))
        leading_dense = "glm4" in model or "deepseek" in model
        expected = {0, 2, 3} if "qwen3" in model else {1, 2, 3} if leading_dense else {0, 1, 2, 3}
        assert layers == expected, model
