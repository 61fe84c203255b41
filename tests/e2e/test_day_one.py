"""A user's first real run: chat rows rendered with the chat template, validation every 2 steps,
a KL to the reference model, the response metrics, and validation that changes no training sample."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from tests.conftest import ONE_ENGINE, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]
WORDS = "count the numbers one two three quick brown fox experts route tokens".split()


def _chat_rows(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    rows = [
        {
            "messages": [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))},
            ],
            "answer": "",
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _train(run_dir: Path, overrides: list[str]) -> tuple[list[dict], str]:
    common = [
        "logging.wandb.mode=disabled",
        "trainer.checkpoint_every=0",
        "data.reward=moe_rl.data.rewards:toy_low_token_reward",
        ONE_ENGINE,
    ]
    out = run_job([*TORCHRUN, f"hydra.run.dir={run_dir}", *common, *overrides], timeout=900)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], out


def test_chat_data_validation_and_reference_kl(tmp_path):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    _chat_rows(train, 32, seed=1)
    _chat_rows(val, 6, seed=2)
    data = ["data.task=file", f"data.path={train}", "data.apply_chat_template=true", "algorithm.kl_coef=0.01"]
    with_val = [f"data.val_path={val}", "trainer.val_every=2", "trainer.val_before_train=true"]
    history, out = _train(tmp_path / "run", ["trainer.steps=4", *data, *with_val])

    val_steps = [h["step"] for h in history if "val/reward_mean" in h]
    assert val_steps == [0, 2, 4], val_steps
    assert "validation at step 2: reward" in out and "validation: 6 prompts of" in out
    for h in history:
        if "val/reward_mean" in h:
            assert h["val/prompts"] == 6 and 0.0 <= h["val/pass@k"] <= 1.0 and 0.0 <= h["val/reward_mean"] <= 1.0
    steps = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2, 3, 4]
    assert steps[0]["actor/first_minibatch_kl_ref"] == 0.0  # pi_theta = pi_ref before the first update
    assert steps[3]["actor/kl_ref"] > steps[0]["actor/kl_ref"] > 0.0, [h["actor/kl_ref"] for h in steps]
    for h in steps:
        assert h["response/length_mean"] <= h["response/length_max"] <= 24  # sampling.max_tokens
        assert 0.0 <= h["response/clip_ratio"] <= 1.0
        assert h["time/ref_logprobs"] > 0.0

    # The same run without validation samples exactly the same responses (step 3 follows a validation).
    plain, _ = _train(tmp_path / "plain", ["trainer.steps=3", *data])
    for a, b in zip(steps[:3], plain, strict=True):
        assert "val/reward_mean" not in b
        for key in ("reward/mean", "response/length_mean", "response/length_max", "actor/kl_ref"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
