"""Packing (actor.packing) changes no result: the packed update equals the padded one, fp32.

Runs the grad-invariance worker's update (Actor.old_logprobs + Actor.train: 2 mini-batches, global
counts, R3 replay of random routes, gradient sync, clipping, Adam in its linear regime) padded
(micro-batches of 2) and packed (bins of 24 tokens: 1 to 3 samples each, so bins hold different
samples than the padded micro-batches), at world size 1 and with EP=2 on 2 ranks (expert tokens
exchanged between ranks that pack different samples). GSPO + IcePop (the default objective) and
PPO (token-level weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import torchrun
from tests.distributed.test_grad_invariance import WORKER, max_rel_error

pytestmark = pytest.mark.distributed

METRIC_TOL = 1e-5  # relative; acceptance of the packing issue
PARAM_TOL = 1e-6  # relative, worst HF tensor
GRAD_TOL = 1e-4  # as the fused-step test: summed QK-norm gradients after one step reach ~1e-5
LOSSES = ("gspo-icepop", "ppo")
RUNS = {"w1": "w1_dp_mbs2", "ep2": "w2_ep_mbs2"}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("packed_step")
    common = [str(tiny_models["qwen3_moe"]), "--out", str(out), "--micro-batch-sizes", "2", "--losses", *LOSSES]
    torchrun(WORKER, 1, [*common, "--packing", "off", "on"])
    torchrun(WORKER, 2, [*common, "--layouts", "ep", "--packing", "off", "on"])
    return {p.stem: torch.load(p) for p in sorted(out.glob("*.pt"))}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("run", list(RUNS))
def test_packed_step_equals_padded(runs, run, loss):
    packed, padded = runs[f"{RUNS[run]}_{loss}_packed"], runs[f"{RUNS[run]}_{loss}"]
    where = f"{run}/{loss}"
    for k, ref in padded["old"].items():
        scale = max(1.0, ref.abs().max().item())
        assert (packed["old"][k] - ref).abs().max().item() <= METRIC_TOL * scale, f"{where}: old pass {k}"
    assert packed["metrics"].keys() == padded["metrics"].keys()
    logp_scale = padded["old"]["logprobs"].abs().max().item()
    m, ref_m = packed["metrics"], padded["metrics"]
    assert m["perf/padding_fraction"] < ref_m["perf/padding_fraction"], where  # what packing is for
    for k, ref in ref_m.items():
        if k.startswith("perf/"):  # how the update was cut, not what it computed
            continue
        got = m[k]
        scale = max(abs(ref), logp_scale) if "ppo_kl" in k else abs(ref)
        assert abs(got - ref) <= METRIC_TOL * scale + 1e-9, f"{where}: {k} packed {got} vs padded {ref}"
    for step, (g, r) in enumerate(zip(packed["grads"], padded["grads"], strict=True)):
        err, name = max_rel_error(g, r)
        assert err <= GRAD_TOL, f"{where}: gradient of step {step + 1} off by {err:.2e} in {name}"
    err, name = max_rel_error(packed["params"], padded["params"])
    assert err <= PARAM_TOL, f"{where}: updated parameters off by {err:.2e} in {name}"
