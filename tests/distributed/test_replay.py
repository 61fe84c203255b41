"""Routing replay under real torchrun/gloo layouts (fp32, tiny Qwen3-MoE with a dense layer)."""

from __future__ import annotations

import pytest

from tests.conftest import grouped_launches, read_json_results, torchrun

pytestmark = pytest.mark.distributed

LAYOUTS = {
    "world1": (1, []),
    "ep2": (2, ["--ep", "2"]),
    "tp2_sp": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "tp2_ep2": (4, ["--tp", "2", "--ep", "2"]),
}


SIGMOID = [("glm4_moe", "world1"), ("glm4_moe", "ep2"), ("deepseek_v3", "world1")]


@pytest.fixture(scope="module")
def replay_run(tiny_models, tmp_path_factory):
    """`replay_run("arch-layout")` -> its results folder. The jobs of one world size share a torchrun launch."""
    root = tmp_path_factory.mktemp("replay")
    pairs = [("qwen3_moe", layout) for layout in LAYOUTS] + SIGMOID
    jobs = {}
    for arch, layout in pairs:
        nproc, args = LAYOUTS[layout]
        jobs[f"{arch}-{layout}"] = (nproc, [str(tiny_models[arch]), *args, "--out", str(root / f"{arch}-{layout}")])
    return grouped_launches("tests.distributed.replay_worker", root, jobs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_replay_exact_under_layout(layout, replay_run):
    nproc = LAYOUTS[layout][0]
    results = read_json_results(replay_run(f"qwen3_moe-{layout}"))
    assert len(results) == nproc
    tp = {"tp2_sp": 2, "tp2_ep2": 2}.get(layout, 1)
    # one route holder per tensor-parallel group; the others were given no routes and recorded none
    assert sum(r["holds_routes"] for r in results) == nproc // tp
    for r in results:
        where = f"{layout} rank {r['rank']}"
        assert r["record_replay_identical"], where  # (b) bit-identical to the recording forward
        if r["holds_routes"]:
            assert r["recorded_vs_hf_mismatch"] == 0 and r["recorded_width"] == 12, where
        else:
            assert r["recorded_vs_hf_mismatch"] is None and r["recorded_width"] == 0, where
        assert r["forced_vs_hf"] <= 1e-4, where  # (a) transformers with the same routes forced
        assert r["forced_vs_live"] > 1e-2, where  # replay is enforced
        assert r["router_grad_min"] is None or r["router_grad_min"] > 0, where
        assert r["recompute_grad_max_diff"] <= 1e-6 and r["grads_compared"] > 0, where
        assert r["selective_recompute_grad_max_diff"] <= 1e-6, where
        # the recompute passes really replayed (one per micro-batch and MoE layer on this rank)
        assert r["recompute_replays"] == r["selective_recompute_replays"] == 4 * len(r["layers_on_rank"]), where
        assert r["after_second_model"], where
    assert set().union(*(r["layers_on_rank"] for r in results)) == {0, 2, 3}


@pytest.mark.parametrize("arch, layout", SIGMOID)
def test_replay_exact_with_sigmoid_grouped_router(arch, layout, replay_run):
    """GLM-4.5 / DeepSeek-V3 routing (sigmoid, expert bias, 2 groups with 1 kept, gates scaled by 2.5):
    replaying random experts, which ignore the groups and the bias, still takes each gate from the live
    unbiased sigmoid score at the replayed expert, renormalised and scaled, as transformers does when forced."""
    nproc = LAYOUTS[layout][0]
    results = read_json_results(replay_run(f"{arch}-{layout}"))
    assert len(results) == nproc
    for r in results:
        where = f"{layout} rank {r['rank']}"
        assert r["holds_routes"] and r["record_replay_identical"] and r["recorded_vs_hf_mismatch"] == 0, where
        assert r["forced_vs_hf"] <= 1e-4 < 1e-2 < r["forced_vs_live"], where
        assert r["router_grad_min"] > 0, where
        assert r["recompute_grad_max_diff"] <= 1e-6 and r["selective_recompute_grad_max_diff"] <= 1e-6, where
    assert set().union(*(r["layers_on_rank"] for r in results)) == {1, 2, 3}


def test_sequence_and_context_parallel_slicing_matches_megatron(tmp_path):
    torchrun("tests.distributed.layout_worker", 2, [str(tmp_path)])
    results = read_json_results(tmp_path)
    assert len(results) == 4  # 2 ranks x {sp, cp}
    for r in results:
        assert r["equal"], r
