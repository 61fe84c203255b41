"""In-flight weight updates (rollout.inflight=true) through `torchrun launch/train_moe.py`: the engine keeps
1 + trainer.max_staleness steps of prompt groups in flight across weight syncs, a step trains the first groups to
finish. With actor.lr=0 (the weights never change) every trained sample is, token for token with its mu and its
routes, the synchronous run's sample of the same prompt, and every token's version lag is within the bound
(tests/engine/test_inflight.py re-derives mu and routes of tokens that span updates under changed weights, across a
pause-resume and an abort-continue). Partial rollouts (rollout.partial=true) on two data-parallel ranks served by
one engine, learning on: each step trains each rank's share of whole groups, every prompt once, every token
within the bound.
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


def _train(run_dir: Path, overrides: list[str], nproc: int = 1) -> list[dict]:
    torchrun = [*TORCHRUN[:-1], f"--nproc-per-node={nproc}"]
    out = run_job([*torchrun, "launch/train_moe.py", f"hydra.run.dir={run_dir}", *COMMON, *overrides], timeout=900)
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


def test_partial_rollouts_on_two_ranks_train_every_prompt_once_within_the_bound(tmp_path):
    run = tmp_path / "partial"
    partial = ["rollout.inflight=true", "rollout.partial=true", "trainer.max_staleness=1", "rollout.engines=1"]
    history = _train(run, [*partial, "rollout.placement=colocated", "sampling.max_tokens=48"], nproc=2)
    groups: dict[tuple, int] = {}  # prompt tokens -> samples trained
    spanning = 0  # samples whose tokens two versions sampled (aborted at a sync, continued after it)
    for step in range(4):
        for rank in range(2):
            t, _ = dump.read(dump.rank_file(run / "dumps", step, rank))
            assert t["input_ids"].shape[0] == 4 * 8, (step, rank)  # data.prompts_per_step groups of sampling.n
            for i in range(t["input_ids"].shape[0]):
                versions = t["versions"][i][t["attention_mask"][i] > 0]
                prompt = tuple(t["input_ids"][i][(t["attention_mask"][i] > 0) & (t["versions"][i] < 0)].tolist())
                groups[prompt] = groups.get(prompt, 0) + 1
                sampled = versions[versions >= 0]
                assert step - 1 <= int(sampled.min()) and int(sampled.max()) <= step, (step, rank, i)
                spanning += len(set(sampled.tolist())) > 1
    assert len(groups) == 4 * 2 * 4 and set(groups.values()) == {8}  # every group whole, none trained twice
    print(f"\n{spanning} of {4 * 2 * 32} samples span a sync")
    assert all(h["rollout/version_lag_max"] <= 1 and h["rollout/dropped_fraction"] == 0 for h in history)
