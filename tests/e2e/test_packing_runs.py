"""The RL loop packed and balanced over the data-parallel ranks (actor.packing=true and
trainer.balance_batch=true, the defaults) and padded with each rank training its own samples: the same
step 1 on 2 ranks (actor fp32, engine bf16 as in test_layouts), 128-token responses, R3 replay, and EP=2
(expert tokens exchanged between ranks that pack different samples); packing leaves almost no padding.
Parameters after the update are compared in tests/distributed/test_packed_step.py (the same update,
without the engine)."""

from __future__ import annotations

import pytest

from tests.conftest import ONE_ENGINE
from tests.e2e.test_layouts import _train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

# actor fp32, engine bf16. grad_clip far below Adam's eps keeps Adam linear (update ~ lr * g / eps), so the
# second mini-batch sees fp32 rounding of the first update, not its sign flips (as grad_invariance_worker).
STEP = ["trainer.steps=1", "sampling.max_tokens=128", "actor.router_replay=r3", "actor.grad_clip=1e-6", ONE_ENGINE]
KEYS = ("actor/grad_norm", "actor/ppo_kl", "mismatch/k3_kl", "reward/mean", "actor/clipfrac", "actor/entropy")
REL_TOL = 1e-5
# actor/ppo_kl is a mean of log pi_theta - log pi_old over tokens whose log-probs are ~1 in size: their fp32
# rounding (~1e-7 each, and the packed and padded passes sum in different orders) bounds how closely it can agree,
# whatever its own size (measured: 7.5e-8 apart at 6.7e-3 on an Intel AVX-512 machine, 1.1e-5 relative).
ABS_TOL = {"actor/ppo_kl": 1e-6}


def test_packed_step_equals_padded_step_and_ep2(tmp_path):
    padded = _train(tmp_path / "padded", 2, [*STEP, "actor.packing=false", "trainer.balance_batch=false"])[0]
    packed = _train(tmp_path / "packed", 2, STEP)[0]
    packed_ep = _train(tmp_path / "packed_ep2", 2, [*STEP, "parallel.ep=2"])[0]
    assert packed["perf/padding_fraction"] <= 0.05, packed["perf/padding_fraction"]
    assert packed["perf/padding_fraction"] < padded["perf/padding_fraction"]
    assert packed["perf/dp_groups_moved"] > 0 and "perf/dp_groups_moved" not in padded  # balancing moved samples
    for run, name in ((packed, "packed"), (packed_ep, "packed ep=2")):
        assert run["response/length_mean"] == padded["response/length_mean"]  # the same samples
        for key in KEYS:
            tol = REL_TOL * abs(padded[key]) + ABS_TOL.get(key, 0.0)
            assert abs(run[key] - padded[key]) <= tol, (name, key, run[key], padded[key])
