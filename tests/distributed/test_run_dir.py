"""Every rank of a torchrun job runs in one directory: Hydra resolves `hydra.run.dir` in each process, and the
default's time stamp used to differ between ranks that started on either side of a second."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_job

pytestmark = pytest.mark.distributed

TORCHRUN2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


def test_ranks_that_start_seconds_apart_get_the_default_run_directory_alike_and_keep_it_after_a_restart():
    """Rank 1 starts 1.5 s after rank 0 and fails on the first attempt; torchrun restarts both. All four resolve the
    same directory: a restarted attempt finds the first one's checkpoints (trainer.resume=auto)."""
    cmd = [*TORCHRUN2, "--max-restarts=1", "-m", "tests.distributed.late_rank", "launch/train_moe.py"]
    out = run_job([*cmd, "--cfg", "hydra", "--resolve"], env={"MOE_RL_TEST_FAIL_FIRST_ATTEMPT": "1"})
    run_dirs = re.findall(r"^\s+dir: (runs/\S+)$", out, re.M)  # hydra.run.dir as each rank resolved it
    assert len(run_dirs) == 4, out  # 2 ranks x 2 attempts
    assert len(set(run_dirs)) == 1, out


def test_ranks_given_different_run_directories_stop_before_writing_anything(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            *TORCHRUN2,
            "launch/train_moe.py",
            f"hydra.run.dir={tmp_path}/rank_${{oc.env:RANK}}",
            "logging.wandb.mode=disabled",
        ],
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-5000:]
    assert f"rank 0: {tmp_path}/rank_0, rank 1: {tmp_path}/rank_1" in out, out[-5000:]
    hydras_own = {".hydra", "train_moe.log"}
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if not hydras_own & set(p.parts))
    assert written == ["rank_0", "rank_1"], written  # no tiny model, no metrics
