"""The replay buffer (buffer.enable) through `torchrun launch/train_moe.py` on 2 data-parallel ranks: each
step's groups enter the buffer, the step trains groups drawn by advantage priority, zero-variance groups
never reach the loss, and the loop still learns the toy task."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ONE_ENGINE, REPO, run_job, untimed

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_advantage_prioritized_buffer_learns_and_never_trains_zero_variance_groups(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]
    cmd += [
        f"hydra.run.dir={tmp_path}",
        "logging.wandb.mode=disabled",
        "trainer.steps=20",
        "trainer.checkpoint_every=0",
        ONE_ENGINE,
    ]
    cmd += ["buffer.enable=true", "buffer.priority=advantage", "buffer.filter_zero_variance=true"]
    run_job(cmd, timeout=1200)
    history = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, 21))
    assert all(h["buffer/zero_variance_trained"] == 0 for h in history)
    assert all(h["reward/zero_variance_groups"] == 0 for h in history)  # the trained batch's own count agrees
    replayed = [h["buffer/replay_ratio"] for h in history]
    assert replayed[0] == 0 and sum(r > 0 for r in replayed) >= 10, replayed
    assert max(h["staleness/max"] for h in history) <= 4  # buffer.max_age (default 4) bounds replayed samples
    assert all(h["buffer/size"] <= 64 for h in history)  # buffer.capacity
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nbuffer (advantage priority): mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    assert (tmp_path / "checkpoints" / "step_000020" / "buffer" / "rank_00001.safetensors").is_file()


def test_a_resumed_run_draws_and_trains_as_the_uninterrupted_one(tmp_path):
    """4 steps straight vs 2 steps and a resume to 4 (1 rank, mixed priority): the checkpoint holds the
    buffer's groups, prompt statistics and draw generator, so steps 3 and 4 train the same groups and log
    the same metrics (every key but machine timings)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "launch/train_moe.py"]
    cmd += ["logging.wandb.mode=disabled", "trainer.checkpoint_every=2", "buffer.enable=true", "buffer.priority=mixed"]

    def train(run_dir, steps):
        run_job([*cmd, f"hydra.run.dir={run_dir}", f"trainer.steps={steps}"], timeout=900)
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    straight = train(tmp_path / "straight", 4)
    train(tmp_path / "split", 2)
    resumed = train(tmp_path / "split", 4)[-2:]
    assert [h["step"] for h in resumed] == [3, 4]
    assert resumed[0]["buffer/size"] == 12  # the 8 groups of steps 1-2 restored, 4 more sampled

    def kept(h):
        return untimed(h)

    assert [kept(h) for h in resumed] == [kept(h) for h in straight[2:]]

    # The buffer is held per rank: under another layout the resume stops before anything is loaded
    two = [a.replace("--nproc-per-node=1", "--nproc-per-node=2") for a in cmd]
    run = [*two, f"hydra.run.dir={tmp_path / 'two'}", f"trainer.resume={tmp_path}/split/checkpoints/step_000004"]
    proc = subprocess.run([*run, "trainer.steps=5"], cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "its replay buffer is held per rank, written by 1 ranks" in out, out[-3000:]
    assert not (tmp_path / "two" / "metrics.jsonl").exists()
