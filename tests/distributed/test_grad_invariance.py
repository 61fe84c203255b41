"""Gradient invariance of one actor update (fp32, tiny Qwen3-MoE with a dense layer).

The same global batch of 8 sequences, updated once by `Actor.train` (the trainer's update: 2
mini-batches, global token/sequence counts, gradient sync, clipping, Adam), gives the same
gradients and updated parameters whether each mini-batch of 4 is split into 1, 2 or 4
micro-batches, over DP=1 or DP=2, with EP=2, with TP=2 + sequence parallel and with CP=2 (see
grad_invariance_worker.py).

Adam's first steps normalise each element by its own magnitude (~lr * sign(g)), which would
hide a wrongly scaled gradient and turn fp32 noise in near-zero elements into full-size
updates. The worker therefore clips the gradient norm far below Adam's eps (grad_clip=1e-6,
eps=1e-8): Adam runs in its linear regime (update ~ lr * g / eps), so the parameters reflect the
gradient values. Clipping still undoes an error that scales the whole gradient (e.g. a count
off by the same factor on every rank), so the synced gradients before each optimizer step and
the grad norm are compared as well.

With local instead of global token/sequence counts (checked by hand in the worker) every DP=2
and EP=2 variant fails: gradients off by 1.7-2.1x their scale, parameters by ~2e-3.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import torchrun

pytestmark = pytest.mark.distributed

# Relative error of a tensor: max|a - b| / max|b| (b the reference; the absolute error where b
# is all zeros), the worst HF tensor reported.
PARAM_TOL = 1e-6  # measured ~1e-7: one fp32 ulp of the largest weights
# Gradients differ by fp32 rounding: a micro-batch of other size runs its GEMMs (the experts'
# above all) in other shapes; measured <= 1.1e-5, largest on the routers. (DP=2 with one
# micro-batch of 2 rows per rank is bitwise equal to DP=1 with two micro-batches of 2 rows.)
# A count or normalisation error moves them by O(1).
GRAD_TOL = 1e-4

LOSSES = ("gspo", "ppo")  # GSPO (seq-mean-token-mean) + seq-mask; PPO (token-mean) + IcePop
REFERENCE = "w1_dp_mbs4"  # DP=1, one micro-batch per mini-batch
# test id -> saved run "w<world>_<layout>_mbs<micro-batch size per rank>"; a mini-batch is 4 rows
# over the DP ranks (EP=2 on 2 ranks is DP=2 for the dense parameters)
VARIANTS = {
    "dp1_2mb": "w1_dp_mbs2",
    "dp1_4mb": "w1_dp_mbs1",
    "dp2_1mb": "w2_dp_mbs2",
    "dp2_2mb": "w2_dp_mbs1",
    "ep2_1mb": "w2_ep_mbs2",
    "ep2_2mb": "w2_ep_mbs1",
    "tp2_2mb": "w2_tp_mbs2",  # TP=2 + SP: one data-parallel rank, the whole mini-batch on each rank
    "tp2_4mb": "w2_tp_mbs1",
    "cp2_2mb": "w2_cp_mbs2",  # context parallel: each rank runs half of every sequence's positions
}
WORKER = "tests.distributed.grad_invariance_worker"


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, dict]:
    """Every variant's saved update (two torchrun launches: world 1, then world 2 for DP, EP and TP)."""
    out = tmp_path_factory.mktemp("grad_invariance")
    model = str(tiny_models["qwen3_moe"])
    torchrun(WORKER, 1, [model, "--out", str(out), "--micro-batch-sizes", "4", "2", "1"])
    torchrun(
        WORKER, 2, [model, "--out", str(out), "--layouts", "dp", "ep", "tp", "cp", "--micro-batch-sizes", "2", "1"]
    )
    return {p.stem: torch.load(p) for p in sorted(out.glob("*.pt"))}


def max_rel_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """(worst relative error over the tensors, its name); the tensor names must match."""
    assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
    worst = (0.0, "")
    for name, b in ref.items():
        err = (got[name] - b).abs().max().item()
        scale = b.abs().max().item()
        worst = max(worst, (err / scale if scale > 0 else err, name))
    return worst


def assert_same_update(
    got: dict, ref: dict, where: str, old_tol: float, metric_tol: float, grad_tol: float, param_tol: float
):
    """Two saved worker updates (old-pass log-probs, update metrics, per-step gradients, parameters) agree;
    `perf/*` metrics (how the update was cut, not what it computed) are not compared."""
    for k, r in ref["old"].items():
        scale = max(1.0, r.abs().max().item())
        assert (got["old"][k] - r).abs().max().item() <= old_tol * scale, f"{where}: old pass {k}"
    assert got["metrics"].keys() == ref["metrics"].keys(), f"{where}: {got['metrics'].keys() ^ ref['metrics'].keys()}"
    # ppo_kl = mean(old - logp) is a difference of log-probs of magnitude ~5: its error is relative
    # to theirs (the first mini-batch's is fp32 noise around 0)
    logp_scale = ref["old"]["logprobs"].abs().max().item()
    for k, r in ref["metrics"].items():
        if k.startswith("perf/"):
            continue
        scale = max(abs(r), logp_scale) if "ppo_kl" in k else abs(r)
        assert abs(got["metrics"][k] - r) <= metric_tol * scale + 1e-9, f"{where}: {k} {got['metrics'][k]} vs {r}"
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        err, name = max_rel_error(g, r)
        assert err <= grad_tol, f"{where}: gradient of step {step + 1} off by {err:.2e} in {name}"
    err, name = max_rel_error(got["params"], ref["params"])
    assert err <= param_tol, f"{where}: updated parameters off by {err:.2e} in {name}"


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_update_matches_single_micro_batch_reference(runs, variant, loss):
    ref, got = runs[f"{REFERENCE}_{loss}"], runs[f"{VARIANTS[variant]}_{loss}"]
    assert len(got["grads"]) == len(ref["grads"]) == 2  # one per mini-batch (optimizer step)
    for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
        err, name = max_rel_error(g, r)
        assert err <= GRAD_TOL, f"{variant}/{loss}: gradient of step {step + 1} off by {err:.2e} in {name}"
    norm_err = abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
    assert norm_err <= GRAD_TOL, f"{variant}/{loss}: grad norm {got['grad_norm']} vs {ref['grad_norm']}"
    err, name = max_rel_error(got["params"], ref["params"])
    assert err <= PARAM_TOL, f"{variant}/{loss}: updated parameters off by {err:.2e} in {name}"
    tokens = got["metrics"]["perf/tokens"], ref["metrics"]["perf/tokens"]  # the same batch counted once, any layout
    assert tokens[0] == tokens[1], f"{variant}/{loss}: perf/tokens {tokens}"


@pytest.mark.parametrize("loss", LOSSES)
def test_update_is_far_above_tolerance(runs, loss):
    """The update moves the weights by much more than PARAM_TOL, so the comparison above can
    fail: every dense tensor, and all but a few experts (the routes of this small batch send an
    expert few tokens, or only tokens of dropped sequences)."""
    initial, ref = runs["initial"], runs[f"{REFERENCE}_{loss}"]
    assert initial.keys() == ref["params"].keys()
    change = {k: ((ref["params"][k] - w).abs().max() / w.abs().max()).item() for k, w in initial.items()}
    dense = {k: c for k, c in change.items() if ".mlp.experts." not in k}
    experts = {k: c for k, c in change.items() if ".mlp.experts." in k}
    assert min(dense.values()) > 50 * PARAM_TOL, f"{loss}: {min(dense, key=dense.get)} barely moved"
    assert sum(c > 50 * PARAM_TOL for c in experts.values()) >= 0.9 * len(experts), (
        f"{loss}: {sorted(experts.items(), key=lambda kv: kv[1])[:5]}"
    )


def test_deepseek_v3_update_is_the_same_under_tp_sp_and_ep(tiny_models, tmp_path):
    """Multi-latent attention under TP=2 + SP: the q/kv down-projections are split over TP and gathered,
    their latent norms see sequence slices (gradients summed over TP), and the sigmoid router with shared
    experts under EP=2: one update (GSPO, R3 routes) equals the world-1 one."""
    model = str(tiny_models["deepseek_v3"])
    torchrun(WORKER, 1, [model, "--out", str(tmp_path), "--micro-batch-sizes", "4", "--losses", "gspo"])
    args = [model, "--out", str(tmp_path), "--layouts", "tp", "ep", "--micro-batch-sizes", "2", "--losses", "gspo"]
    torchrun(WORKER, 2, args)
    runs = {p.stem: torch.load(p) for p in sorted(tmp_path.glob("*.pt"))}
    ref = runs["w1_dp_mbs4_gspo"]
    for variant in ("w2_tp_mbs2_gspo", "w2_ep_mbs2_gspo"):
        got = runs[variant]
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            err, name = max_rel_error(g, r)
            assert err <= GRAD_TOL, f"{variant}: gradient of step {step + 1} off by {err:.2e} in {name}"
        err, name = max_rel_error(got["params"], ref["params"])
        assert err <= PARAM_TOL, f"{variant}: updated parameters off by {err:.2e} in {name}"
    moved = [k for k, w in runs["initial"].items() if not torch.equal(ref["params"][k], w)]
    assert any("kv_a_layernorm" in k for k in moved) and any("q_a_proj" in k for k in moved)


def test_flat_gradient_all_reduce_equals_one_all_reduce_per_tensor(tmp_path):
    """The gradient sync sums flat buckets per dtype (one gloo all-reduce each, 4-8x faster than one per tensor on
    the default model): on 2 ranks, with buckets that split the tensors, every tensor ends bitwise as a per-tensor
    all-reduce leaves it (also for TP's mean), in its own dtype."""
    from tests.conftest import read_json_results

    torchrun("tests.distributed.flat_allreduce_worker", 2, [str(tmp_path)])
    results = read_json_results(tmp_path)
    assert sorted(r["rank"] for r in results) == [0, 1]
    for r in results:
        for divide in (1, 2):
            assert r[f"bitwise_equal_divide_{divide}"] and r[f"changed_divide_{divide}"], r
            assert all(r[f"dtypes_kept_divide_{divide}"]), r


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_lora_update_is_the_same_in_every_layout(arch, tiny_models, tmp_path):
    """actor.lora (every target, fresh adapters with B != 0): one update's adapter gradients, updated adapters and
    merged weights under DP=2, EP=2, TP=2 + SP, CP=2, PP=2 and ETP=2 equal the world-1 update's (the adapters' TP/SP
    collectives, the gradient reductions of the factors a rank holds whole, the expert-parallel and expert-tensor-
    parallel splits). Targets: all and the router. DeepSeek-V3: multi-latent attention's up-projections and shared
    experts."""
    model = str(tiny_models[arch])
    common = ["--out", str(tmp_path), "--losses", "gspo", "--lora", "4"]
    torchrun(WORKER, 1, [model, *common, "--micro-batch-sizes", "4"])
    layouts = ["dp", "ep", "tp", "cp", "pp", "etp"] if arch == "qwen3_moe" else ["tp", "ep"]
    torchrun(WORKER, 2, [model, *common, "--layouts", *layouts, "--micro-batch-sizes", "2"])
    runs = {p.stem: torch.load(p) for p in sorted(tmp_path.glob("*.pt"))}
    ref = runs["w1_dp_mbs4_gspo_lora4"]
    assert any(".mlp.experts." in k for k in ref["grads"][0]) and any("linear_proj" in k for k in ref["grads"][0])
    moved = {k for k, w in runs["initial"].items() if not torch.equal(ref["params"][k], w)}
    assert any("self_attn" in k for k in moved) and any(".experts." in k for k in moved), "merged weights did not move"
    assert any(k.endswith("mlp.gate.weight") for k in moved), "the router's merged weight did not move"
    for lay in layouts:
        got = runs[f"w2_{lay}_mbs2_gspo_lora4"]
        for step, (g, r) in enumerate(zip(got["grads"], ref["grads"], strict=True)):
            err, name = max_rel_error(g, r)
            assert err <= GRAD_TOL, f"{lay}: adapter gradient of step {step + 1} off by {err:.2e} in {name}"
        err, name = max_rel_error(got["params"], ref["params"])
        # the factors are small (A ~ 1/sqrt(in)): their update's fp32 rounding is ~10 ulps (measured 1.3e-6)
        assert err <= 10 * PARAM_TOL, f"{lay}: updated parameters off by {err:.2e} in {name}"
