"""A new user's first runs: a jsonl data file with the numeric-answer reward trains, a NaN reward
stops the run naming the sample (nothing is saved)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from tests.conftest import launch

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
    return launch([*TRAIN1, f"hydra.run.dir={run_dir}", *SMALL, *overrides], timeout=600)


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
    # the sample, its row and the start of its prompt
    assert "step 1: reward function nan_reward returned nan for sample 0 (toy:" in out, out[-5000:]
    assert "data_source 'toy', prompt '" in out, out[-5000:]
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_prompt_filling_the_context_trains_and_one_token_more_is_refused_before_any_engine(tmp_path, tiny_models):
    """rollout.max_model_len=128, sampling.max_tokens=8: 120-token prompts train (sequences fill the context
    exactly); a 121-token row is refused by name before the actor or an engine is built."""
    from transformers import AutoTokenizer

    model = tiny_models["qwen3_moe"]
    tokenizer = AutoTokenizer.from_pretrained(model)

    def prompt(tokens: int) -> str:
        text = " ".join(["the"] * (tokens - 1))  # this tokenizer: 2 tokens for the first word, 1 for each next one
        assert len(tokenizer(text)["input_ids"]) == tokens
        return text

    def data(name: str, lengths: list[int]):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": prompt(n)}) + "\n" for n in lengths))
        return path

    common = [f"model.path={model}", "rollout.max_model_len=128", "data.task=file", "trainer.checkpoint_every=0"]
    common.append("data.reward=moe_rl.data.rewards:toy_low_token_reward")
    exact = data("exact", [120] * 4)
    code, out = _run(tmp_path / "exact_run", [*common, f"data.path={exact}"])
    assert code == 0, out[-5000:]
    history = [json.loads(line) for line in (tmp_path / "exact_run" / "metrics.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["actor/skipped_steps"] == 0.0

    over = data("over", [120, 120, 121, 120])
    code, out = _run(tmp_path / "over_run", [*common, f"data.path={over}"])
    assert code != 0
    assert f"{over}:3: the prompt has 121 tokens, more than the 120 allowed" in out, out[-5000:]
    assert "EngineCore" not in out and "step 1" not in out, out[-5000:]


def test_multi_turn_math_on_data_without_answers_is_refused_before_any_engine(tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"what is {a} + 1?"}) + "\n" for a in range(4)))
    start = time.monotonic()
    code, out = _run(tmp_path / "run", ["rollout.multi_turn.env=math_retry", "data.task=file", f"data.path={data}"])
    assert code != 0
    assert f"{data}:1: the prompt has no answer (data.answer_key='answer')" in out, out[-5000:]
    assert "EngineCore" not in out and not (tmp_path / "run" / "metrics.jsonl").exists()
    print(f"\nrefused in {time.monotonic() - start:.1f} s")
