"""Checkpoint faults end to end: a truncated model file is named at resume with the older
checkpoint to use; SIGTERM twice during a save never leaves a checkpoint that resume would trust; a full disk during
a save stops the run naming the space, or (trainer.on_save_failure=retry) trains on until a save succeeds."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import pytest

from moe_rl.trainer import checkpoint
from tests.faults.harness import Run

pytestmark = [pytest.mark.faults, pytest.mark.e2e, pytest.mark.slow, pytest.mark.isolated]


def _finish(r: Run, timeout: float = 600) -> int:
    try:
        return r.proc.wait(timeout=timeout)
    finally:
        r.wait_gone(timeout=60)
        r.kill_all()


def _engine_starts(run_dir) -> int:
    """vLLM's record of each engine's start in the run's train_moe.log (each launch in the folder appends to it)."""
    return (run_dir / "train_moe.log").read_text().count("Initializing a V1 LLM engine")


def test_truncated_checkpoint_is_named_then_the_older_one_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = Run(run_dir, 2, ["trainer.steps=2", "trainer.checkpoint_every=1"])
    assert _finish(first) == 0, first.output()[-4000:]
    assert first.new_leftovers(within=5) == set()  # a clean run leaves no socket file or segment
    older, newer = run_dir / "checkpoints" / "step_000001", run_dir / "checkpoints" / "step_000002"
    victim = max((f for f in (newer / "model").iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)

    engine_starts = _engine_starts(run_dir)
    assert engine_starts > 0  # the first run's engines, in the run's log
    t0 = time.time()
    resumed = Run(run_dir, 2, ["trainer.steps=3"])  # trainer.resume=auto
    # It ends by itself, before any model is built (no hang): 62 s was seen beside CI's lanes, so no tighter bound
    code = _finish(resumed, timeout=120)
    out = resumed.output()
    print(f"\ndamaged checkpoint refused in {time.time() - t0:.1f} s")
    assert code != 0
    assert str(victim) in out and "truncated" in out and f"trainer.resume={older}" in out, out[-4000:]
    assert _engine_starts(run_dir) == engine_starts  # failed before any engine was started

    again = Run(run_dir, 2, ["trainer.steps=3", f"trainer.resume={older}"])
    assert _finish(again) == 0, again.output()[-4000:]
    assert f"resumed from {older} at step 1" in again.output()
    steps = [m["step"] for m in again.metrics()]
    assert steps[-2:] == [2, 3]  # steps 2 and 3 trained again from step 1's checkpoint
    assert checkpoint.problems(run_dir / "checkpoints" / "step_000003") == []


def test_sigterm_twice_during_a_save_never_leaves_a_trusted_partial_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    r = Run(run_dir, 2, ["trainer.steps=8", "trainer.checkpoint_every=0"])
    try:
        r.wait_for_steps(1)
        ranks = r.ranks()
        for p in ranks:
            p.send_signal(signal.SIGTERM)  # as Slurm's scancel --signal=TERM does
        deadline = time.time() + 120
        while time.time() < deadline and not list((run_dir / "checkpoints").glob("step_*")):
            time.sleep(0.02)
        for p in ranks:  # the second signal, while the checkpoint is being written
            try:
                os.kill(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        r.proc.wait(timeout=120)
        r.wait_gone(timeout=60)
        assert r.new_leftovers(within=10) == set()
    finally:
        r.kill_all()
    assert "second SIGTERM: exiting now" in r.output() or "stopped by a signal after saving" in r.output()
    root = run_dir / "checkpoints"
    trusted, _ = checkpoint.resolve_resume(root, "auto")  # never raises: latest names a verified checkpoint
    for folder in root.glob("step_*"):
        if folder != trusted:
            assert checkpoint.problems(folder), f"{folder} is complete but latest does not name it"
    again = Run(run_dir, 2, ["trainer.steps=3"])
    assert _finish(again) == 0, again.output()[-4000:]
    assert [m["step"] for m in again.metrics()][-1] == 3


@contextlib.contextmanager
def _small_disk(path, mib: int):
    """A tmpfs of `mib` MiB at `path` (mounting needs root, as CI has: skipped elsewhere)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small file system here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_during_a_save_stops_cleanly_and_the_previous_checkpoint_resumes_or_retries(tmp_path):
    """20 MiB hold one checkpoint of the tiny model (13.6 MiB), not two: step 2's save fails. The run ends within 60 s
    naming the folder and the free space, leaves no partial save and nothing else behind, and step 1's checkpoint
    resumes. With trainer.on_save_failure=retry the resumed run warns, trains on, and saves once there is room."""
    run_dir = tmp_path / "run"
    with _small_disk(tmp_path / "disk", 20) as disk:
        first = Run(run_dir, 2, ["trainer.steps=4", "trainer.checkpoint_every=1", f"trainer.checkpoint_dir={disk}"])
        try:
            first.wait_for_steps(2)  # step 2's save starts now
            t0 = time.time()
            code = first.proc.wait(timeout=60)
            first.wait_gone(timeout=60 - (time.time() - t0))
            assert first.new_leftovers(within=60 - (time.time() - t0)) == set()
        finally:
            first.kill_all()
        print(f"\nfull disk: the run ended {time.time() - t0:.1f} s after step 2's save began")
        out = first.output()
        assert code != 0
        assert f"CheckpointSaveError: checkpoint step 2: saving to {disk} failed (rank " in out, out[-4000:]
        assert "MiB free of 20.0 MiB (a full disk?); the partial save was removed; step_000001, 13" in out
        assert sorted(os.listdir(disk)) == ["latest", "step_000001"]  # no partial save stays
        assert checkpoint.resolve_resume(disk, "auto") == (disk / "step_000001", [])

        retry = ["trainer.on_save_failure=retry", "trainer.checkpoint_every=2", f"trainer.checkpoint_dir={disk}"]
        again = Run(run_dir, 2, ["trainer.steps=8", *retry])
        try:
            deadline = time.time() + 300
            while "Training goes on (trainer.on_save_failure=retry)" not in again.output():
                assert time.time() < deadline and again.proc.poll() is None, again.output()[-4000:]
                time.sleep(0.05)
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)  # the user makes room
            assert _finish(again) == 0, again.output()[-4000:]
        finally:
            again.kill_all()
        out = again.output()
        assert f"resumed from {disk / 'step_000001'} at step 1" in out
        assert "step 2 warning: checkpoint step 2: saving to" in out, out[-4000:]
        assert [m["step"] for m in again.metrics()][-7:] == [2, 3, 4, 5, 6, 7, 8]
        assert checkpoint.latest(disk) == disk / "step_000008" and checkpoint.problems(disk / "step_000008") == []
        assert not [p for p in os.listdir(disk) if p.startswith(".")]
