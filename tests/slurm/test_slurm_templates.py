"""The single-node sbatch template under a real Slurm on localhost: a time-limit style stop
signal must checkpoint, requeue the job and resume it to completion."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.slurm.local_cluster import LocalSlurm, SlurmUnavailable

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow, pytest.mark.isolated]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        pytest.skip(f"Slurm cannot start here: {e}")
    yield cluster
    cluster.stop()


def _submit(slurm, monkeypatch, tmp_path: Path, run_dir: Path, overrides: list[str]) -> int:
    """The job gets the environment sbatch runs with (slurm.env): set there for this test only,
    so neither os.environ nor the module's cluster keeps it."""
    job_env = dict(NPROC="2", RUN_DIR=str(run_dir), OMP_NUM_THREADS="1", VLLM_CONFIGURE_LOGGING="0")
    if "PYTHONWARNINGS" not in slurm.env:
        job_env["PYTHONWARNINGS"] = "ignore"
    for key, value in job_env.items():
        monkeypatch.setitem(slurm.env, key, value)
    log = tmp_path / "job-%j.out"
    return slurm.sbatch([f"--output={log}", "launch/slurm/single_node.sbatch", *overrides], cwd=REPO)


def _job_log(tmp_path: Path, job: int) -> str:
    path = tmp_path / f"job-{job}.out"
    return path.read_text() if path.is_file() else "(no job log)"


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_stop_signal_checkpoints_requeues_and_resumes(slurm, monkeypatch, tmp_path):
    """`scancel --batch --signal=TERM` is what `--signal=B:TERM@120` delivers before a time
    limit: the batch shell forwards it, the trainer checkpoints, the job requeues itself and
    the second start resumes from the checkpoint to the last step."""
    run_dir = tmp_path / "run"
    job = _submit(
        slurm,
        monkeypatch,
        tmp_path,
        run_dir,
        ["trainer.steps=5", "trainer.checkpoint_every=0", "logging.wandb.mode=disabled"],
    )
    deadline = time.time() + 600
    while not _metrics(run_dir) and time.time() < deadline:
        time.sleep(1)
    assert _metrics(run_dir), _job_log(tmp_path, job)
    subprocess.run(["scancel", "--batch", "--signal=TERM", str(job)], env=slurm.env, check=True)
    # Requeued: pending again, then running with a restart count, then complete.
    state, hurried = "RUNNING", False
    while time.time() < deadline:
        state = slurm.job_state(job)
        restarts = subprocess.run(
            ["scontrol", "show", "job", str(job)], env=slurm.env, capture_output=True, text=True
        ).stdout
        # Hurry only once the node has finished cleaning up the first attempt, and start a few seconds
        # later: slurmd revokes the first attempt's credential at the requeue, with one-second
        # resolution, and refuses a new one issued in that same second ("Job credential revoked":
        # the job then fails before its script starts).
        if state == "PENDING" and "Restarts=1" in restarts and not hurried and slurm.node_state() == "idle":
            # Slurm holds a requeued job for ~2 minutes (BeginTime); the test need not wait.
            cmd = ["scontrol", "update", f"JobId={job}", "StartTime=now+5"]
            hurried = subprocess.run(cmd, env=slurm.env, capture_output=True).returncode == 0
        if state == "COMPLETED" and "Restarts=1" in restarts:
            break
        if state in ("FAILED", "CANCELLED", "TIMEOUT") or (state == "COMPLETED" and "Restarts=0" in restarts):
            break
        time.sleep(2)
    text = _job_log(tmp_path, job)
    assert state == "COMPLETED", f"{state}\n{restarts}\n{text[-6000:]}\n{slurm.log_tails()}"
    assert "Restarts=1" in restarts, f"job was not requeued:\n{text[-6000:]}"
    assert "resumed from" in text and "(restart 1)" in text, text[-6000:]
    assert f"[moe-rl] job {job} on" in text
    steps = [m["step"] for m in _metrics(run_dir)]
    assert steps[-1] == 5 and sorted(set(steps)) == [1, 2, 3, 4, 5], steps
