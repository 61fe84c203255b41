"""End-to-end RL runs of `torchrun launch/train_moe.py` on CPU (tiny MoE, toy task)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ONE_ENGINE, REPO, preempt, run_job, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

KEYS = [
    "reward/mean",
    "reward/zero_variance_groups",
    "actor/skipped_steps",
    "response/length_mean",
    "actor/entropy",
    "actor/clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/first_minibatch_ppo_kl",
    "icepop/masked_fraction",
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/chi2_token",
    "mismatch/log_ppl_abs_diff",
    "mismatch/exact_fraction",
    "mismatch/logprob_abs_diff_max",
    "time/rollout",
    "time/old_logprobs",
    "time/update",
    "time/weight_sync",
    "memory/peak_rss_gib",
    "router/agreement",
]


TRAIN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]


def _train(run_dir: Path, overrides: list[str], timeout: int = 900) -> list[dict]:
    out = run_job([*TRAIN, f"hydra.run.dir={run_dir}", *overrides], timeout=timeout)
    print("\n".join(line for line in out.splitlines() if line.startswith("step")))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The default job (30 steps), shared: the learning test reads all of it, the SIGTERM test compares
    its resumed steps with the first four (`trainer.steps` changes no step's metrics)."""
    run_dir = tmp_path_factory.mktemp("default")
    return run_dir, _train(run_dir, [])


def test_default_run_learns_the_toy_task(default_run):
    tmp_path, history = default_run
    assert len(history) == 30
    for key in KEYS:
        assert key in history[0], key
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nmean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    # pi_theta == pi_old on the first mini-batch of every step (R3, fp32): ratio 1
    assert max(abs(h["actor/first_minibatch_ppo_kl"]) for h in history) < 1e-4
    assert list(tmp_path.glob("wandb/offline-run-*")), "wandb offline files missing"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_000030"
    assert (tmp_path / "checkpoints" / "step_000030" / "optimizer" / "metadata.json").is_file()
    # each engine's KV cache holds its 32 samples of 2,048 tokens (+ a block each) in float32, 0.14 GiB, not 1 GiB
    sized = re.findall(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", (tmp_path / "train_moe.log").read_text())
    assert sized == ["0.14", "0.14"], sized
    # fp32 actor and engine route identically on almost every token-layer
    agreement = [h["router/agreement"] for h in history if "router/agreement" in h]
    assert len(agreement) == 3 and min(agreement) > 0.99  # steps 1, 11, 21 (logging.router_agreement_every=10)
    # ... whose two passes also give the mismatch with and without replay: under R3 the replayed one is the step's
    for h in (h for h in history if "router/agreement" in h):
        assert h["router/k3_kl_engine_routes"] == pytest.approx(h["mismatch/k3_kl"], rel=1e-4, abs=1e-12)
        assert math.isfinite(h["router/k3_kl_own_routing"])  # fp32 on both sides: ~1e-7, float32 rounding's sign
    # no step-1 gradient-norm spike (the tiny model has no all-zero embedding row), nothing skipped
    norms = [h["actor/grad_norm"] for h in history]
    assert norms[0] <= 10 * max(norms[1], norms[2]), norms[:3]
    assert all(h["actor/skipped_steps"] == 0 for h in history)
    assert all(0.0 <= h["reward/zero_variance_groups"] <= 1.0 for h in history)
    # every step syncs the engine: the whole model (the tiny model's fp32 HF tensors) in bounded buckets
    model_bytes = sum(f.stat().st_size for f in (tmp_path / "tiny_model").glob("*.safetensors"))
    for h in history:
        assert 0.9 * model_bytes <= h["weight_sync/bytes"] <= model_bytes, (h["weight_sync/bytes"], model_bytes)
        assert h["weight_sync/seconds"] > 0 and h["weight_sync/buckets"] >= 1
        assert h["weight_sync/gb_per_s"] == pytest.approx(h["weight_sync/bytes"] / h["weight_sync/seconds"] / 1e9)


def test_overrides_r2_ep2_tis(tmp_path):
    """EP=2 chains a dense and an expert megatron optimizer: stop after 2 steps, resume the third.
    A checkpoint without its optimizer state is then refused, never resumed with a fresh optimizer."""
    overrides = [
        "parallel.ep=2",
        "actor.router_replay=r2",
        "algorithm/correction=tis",
        "logging.wandb.mode=disabled",
        ONE_ENGINE,
    ]
    _train(tmp_path, ["trainer.steps=2", *overrides])
    history = _train(tmp_path, ["trainer.steps=3", *overrides])
    assert [h["step"] for h in history] == [1, 2, 3]
    assert max(abs(h["actor/first_minibatch_ppo_kl"]) for h in history) < 1e-4
    assert "tis/capped_fraction" in history[0]
    assert 0.99 < history[0]["router/agreement"] <= 1.0
    # R2 trains on the actor's own routing: that pass is pi_old, the engine's routes the other one
    assert history[0]["router/k3_kl_own_routing"] == pytest.approx(history[0]["mismatch/k3_kl"], rel=1e-4, abs=1e-12)

    # The same checkpoint on one rank: model and optimizer reshard; the per-rank RNG states stay behind, and each
    # rank's data position (12 prompts on each of 2 data-parallel ranks) becomes the global count on the one rank.
    one = tmp_path / "one_rank"
    w1 = [a.replace("--nproc-per-node=2", "--nproc-per-node=1") for a in TRAIN]
    out = run_job([*w1, f"hydra.run.dir={one}", f"trainer.resume={tmp_path}/checkpoints/step_000003", "trainer.steps=4",
                   *overrides[1:]], timeout=600)  # fmt: skip
    assert "written by 2 ranks, this run has 1: each rank's RNG state is not restored" in out, out[-3000:]
    assert "a step now trains 4 prompts (was 8" in out
    saved = json.loads((one / "checkpoints" / "step_000004" / "trainer.json").read_text())
    assert (saved["step"], saved["data_position"], saved["world_size"], saved["data_parallel_size"]) == (4, 28, 1, 1)
    assert abs(json.loads((one / "metrics.jsonl").read_text())["actor/first_minibatch_ppo_kl"]) < 1e-4
    # Launched again (a requeued job that had finished): it says so and trains nothing, before it starts an engine
    engine_starts = (one / "train_moe.log").read_text().count("Initializing a V1 LLM engine")
    again = run_job([*w1, f"hydra.run.dir={one}", "trainer.steps=4", *overrides[1:]], timeout=600)
    assert "nothing to train: the checkpoint is at step 4 and trainer.steps=4" in again, again[-3000:]
    assert len((one / "metrics.jsonl").read_text().splitlines()) == 1
    assert (one / "train_moe.log").read_text().count("Initializing a V1 LLM engine") == engine_starts >= 1

    import shutil

    shutil.rmtree(tmp_path / "checkpoints" / "step_000003" / "optimizer")
    cmd = [*TRAIN, f"hydra.run.dir={tmp_path}", "trainer.steps=4", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "step_000003 cannot be resumed" in out and "/optimizer/" in out and "is missing" in out, out[-3000:]


def test_sigterm_checkpoint_then_resume_matches_uninterrupted_run(tmp_path, default_run):
    """SIGTERM to torchrun (Slurm preemption) during step 2: the trainer checkpoints at a step
    boundary and exits; `trainer.resume=auto` continues with the same metrics as a run that
    was never stopped (the default run's first steps), in the same wandb run. The preempted run starts from the
    real command line (a fresh `python -m torch.distributed.run`), so its steps also check that the suite's
    forked launches (tests/warm_torchrun.py) train exactly what a real launch trains."""
    steps = ["trainer.steps=4", "trainer.checkpoint_every=0"]  # a step takes about 1 s: the signal lands before 4
    reference = default_run[1][:4]

    run_dir = tmp_path / "preempted"
    # to torchrun alone: it forwards SIGTERM to the workers' process groups
    cmd = [*TRAIN, f"hydra.run.dir={run_dir}", *steps]
    text, stopped_at = preempt(cmd, run_dir, tmp_path / "preempted.log", to_group=False)
    assert 1 <= stopped_at < 4
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == stopped_at

    history = _train(run_dir, steps)  # trainer.resume=auto is the default
    assert [h["step"] for h in history] == list(range(1, 5))
    # every step, the ones before the signal too: those ran from the real command line, the reference and the
    # resumed steps from tests/warm_torchrun.py's forked launches, which must train the same
    # a signal that lands during the weight sync stops the engines with it: that step logs no weight_sync/* (its
    # sync was cut short; the checkpoint does not need the engine), and the run says so
    cut = f"step {stopped_at} warning: engine stopped by the signal" in text
    for step in history:
        expected = untimed(reference[step["step"] - 1])
        got = untimed(step)
        if cut and step["step"] == stopped_at:
            expected = {k: v for k, v in expected.items() if not k.startswith("weight_sync/")}
        assert got.keys() == expected.keys()
        for k in expected:
            assert got[k] == pytest.approx(expected[k], rel=1e-6, abs=1e-9), (step["step"], k)
    run_ids = {p.name.rsplit("-", 1)[1] for p in run_dir.glob("wandb/offline-run-*")}
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2 and len(run_ids) == 1, run_ids


def test_warmup_then_cosine_lr_is_the_closed_form_and_a_run_resumed_mid_warmup_continues_it(tmp_path):
    """actor.lr_warmup_steps=3, cosine decay to actor.min_lr at trainer.steps: actor/lr (the rate the optimizer's
    parameter groups trained at) is the closed form at every step; a run resumed from the step-2 checkpoint (in the
    warmup) trains steps 3-6 at the same rates with the uninterrupted run's metrics."""
    lr, min_lr, warmup, steps = 3e-3, 3e-4, 3, 6
    schedule = [f"actor.lr={lr}", f"actor.min_lr={min_lr}", f"actor.lr_warmup_steps={warmup}", "actor.lr_decay=cosine"]
    common = ["logging.wandb.mode=disabled", "trainer.checkpoint_every=2", *schedule]
    whole = _train(tmp_path / "whole", [f"trainer.steps={steps}", *common])

    def closed_form(s: int) -> float:
        if s <= warmup:
            return lr * s / warmup
        return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))) / 2

    assert [h["step"] for h in whole] == list(range(1, steps + 1))
    for h in whole:
        assert h["actor/lr"] == pytest.approx(closed_form(h["step"]), rel=1e-12, abs=0), h["step"]
    assert whole[-1]["actor/lr"] == pytest.approx(min_lr, rel=1e-12)
    state = json.loads((tmp_path / "whole/checkpoints/step_000006/trainer.json").read_text())
    assert state["lr_schedules"]["actor/lr"]["num_steps"] == steps

    checkpoint = tmp_path / "whole/checkpoints/step_000002"
    resumed = _train(tmp_path / "resumed", [f"trainer.steps={steps}", f"trainer.resume={checkpoint}", *common])
    assert [h["step"] for h in resumed] == list(range(3, steps + 1))
    for got, want in zip(resumed, whole[2:], strict=True):
        got, want = untimed(got), untimed(want)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), (got["step"], k)


def _metrics_from_dumps(folder: Path) -> dict[str, float]:
    """reward/* and token-level mismatch metrics of one step from all ranks' dumps (published
    formulas: k = pi_old / mu per response token; ESS = (mean k)^2 / mean k^2)."""
    from moe_rl.rollout import dump

    rewards, sums = [], {"n": 0.0, "kl": 0.0, "k3": 0.0, "k": 0.0, "k2": 0.0}
    for f in sorted(folder.glob("rank_*.safetensors")):
        t, _ = dump.read(f)
        m = t["loss_mask"].double()
        old, mu = t["logprobs_replay"].double(), t["rollout_logprobs"].double()  # R3: pi_old is the replayed pass
        k = (old - mu).exp()
        sums["n"] += float(m.sum())
        sums["kl"] += float(((mu - old) * m).sum())
        sums["k3"] += float(((k - (old - mu) - 1) * m).sum())
        sums["k"] += float((k * m).sum())
        sums["k2"] += float((k * k * m).sum())
        rewards.append(t["rewards"].double())
    r, n = torch.cat(rewards), sums["n"]
    return {
        "reward/max": float(r.max()),
        "reward/mean": float(r.mean()),
        "mismatch/kl": sums["kl"] / n,
        "mismatch/k3_kl": sums["k3"] / n,
        "mismatch/chi2_token": sums["k2"] / n - 1,
        "mismatch/ess": (sums["k"] / n) ** 2 / (sums["k2"] / n),
    }


def test_dumps_then_train_from_dump(tmp_path):
    """dump_every=1 writes one file per rank and step; trainer.mode=from_dump trains on them
    without an engine, and its first mini-batch still has pi_theta == pi_old."""
    base = ["logging.wandb.mode=disabled", "logging.router_agreement_every=0"]
    logged = _train(tmp_path / "rollouts", ["trainer.steps=2", "trainer.dump_every=1", ONE_ENGINE, *base])
    from moe_rl.rollout import dump

    # Metrics are over the global batch: recomputed here from every rank's dump of the step.
    for step, metrics in enumerate(logged):
        for key, value in _metrics_from_dumps(tmp_path / "rollouts" / "dumps" / f"step_{step:06d}").items():
            # within 1e-5; kl is a sum of exact float32 differences, so it is held to 1e-10
            tol = 1e-10 if key == "mismatch/kl" else 1e-5
            assert value == pytest.approx(metrics[key], rel=1e-5, abs=tol), (step, key, value, metrics[key])

    files = sorted((tmp_path / "rollouts" / "dumps").glob("step_*/rank_*.safetensors"))
    assert [f.relative_to(tmp_path / "rollouts" / "dumps").as_posix() for f in files] == [
        "step_000000/rank_00000.safetensors",
        "step_000000/rank_00001.safetensors",
        "step_000001/rank_00000.safetensors",
        "step_000001/rank_00001.safetensors",
    ]
    tensors, meta = dump.read(files[0])
    assert meta["router_replay"] == "r3" and meta["world_size"] == 2
    assert tensors["routes"].shape[2] == len(meta["model"]["moe_layers"])
    # R3: the replayed pass equals pi_old used for training; fp32 live routing agrees closely.
    assert (tensors["logprobs_replay"] - tensors["logprobs_live"]).abs().max() < 1e-3

    # The diagnostic CLI reads the trainer's dumps: the replayed pass dispatched exactly the engine's routes.
    from moe_rl.diagnostics.cli import main as diagnose

    diagnose(["offline", "--dump", str(tmp_path / "rollouts" / "dumps"), "--out", str(tmp_path / "diag"), "--no-plots"])
    report = json.loads((tmp_path / "diag" / "report.json").read_text())
    assert report["router"]["with_replay_disagreement"] == 0.0 and report["source"]["steps"] == [0, 1]

    history = _train(
        tmp_path / "from_dump",
        ["trainer.mode=from_dump", f"trainer.dump_dir={tmp_path / 'rollouts' / 'dumps'}", "trainer.steps=2", *base],
    )
    assert len(history) == 2 and "time/rollout" not in history[0] and "time/weight_sync" not in history[0]
    rewards = [float(dump.read(f)[0]["rewards"].mean()) for f in files]
    assert history[0]["reward/mean"] == pytest.approx((rewards[0] + rewards[1]) / 2)
    assert max(abs(h["actor/first_minibatch_ppo_kl"]) for h in history) < 1e-4
