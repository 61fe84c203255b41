"""In-flight weight updates (rollout.inflight=true) through `torchrun launch/train_moe.py`: the engine keeps
1 + trainer.max_staleness steps of prompt groups in flight across weight syncs, a step trains the first groups to
finish. With actor.lr=0 (the weights never change) every trained sample is, token for token with its mu and its
routes, the synchronous run's sample of the same prompt, and every token's version lag is within the bound
(tests/engine/test_inflight.py re-derives mu and routes of tokens that span updates under changed weights).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from moe_rl.rollout import dump
from tests.conftest import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
COMMON = ["logging.wandb.mode=disabled", "rollout.placement=separate", "trainer.dump_every=1"]
COMMON += ["trainer.checkpoint_every=0", "trainer.steps=4"]


def _train(run_dir: Path, overrides: list[str]) -> list[dict]:
    out = run_job([*TORCHRUN, "launch/train_moe.py", f"hydra.run.dir={run_dir}", *COMMON, *overrides], timeout=900)
    (run_dir / "console.log").write_text(out)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _samples(run_dir: Path) -> dict[tuple, tuple]:
    """Every dumped sample by its tokens: (mu, routes) of each."""
    out = {}
    for step in range(4):
        t, _ = dump.read(dump.rank_file(run_dir / "dumps", step, 0))
        for i in range(t["input_ids"].shape[0]):
            n = int(t["attention_mask"][i].sum())
            out[tuple(t["input_ids"][i, :n].tolist())] = (t["rollout_logprobs"][i, :n], t["routes"][i, :n])
    return out


def test_inflight_with_unchanged_weights_samples_what_the_synchronous_run_samples(tmp_path):
    frozen = ["actor.lr=0", "actor.lr_warmup_steps=0"]
    _train(tmp_path / "sync", frozen)
    sync = _samples(tmp_path / "sync")
    history = _train(tmp_path / "inflight", [*frozen, "rollout.inflight=true", "trainer.max_staleness=1"])
    inflight = _samples(tmp_path / "inflight")
    shared = inflight.keys() & sync.keys()
    assert len(shared) >= 0.75 * len(inflight), len(shared)  # the first to finish: mostly the same prompts
    for tokens in shared:
        (mu_a, routes_a), (mu_b, routes_b) = inflight[tokens], sync[tokens]
        assert torch.equal(mu_a, mu_b) and torch.equal(routes_a, routes_b)
    lags = [h["rollout/version_lag_max"] for h in history]
    assert lags[0] == 0 and max(lags) == 1 and all(h["rollout/dropped_fraction"] == 0 for h in history), lags
    assert all(h["rollout/version_lag_share_0"] + h["rollout/version_lag_share_1"] == pytest.approx(1) for h in history)
