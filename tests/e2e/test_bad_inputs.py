"""A new user's first runs: a jsonl data file with the numeric-answer reward trains, a NaN reward
stops the run naming the sample (nothing is saved)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRAIN1 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "launch/train_moe.py"]
SMALL = [
    "trainer.steps=1",
    "logging.wandb.mode=disabled",
    "sampling.n=2",
    "sampling.max_tokens=8",
    "actor.mini_batches=1",
]


def _run(run_dir, overrides):
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "VLLM_CONFIGURE_LOGGING": "0"}
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")},
        **env,
    }
    proc = subprocess.run(
        [*TRAIN1, f"hydra.run.dir={run_dir}", *SMALL, *overrides],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, proc.stdout + proc.stderr


def test_file_data_with_numeric_answer_reward_trains_a_step(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [
        {"prompt": f"Question: what is {a} + {b}? Answer:", "answer": str(a + b)} for a, b in [(1, 2), (12, 30), (7, 6)]
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, out = _run(
        tmp_path / "run",
        ["data.task=file", f"data.path={data}", "data.reward=moe_rl.data.rewards:numeric_answer_reward"],
    )
    assert code == 0, out[-5000:]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 1 and 0.0 <= history[0]["reward/mean"] <= 1.0
    assert history[0]["actor/skipped_steps"] == 0.0 and history[0]["actor/grad_norm"] >= 0.0
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step_000001"


def test_nan_reward_stops_the_run_naming_the_sample_and_saves_nothing(tmp_path):
    code, out = _run(tmp_path / "run", ["data.reward=tests.e2e.plugins:nan_reward"])
    assert code != 0
    assert "step 1: reward function nan_reward returned nan for sample 0 (prompt '" in out, out[-5000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
