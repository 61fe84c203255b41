"""Prompt sources and reward plugins."""

from __future__ import annotations

import json

import pytest

from moe_rl.data.prompts import PromptSource
from moe_rl.data.rewards import load_reward, numeric_answer_reward, toy_low_token_reward


def test_toy_reward_counts_target_tokens_over_a_fixed_horizon():
    assert toy_low_token_reward(["", "", ""], [None] * 3, [[0], [2, 3, 100, 63], list(range(2, 40))]) == [
        0.0,
        3 / 16,
        1.0,
    ]  # EOS never counts; capped at 1


def test_numeric_answer_reward():
    got = numeric_answer_reward(
        ["so the answer is 42.", "#### 1,234", "no number", "7 then 8"], ["42", "1234", "3", "7"], [[]] * 4
    )
    assert got == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs an answer"):
        numeric_answer_reward(["1"], [None], [[]])


def test_reward_plugins_load_by_name():
    assert load_reward("moe_rl.data.rewards:numeric_answer_reward") is numeric_answer_reward
    with pytest.raises(ValueError, match="module:function"):
        load_reward("numeric_answer_reward")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_reward("moe_rl.data.rewards:nope")


def test_file_prompts_are_sharded_over_data_parallel_ranks(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "answer": str(i)}) for i in range(10)))
    a = PromptSource("file", str(path), "question", "answer", seed=0, dp_rank=0, dp_size=2)
    b = PromptSource("file", str(path), "question", "answer", seed=0, dp_rank=1, dp_size=2)
    sa, sb = {p.text for p in a.next(5)}, {p.text for p in b.next(5)}
    assert not sa & sb and len(sa | sb) == 10
    assert a.position == 5
    with pytest.raises(ValueError, match="data.prompt_key='prompt' is not a column"):
        PromptSource("file", str(path), "prompt", "answer")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptSource("file", str(tmp_path / "missing.jsonl"))
