"""moe-rl-diagnose on constructed dumps: every number exact, bad inputs, plots, --help."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_rl.diagnostics.cli import main
from moe_rl.objectives.metrics import MISMATCH_KEYS
from moe_rl.rollout import dump

FINGERPRINT = {
    "model_type": "qwen3_moe",
    "vocab_size": 64,
    "num_layers": 2,
    "moe_layers": [0, 1],
    "num_experts": 4,
    "topk": 2,
}
LOG_K = {(0, 3): math.log(3.0), (0, 4): math.log(0.25), (1, 2): math.log(1.5), (1, 3): 0.0}


def _synthetic(root, fingerprint=FINGERPRINT, rank=0, replay_check=(20, 0)):
    """Two samples (lengths 5 and 4), response tokens at LOG_K's positions, routes differing at
    known token-layers: s0 pos1 layer0 ({0,1} vs {1,2}), s0 pos2 layer1 ({0,1} vs {2,3}); s1 pos0
    layer1 holds the same set in another order (agreement); s0 pos4 differs but is never routed."""
    b, t = 2, 5
    ids = torch.arange(b * t).reshape(b, t) % 60 + 2
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    loss = torch.zeros(b, t, dtype=torch.long)
    mu = torch.zeros(b, t)
    live = torch.zeros(b, t)
    for (i, j), lk in LOG_K.items():
        loss[i, j] = 1
        mu[i, j] = -1.0 - 0.1 * j
        live[i, j] = mu[i, j] + lk
    routes = torch.tensor([0, 1], dtype=torch.uint8).expand(b, t, 2, 2).clone()
    routes_live = routes.clone()
    routes_live[0, 1, 0] = torch.tensor([1, 2])
    routes_live[0, 2, 1] = torch.tensor([2, 3])
    routes[1, 0, 1] = torch.tensor([3, 2])
    routes_live[1, 0, 1] = torch.tensor([2, 3])
    routes_live[0, 4, 0] = torch.tensor([2, 3])  # the last position: not routed by the engine
    tensors = {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "rollout_logprobs": mu,
        "logprobs_replay": mu.clone(),
        "logprobs_live": live,
        "routes": routes,
        "routes_live": routes_live,
    }
    meta = {
        "step": 0,
        "rank": rank,
        "world_size": 1,
        "model_path": "",
        "model": fingerprint,
        "rollout_dtype": "bfloat16",
        "actor_dtype": "bfloat16",
        "replay_check": {"token_layers": replay_check[0], "mismatched": replay_check[1]},
    }
    dump.write(dump.rank_file(root, 0, rank), tensors, meta)
    return tensors


def test_offline_report_numbers_are_exact(tmp_path, capsys):
    _synthetic(tmp_path / "dumps")
    main(["offline", "--dump", str(tmp_path / "dumps"), "--out", str(tmp_path / "out"), "--worst", "3"])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    r = report["router"]
    # 7 routed tokens (4 + 3) x 2 MoE layers
    assert report["source"]["routed_token_layers"] == 14 and report["source"]["response_tokens"] == 4
    assert r["disagreement_per_layer"] == {"0": 1 / 7, "1": 1 / 7}
    assert r["set_difference_mean_per_layer"] == {"0": 1 / 7, "1": 2 / 7}
    assert r["disagreement"] == 2 / 14
    assert r["token_any_disagreement"] == 2 / 7
    assert r["with_replay_disagreement"] == 0.0 and r["with_replay_checked_token_layers"] == 20

    ks = [math.exp(v) for v in LOG_K.values()]
    lks = list(LOG_K.values())
    without = report["mismatch"]["without_replay"]
    assert set(MISMATCH_KEYS) <= set(without)
    assert without["kl"] == pytest.approx(-sum(lks) / 4, abs=1e-6)
    assert without["k3_kl"] == pytest.approx(sum(k - lk - 1 for k, lk in zip(ks, lks, strict=True)) / 4, abs=1e-6)
    assert without["chi2_token"] == pytest.approx(sum(k * k for k in ks) / 4 - 1, abs=1e-6)
    assert without["ess"] == pytest.approx((sum(ks) / 4) ** 2 / (sum(k * k for k in ks) / 4), abs=1e-6)
    assert without["k_outside_0.5_2_fraction"] == 0.5  # 3 and 0.25
    assert without["k_outside_icepop_fraction"] == 0.25  # 0.25 only: 3 lies inside [0.5, 5]
    assert without["k_above_tis_cap_fraction"] == 0.25  # 3 > 2
    with_replay = report["mismatch"]["with_replay"]
    assert with_replay["kl"] == 0.0 and with_replay["chi2_token"] == 0.0 and with_replay["ess"] == 1.0
    assert with_replay["k_outside_0.5_2_fraction"] == 0.0

    # s0's tokens 3 and 4 have positions the routers disagreed on (1 and 2) in their context, s1's none (its one
    # difference is an order); with replay every k3 is 0, so no share
    k3 = {pos: math.exp(lk) - 1 - lk for pos, lk in LOG_K.items()}
    split = report["mismatch_by_routing"]
    differently, alike = split["routed_differently"], split["routed_alike"]
    assert (differently["tokens"], alike["tokens"]) == (2, 2)
    assert differently["k3_kl_without_replay"] == pytest.approx((k3[0, 3] + k3[0, 4]) / 2, abs=1e-6)
    assert alike["k3_kl_without_replay"] == pytest.approx((k3[1, 2] + k3[1, 3]) / 2, abs=1e-6)
    share = (k3[0, 3] + k3[0, 4]) / sum(k3.values())
    assert differently["k3_share_without_replay"] == pytest.approx(share, abs=1e-6)
    assert differently["k3_share_without_replay"] + alike["k3_share_without_replay"] == pytest.approx(1.0)
    assert differently["k3_kl_with_replay"] == 0.0 and differently["k3_share_with_replay"] is None

    worst = report["worst_tokens"]
    assert [(w["sample"], w["position"]) for w in worst] == [(0, 4), (0, 3), (1, 2)]
    assert worst[1]["layers_differing"] == [1]  # position 2's layer-1 routes score token 3
    assert worst[0]["layers_differing"] == [] and worst[2]["layers_differing"] == []
    assert worst[0]["log_k_live"] == pytest.approx(math.log(0.25))

    import matplotlib.image as mpimg

    for name in ("disagreement_per_layer.png", "logprob_scatter.png", "log_ratio_hist.png"):
        img = mpimg.imread(tmp_path / "out" / name)
        assert img.shape[0] > 200 and img.shape[1] > 200, name
        assert img[..., :3].std() > 0.05, f"{name} is blank"
    out = capsys.readouterr().out
    assert "router: engine vs actor" in out and "worst tokens" in out and "routed differently" in out


def test_replay_dispatch_mismatches_are_reported_not_hidden(tmp_path):
    _synthetic(tmp_path / "dumps", replay_check=(40, 4))
    main(["offline", "--dump", str(tmp_path / "dumps"), "--out", str(tmp_path / "out"), "--no-plots"])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["router"]["with_replay_disagreement"] == 0.1


def test_compare_reports_side_by_side(tmp_path, capsys):
    _synthetic(tmp_path / "a")
    _synthetic(tmp_path / "b", replay_check=(40, 4))
    for name in ("a", "b"):
        main(["offline", "--dump", str(tmp_path / name), "--out", str(tmp_path / f"out_{name}"), "--no-plots"])
    capsys.readouterr()
    main(
        [
            "compare",
            str(tmp_path / "out_a" / "report.json"),
            str(tmp_path / "out_b" / "report.json"),
            "--out",
            str(tmp_path / "cmp.json"),
        ]
    )
    rows = json.loads((tmp_path / "cmp.json").read_text())["metrics"]
    assert rows["router.with_replay_disagreement"] == {"a": 0.0, "b": 0.1, "delta": 0.1}
    assert rows["mismatch.without_replay.kl"]["delta"] == 0.0
    assert rows["mismatch_by_routing.routed_differently.tokens"] == {"a": 2.0, "b": 2.0, "delta": 0.0}
    assert "router.with_replay_disagreement" in capsys.readouterr().out


def _error(argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    return str(e.value)


def test_bad_inputs_give_clear_errors(tmp_path):
    assert "does not exist" in _error(["offline", "--dump", str(tmp_path / "missing")])
    # Two ranks of one step from different models.
    _synthetic(tmp_path / "mixed", rank=0)
    _synthetic(tmp_path / "mixed", fingerprint={**FINGERPRINT, "num_experts": 8}, rank=1)
    assert "from another model" in _error(["offline", "--dump", str(tmp_path / "mixed")])
    # Mismatched shapes.
    t = _synthetic(tmp_path / "shapes")
    t["logprobs_live"] = t["logprobs_live"][:, :3]
    _, meta = dump.read(dump.rank_file(tmp_path / "shapes", 0, 0))
    dump.write(dump.rank_file(tmp_path / "shapes", 0, 0), t, meta)
    msg = _error(["offline", "--dump", str(tmp_path / "shapes")])
    assert "logprobs_live has shape (2, 3)" in msg and "rank_00000" in msg
    t = _synthetic(tmp_path / "routes")
    t["routes"] = t["routes"][:, :, :1]
    dump.write(dump.rank_file(tmp_path / "routes", 0, 0), t, meta)
    assert "routes has shape (2, 5, 1, 2)" in _error(["offline", "--dump", str(tmp_path / "routes")])
    # Not a dump at all.
    (tmp_path / "junk" / "step_000000").mkdir(parents=True)
    (tmp_path / "junk" / "step_000000" / "rank_00000.safetensors").write_text("not safetensors")
    assert "not a readable safetensors" in _error(["offline", "--dump", str(tmp_path / "junk")])
    # An HF folder without MoE layers, and a missing prompts file (before any engine starts).
    from transformers import Qwen3Config

    Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(
        tmp_path / "dense"
    )
    assert "has no MoE layers" in _error(
        ["live", "--model", str(tmp_path / "dense"), "--prompts", str(tmp_path / "p.txt")]
    )
    assert "no config.json" in _error(["live", "--model", str(tmp_path / "nowhere"), "--prompts", "x"])
    # The CPU engine's KV cache takes fractions of a GiB, not nothing: argparse refuses 0 before an engine starts
    assert _error(["live", "--model", "m", "--prompts", "p", "--kv-cache-gib", "0"]) == "2"
    # Reports that are not reports.
    (tmp_path / "r.json").write_text('{"hello": 1}')
    assert "not a moe-rl-diagnose report" in _error(["compare", str(tmp_path / "r.json"), str(tmp_path / "r.json")])
    assert "does not exist" in _error(["compare", str(tmp_path / "no.json"), str(tmp_path / "r.json")])


def test_offline_refuses_a_dump_from_another_model(tmp_path, tiny_models):
    _synthetic(tmp_path / "dumps")
    msg = _error(["offline", "--dump", str(tmp_path / "dumps"), "--model", str(tiny_models["mixtral"])])
    assert "from another model" in msg


def test_prompts_file_formats(tmp_path):
    from moe_rl.diagnostics.live import read_prompts

    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a b"}\nplain line\n\n{"prompt": 3}\n')
    assert read_prompts(str(p), 10) == ["a b", "plain line", "3"]
    assert read_prompts(str(p), 2) == ["a b", "plain line"]
    p.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="line 1: no `prompt` field"):
        read_prompts(str(p), 10)


@pytest.mark.parametrize("sub", [[], ["live"], ["offline"], ["compare"]])
def test_help_shows_examples(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main([*sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "Example" in out and "moe-rl-diagnose" in out
