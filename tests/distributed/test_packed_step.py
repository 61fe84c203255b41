"""Packing (actor.packing) changes no result: the packed update equals the padded one, fp32.

Runs the grad-invariance worker's update (Actor.old_logprobs + Actor.train: 2 mini-batches, global
counts, R3 replay of random routes, gradient sync, clipping, Adam in its linear regime) padded
(micro-batches of 2) and packed (bins of 24 tokens: 1 to 3 samples each, so bins hold different
samples than the padded micro-batches), at world size 1, with EP=2 on 2 ranks (expert tokens
exchanged between ranks that pack different samples), and with PP=2 and PP=2 x VPP=2 (interleaved
schedule) on 2 ranks, where packed bins of different lengths cross the pipeline
(variable_seq_lengths), and with CP=2 (each packed row split zig-zag like one sequence, samples kept
apart by the pack's mask). GSPO + IcePop (the default objective) and PPO (token-level weights).
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import torchrun
from tests.distributed.test_grad_invariance import WORKER, assert_same_update

pytestmark = pytest.mark.distributed

METRIC_TOL = 1e-5  # relative; acceptance of the packing issue
PARAM_TOL = 1e-6  # relative, worst HF tensor
GRAD_TOL = 1e-4  # as the fused-step test: summed QK-norm gradients after one step reach ~1e-5
LOSSES = ("gspo-icepop", "ppo")
RUNS = {"w1": "w1_dp_mbs2", "ep2": "w2_ep_mbs2", "pp2": "w2_pp_mbs2", "pp2_vpp2": "w2_vpp_mbs2", "cp2": "w2_cp_mbs2"}


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("packed_step")
    common = [str(tiny_models["qwen3_moe"]), "--out", str(out), "--micro-batch-sizes", "2", "--losses", *LOSSES]
    torchrun(WORKER, 1, [*common, "--packing", "off", "on"])
    torchrun(WORKER, 2, [*common, "--layouts", "ep", "pp", "vpp", "cp", "--packing", "off", "on"])
    return {p.stem: torch.load(p) for p in sorted(out.glob("*.pt"))}


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("run", list(RUNS))
def test_packed_step_equals_padded(runs, run, loss):
    packed, padded = runs[f"{RUNS[run]}_{loss}_packed"], runs[f"{RUNS[run]}_{loss}"]
    where = f"{run}/{loss}"
    assert packed["metrics"]["perf/padding_fraction"] < padded["metrics"]["perf/padding_fraction"], where
    assert_same_update(packed, padded, where, METRIC_TOL, METRIC_TOL, GRAD_TOL, PARAM_TOL)
