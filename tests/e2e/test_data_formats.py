"""A verl-schema parquet, written with pyarrow as verl's preprocessing scripts write it, trains through
launch/train_moe.py with no format setting (issue 79): detected and printed, rendered with the chat template, the
answer from reward_model.ground_truth, and two validation sets read from a list."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ONE_ENGINE, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]


def _verl_parquet(path: Path, count: int, start: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"What is {i} + {i}? Answer with the number."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(start, start + count)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_verl_parquet_trains_as_it_is(tmp_path):
    train = _verl_parquet(tmp_path / "train.parquet", 32, 0)
    vals = [_verl_parquet(tmp_path / "small.parquet", 3, 100), _verl_parquet(tmp_path / "other.parquet", 2, 200)]
    run_dir = tmp_path / "run"
    overrides = [
        f"hydra.run.dir={run_dir}",
        "logging.wandb.mode=disabled",
        "trainer.checkpoint_every=-1",
        "trainer.steps=2",
        "trainer.val_every=2",
        ONE_ENGINE,
        "data.task=file",
        f"data.path={train}",
        f"data.val_path=[{vals[0]},{vals[1]}]",
        "data.reward=moe_rl.data.rewards:numeric_answer_reward",
    ]
    out = run_job([*TORCHRUN, *overrides], timeout=900)
    assert f"[moe-rl] data: {train}: format verl (detected" in out, out[-4000:]
    assert "validation 'small': 3 prompts of" in out and "validation 'other': 2 prompts of" in out, out[-4000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2] and all(0.0 <= h["reward/mean"] <= 1.0 for h in steps)
    assert [h["val/prompts"] for h in history if "val/prompts" in h] == [5]
