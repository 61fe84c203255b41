"""Users' own datasets and reward functions run unchanged through launch/train_moe.py (issue 79): a verl-schema
parquet, written with pyarrow as verl's preprocessing scripts write it, with a reward file written for verl (its
calls get each row's data_source, ground truth and extra_info) and two validation sets read from a list; a TRL
conversational dataset with a reward function written for TRL's GRPOTrainer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ONE_ENGINE, run_job

VERL_REWARD = Path(__file__).parents[1] / "unit" / "reward_files" / "verl_reward.py"

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


def _overrides(run_dir: Path) -> list[str]:
    return [
        f"hydra.run.dir={run_dir}",
        "logging.wandb.mode=disabled",
        "trainer.checkpoint_every=-1",
        "trainer.steps=2",
        ONE_ENGINE,
        "data.task=file",
    ]


def test_a_verl_parquet_and_a_verl_reward_file_train_as_they_are(tmp_path):
    train = _verl_parquet(tmp_path / "train.parquet", 32, 0)
    vals = [_verl_parquet(tmp_path / "small.parquet", 3, 100), _verl_parquet(tmp_path / "other.parquet", 2, 200)]
    run_dir, calls = tmp_path / "run", tmp_path / "calls.jsonl"
    overrides = [
        *_overrides(run_dir),
        "trainer.val_every=2",
        f"data.path={train}",
        f"data.val_path=[{vals[0]},{vals[1]}]",
        f"data.reward={VERL_REWARD}:compute_score",
    ]
    out = run_job([*TORCHRUN, *overrides], timeout=900, env={"MOE_RL_TEST_CALLS": str(calls)})
    assert f"[moe-rl] data: {train}: format verl (detected" in out, out[-4000:]
    assert "validation 'small': 3 prompts of" in out and "validation 'other': 2 prompts of" in out, out[-4000:]
    assert "reward compute_score: " in out and "verl form" in out, out[-4000:]
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2] and all(0.0 <= h["reward/mean"] <= 1.0 for h in steps)
    # the function's dict extras and the per-data_source mean are logged
    assert all("reward/compute_score/acc" in h and "reward/openai/gsm8k/mean" in h for h in steps)
    val = next(h for h in history if "val/small/prompts" in h)
    assert (val["val/small/prompts"], val["val/other/prompts"]) == (3, 2)
    # every call got its row's data_source, ground truth and extra_info: 2 steps x 2 ranks x 4 prompts x 8 samples
    # to train, then 5 validation prompts x val.n samples
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    train_calls = [c for c in recorded if c[3]["index"] < 100]
    assert len(train_calls) == 2 * 2 * 4 * 8, len(train_calls)
    for source, _, truth, extra, _ in recorded:
        assert source == "openai/gsm8k" and truth == str(2 * extra["index"]) and extra["split"] == "train"
    assert {c[3]["index"] for c in recorded if c[3]["index"] >= 100} == {100, 101, 102, 200, 201}


def test_a_trl_conversational_dataset_and_a_trl_reward_function_train_as_they_are(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": str(i + 1)} for i in range(16)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir, calls = tmp_path / "run", tmp_path / "calls.jsonl"
    overrides = [*_overrides(run_dir), f"data.path={train}", "data.reward=tests.e2e.plugins:trl_accuracy"]
    out = run_job([*TORCHRUN, *overrides], timeout=900, env={"MOE_RL_TEST_REWARD_CALLS": str(calls)})
    assert f"[moe-rl] data: {train}: format trl (detected" in out, out[-4000:]
    recorded = [json.loads(line) for line in calls.read_text().splitlines()]
    assert len(recorded) == 2 * 2 * 4 * 8
    by_question = {r["prompt"][0]["content"]: r["solution"] for r in rows}
    for c in recorded:  # TRL's conversational shapes: the prompt's messages, the completion as one assistant message
        assert by_question[c["prompt"][0]["content"]] == c["solution"]
        assert [m["role"] for m in c["completion"]] == ["assistant"] and isinstance(c["ids"][0], int)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history if "reward/trl_accuracy/mean" in h] == [1, 2]
