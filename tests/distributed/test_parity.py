"""Megatron actor vs transformers under real torchrun/gloo parallel layouts (fp32)."""

from __future__ import annotations

import pytest

from tests.conftest import grouped_launches, read_json_results

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "ep2": (2, ["--ep", "2"]),
    "tp2_sp": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "pp2_first3": (2, ["--pp", "2", "--first-stage-layers", "3"]),  # stages of 3 and 1 layers (megatron's uneven PP)
    "tp2_etp2": (2, ["--tp", "2", "--etp", "2"]),
    "tp2_ep2": (4, ["--tp", "2", "--ep", "2"]),
    "pp2_ep2": (4, ["--pp", "2", "--ep", "2"]),
    "cp2": (2, ["--cp", "2"]),  # the local spec's context-parallel attention (actor/context_parallel.py)
    "tp2_cp2_ep2": (4, ["--tp", "2", "--cp", "2", "--ep", "2"]),
}


MODELS = ("qwen3_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss")
# GPT-OSS refuses context parallelism (sinks, sliding window) and expert TP (expert biases): test_actor_world1.py
REFUSED = {"cp2": {"gpt_oss"}, "tp2_cp2_ep2": {"gpt_oss"}, "tp2_etp2": {"gpt_oss"}}
# uneven stages: one family with a dense second layer, one with a dense first layer
ONLY = {"pp2_first3": {"qwen3_moe", "deepseek_v3"}}


def _models(layout: str) -> list[str]:
    return [m for m in MODELS if m not in REFUSED.get(layout, set()) and m in ONLY.get(layout, MODELS)]


@pytest.fixture(scope="module")
def parity_run(tiny_models, tmp_path_factory):
    """`parity_run(layout)` -> its results folder. The layouts of one world size share a torchrun launch."""
    root = tmp_path_factory.mktemp("parity")
    jobs = {
        name: (nproc, [*args, "--out", str(root / name), *(str(tiny_models[m]) for m in _models(name))])
        for name, (nproc, args) in LAYOUTS.items()
    }
    return grouped_launches("tests.distributed.parity_worker", root, jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_parity_with_transformers(layout, parity_run):
    nproc = LAYOUTS[layout][0]
    results = read_json_results(parity_run(layout))
    models = _models(layout)
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
    if layout == "pp2_first3":  # stage 0 holds layers 0-2 (an even split: 0-1)
        stages = sorted((r["rank"], r["moe_layers_on_rank"]) for r in results if r["model"] == "deepseek_v3")
        assert [layers for _, layers in stages] == [[1, 2], [3]]
    # every MoE layer was checked on some rank (pipeline stages split them)
    for model in {r["model"] for r in results}:
        layers = set().union(*(r["moe_layers_on_rank"] for r in results if r["model"] == model))
        leading_dense = "glm4" in model or "deepseek" in model
        expected = {0, 2, 3} if "qwen3" in model else {1, 2, 3} if leading_dense else {0, 1, 2, 3}
        assert layers == expected, model
