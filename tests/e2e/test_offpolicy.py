"""Off-policy rollouts (trainer.max_staleness=1, rollout.placement=separate) through `torchrun
launch/train_moe.py`: the engine samples one batch ahead on cores of its own, every step trains samples
at most one version old, and the loop still learns the toy task; under tensor parallelism it samples what
one rank samples. A resume samples the batch that was in flight again from the same prompts (the data
position counts trained steps), with the resumed weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe_rl.common.batch import PaddedBatch
from moe_rl.rollout import dump
from tests.conftest import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
COMMON = ["logging.wandb.mode=disabled", "trainer.max_staleness=1"]


def _train(run_dir: Path, overrides: list[str], nproc: int = 1) -> list[dict]:
    """One rank: the engine on a core of its own (rollout.placement=separate); more: colocated (one core each)."""
    placement = "separate" if nproc == 1 else "colocated"
    cmd = [*TORCHRUN, f"--nproc-per-node={nproc}", "launch/train_moe.py", f"rollout.placement={placement}"]
    out = run_job([*cmd, f"hydra.run.dir={run_dir}", *COMMON, *overrides], timeout=900)
    (run_dir / "console.log").write_text(out)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_one_step_off_policy_learns_with_staleness_at_most_one(tmp_path):
    history = _train(tmp_path, ["trainer.steps=30", "trainer.checkpoint_every=0"])
    assert [h["step"] for h in history] == list(range(1, 31))
    stale = [h["staleness/max"] for h in history]
    assert all(h["staleness/mean"] <= h["staleness/max"] <= 1 for h in history), stale
    assert sum(s == 1 for s in stale) >= 15 and stale[0] == 0  # the first step samples with the weights it trains
    # pi_theta has moved one optimizer step by the last mini-batch: its ratio to pi_prox is no longer 1
    moved = sum(abs(h["actor/last_minibatch_ppo_kl"]) > 10 * abs(h["actor/first_minibatch_ppo_kl"]) for h in history)
    assert moved >= 25, [(h["actor/first_minibatch_ppo_kl"], h["actor/last_minibatch_ppo_kl"]) for h in history]
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nmax_staleness=1: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    steady = history[2:]  # generation hides behind training: the trainer hardly waits for samples
    assert sum(h["time/trainer_idle"] for h in steady) < 0.5 * sum(h["time/update"] for h in steady)


def test_loglinear_proximal_policy_learns_without_the_old_logprob_pass(tmp_path):
    """algorithm.prox_logp=loglinear (A-3PO): pi_prox interpolated from mu and pi_theta by versions, no
    recompute pass; the step still reports the correction and the mismatch (from the update's forward)."""
    history = _train(tmp_path, ["trainer.steps=20", "trainer.checkpoint_every=0", "algorithm.prox_logp=loglinear"])
    assert all("time/old_logprobs" not in h for h in history)
    # pi_prox is interpolated, not recomputed: the first mini-batch's ratio is not 1, and that is no warning
    assert "pi_theta != pi_old" not in (tmp_path / "console.log").read_text()
    assert all(0 < h["icepop/weight_mean"] <= 5 and h["mismatch/ess"] > 0 and h["actor/entropy"] > 0 for h in history)
    assert sum(h["staleness/max"] == 1 for h in history) >= 10
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nprox_logp=loglinear: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[dict]]:
    """4 off-policy steps with a dump and a checkpoint after every step (all kept)."""
    run = tmp_path_factory.mktemp("straight")
    every = ["trainer.dump_every=1", "trainer.checkpoint_every=1", "trainer.checkpoint_keep=0"]
    return run, _train(run, ["trainer.steps=4", *every])


def test_resume_samples_the_in_flight_prompts_again(tmp_path, straight):
    """4 steps straight vs 2 steps, then a resume to 4: step 3 has the same prompts (nothing lost or
    skipped), sampled with the resumed weights (staleness 0 right after the resume)."""
    run, history = straight
    _train(tmp_path / "split", ["trainer.steps=2", "trainer.dump_every=1"])
    resumed = _train(tmp_path / "split", ["trainer.steps=4", "trainer.dump_every=1"])
    assert [h["step"] for h in resumed][-2:] == [3, 4]
    assert [h["staleness/max"] for h in history] == [0, 1, 1, 1]
    assert [h["staleness/max"] for h in resumed][-2:] == [0, 1]
    for step in (3, 4):
        a = _prompts(run / "dumps", step)
        b = _prompts(tmp_path / "split" / "dumps", step)
        assert a == b, f"step {step}: the resumed run trained other prompts"
    assert _prompts(run / "dumps", 3) != _prompts(run / "dumps", 2)


def test_an_engine_serving_a_tensor_parallel_group_samples_ahead_as_one_rank(tmp_path, straight):
    """parallel.tp=2 on 2 ranks: one engine serves both ranks, and every step its leader sends the peer its samples
    from the rollout thread while the trainer's collectives run on the main thread (the exchange has a gloo group
    of its own). Each step equals one rank's: the same samples (seeds depend on the data-parallel rank only), the
    update and the mismatch within fp32 noise (one rank runs its engine on a core of its own here, which moves mu by
    about 1e-6; in fp32 `mismatch/kl` and `k3_kl` are themselves that noise, ~1e-7, so they get an absolute floor of
    1e-6: a real mismatch, a bf16 engine's or a stale version's, is 1e-3 and more)."""
    _, one = straight
    history = _train(tmp_path, ["trainer.steps=3", "trainer.checkpoint_every=0", "parallel.tp=2"], nproc=2)
    assert [h["staleness/max"] for h in history] == [0, 1, 1]
    for got, ref in zip(history, one[:3], strict=True):
        for k in ("reward/mean", "response/length_mean"):
            assert got[k] == ref[k], (got["step"], k, got[k], ref[k])
        for k in ("actor/grad_norm", "actor/entropy", "actor/clipfrac", "mismatch/kl", "mismatch/k3_kl"):
            floor = 1e-6 if k.startswith("mismatch/") else 1e-7
            assert abs(got[k] - ref[k]) <= 1e-4 * abs(ref[k]) + floor, (got["step"], k, got[k], ref[k])


def test_mu_routes_and_version_of_every_sample_come_from_one_engine_version(straight, world1):
    """Each dumped sample's version v names the weights that sampled it: the actor loaded at v (the initial
    model or checkpoint v), replaying the sample's routes, reproduces its mu to fp32 noise, and the actor's
    own routing at v picks the recorded experts; the neighbouring versions' log-probs are far off. (Generations never
    span a weight update: the sync waits for the sampling ahead to finish, so there are no partial rollouts.)"""
    from moe_rl.actor.actor import Actor
    from moe_rl.config import TrainConfig
    from moe_rl.routing.compare import route_sets_differ, routed_positions
    from moe_rl.trainer import checkpoint

    run, _ = straight
    actors = {}
    for v in range(4):  # the weights after v updates
        cfg = TrainConfig()
        actors[v] = Actor(cfg.actor, cfg.model, cfg.parallel, str(run / "tiny_model"), record_routes=True)
        if v:
            checkpoint.load(run / "checkpoints" / f"step_{v:06d}", actors[v].chunks, actors[v].optimizer)
    for step in range(1, 5):
        t, _ = dump.read(dump.rank_file(run / "dumps", step - 1, 0))
        versions = t["policy_version"].unique().tolist()
        assert versions == [max(step - 2, 0)], (step, versions)  # one batch ahead: sampled one version back
        mask, valid = t["loss_mask"].bool(), routed_positions(t["attention_mask"])
        gaps, agreement = {}, {}
        for w in {versions[0] - 1, versions[0], versions[0] + 1} & actors.keys():
            a = actors[w]
            padded = PaddedBatch(t["input_ids"], t["attention_mask"], t["loss_mask"], t["rollout_logprobs"], None)
            replayed = a._logprobs(a.chunks, a.replay, padded, with_entropy=False, routes=t["routes"])["logprobs"]
            live = a._logprobs(a.chunks, a.replay, padded, with_entropy=False, record=True)["routes"]
            gaps[w] = float((replayed - t["rollout_logprobs"])[mask].abs().max())
            differ, _ = route_sets_differ(live[valid], t["routes"][valid])
            agreement[w] = float((~differ).float().mean())
        v = versions[0]
        assert gaps[v] < 1e-4 and agreement[v] > 0.99, (step, gaps, agreement)  # measured: 2e-5, 1.0
        assert all(gaps[w] > 100 * gaps[v] for w in gaps if w != v), (step, gaps)


def _prompts(root: Path, step: int) -> list[tuple[int, ...]]:
    tensors, _ = dump.read(dump.rank_file(root, step - 1, 0))  # folders count from 0
    ids, prompt = tensors["input_ids"], (tensors["attention_mask"] > 0) & (tensors["loss_mask"] == 0)
    return sorted({tuple(row[m].tolist()) for row, m in zip(ids, prompt, strict=True)})
