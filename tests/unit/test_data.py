"""Prompt sources and reward plugins: good files load, every bad input is a clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moe_rl.data.prompts import DataError, PromptSource, read_prompt_file
from moe_rl.data.rewards import RewardError, load_reward, numeric_answer_reward, score, toy_low_token_reward


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
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="not a function"):
        load_reward("moe_rl.data.rewards:TOY_HORIZON")


def _plugin(values):
    return lambda responses, answers, ids: values


@pytest.mark.parametrize(
    "values,match",
    [
        ([1.0, float("nan"), 0.0], r"returned nan for sample 1 \(prompt 'prompt number 1'\)"),
        ([1.0, 0.0, float("inf")], r"returned inf for sample 2"),
        ([1.0, "1", 0.0], r"returned '1' for sample 1"),
        ([1.0, None, 0.0], r"returned None for sample 1"),
        ([1.0, 0.0], r"returned 2 rewards for 3 samples"),
        (3.0, r"returned float, not a list"),
    ],
)
def test_bad_rewards_stop_with_step_sample_prompt_and_value(values, match):
    prompts = [f"prompt number {i}" for i in range(3)]
    with pytest.raises(RewardError, match=match) as err:
        score(_plugin(values), ["a", "b", "c"], [None] * 3, [[1]] * 3, prompts, step=7, rank=1)
    assert str(err.value).startswith("step 7 (rank 1): reward function")


def test_reward_exception_keeps_the_plugins_traceback():
    def broken(responses, answers, ids):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"step 2: reward function .*broken raised KeyError") as err:
        score(broken, ["a"], [None], [[1]], ["p"], step=2)
    assert isinstance(err.value.__cause__, KeyError) and err.value.__cause__.__traceback__ is not None


def test_rewards_accept_numpy_torch_and_bool_numbers():
    values = [np.float32(0.5), torch.tensor(1.0), True, 2]
    got = score(_plugin(values), ["a"] * 4, [None] * 4, [[1]] * 4, ["p"] * 4, step=1)
    assert got == [0.5, 1.0, 1.0, 2.0] and all(isinstance(v, float) for v in got)


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_file_prompts_are_sharded_over_data_parallel_ranks(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"question": f"q{i}", "answer": i} for i in range(10)])
    a = PromptSource("file", str(path), "question", "answer", seed=0, dp_rank=0, dp_size=2)
    b = PromptSource("file", str(path), "question", "answer", seed=0, dp_rank=1, dp_size=2)
    sa, sb = {p.text for p in a.next(5)}, {p.text for p in b.next(5)}
    assert not sa & sb and len(sa | sb) == 10
    assert a.position == 5
    assert {p.answer for p in a.items} | {p.answer for p in b.items} == {str(i) for i in range(10)}
    with pytest.raises(
        DataError,
        match=r"p.jsonl:1: no key data.prompt_key='prompt' or data.messages_key='messages' "
        r"\(keys: \['answer', 'question'\]\)",
    ):
        PromptSource("file", str(path), "prompt", "answer")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        PromptSource("file", str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize(
    "content,match",
    [
        (b'{"prompt": "a"}\n{"prompt": "b"\n', r"bad.jsonl:2: malformed JSON"),
        (b'{"prompt": "a"}\n\n{"question": "b"}\n', r"bad.jsonl:3: no key data.prompt_key='prompt'"),
        (b'{"prompt": "a"}\n["b"]\n', r"bad.jsonl:2: expected a JSON object, got list"),
        (b'{"prompt": ""}\n', r"bad.jsonl:1: 'prompt' must be a non-empty string"),
        (b'{"prompt": 3}\n', r"bad.jsonl:1: 'prompt' must be a non-empty string, got 3"),
        (b"", r"bad.jsonl: holds no prompts \(empty file\)"),
        (b"\n  \n", r"bad.jsonl: holds no prompts"),
        (b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n', r"bad.jsonl:2: not UTF-8"),
    ],
)
def test_bad_jsonl_files_name_the_file_and_line(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=match):
        read_prompt_file(str(path), "prompt", "answer")


def test_parquet_prompts_and_a_damaged_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["x", "y"], "answer": ["1", None]}), tmp_path / "p.parquet")
    items = read_prompt_file(str(tmp_path / "p.parquet"), "prompt", "answer")
    assert [(p.text, p.answer) for p in items] == [("x", "1"), ("y", None)]
    assert items[1].source.endswith("p.parquet:row 2")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="bad.parquet: not a readable parquet file"):
        read_prompt_file(str(tmp_path / "bad.parquet"), "prompt", "answer")


class WordTokenizer:
    """One token per word; records how it was called."""

    def __call__(self, texts, add_special_tokens=True):
        self.add_special_tokens = add_special_tokens
        return {"input_ids": [[len(w) for w in t.split()] for t in texts]}


def test_overlong_prompts_error_naming_the_line_or_are_dropped_and_counted(tmp_path):
    rows = [{"prompt": "a " * n} for n in (3, 50, 4, 60)]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    tok = WordTokenizer()
    with pytest.raises(DataError, match=r"p.jsonl:2: the prompt has 50 tokens, more than the 10 .*2 of 4 prompts"):
        PromptSource("file", str(path), tokenizer=tok, context_limit=10)
    src = PromptSource("file", str(path), tokenizer=tok, context_limit=10, overlong="drop")
    assert src.dropped == 2 and sorted(len(p.text.split()) for p in src.items) == [3, 4]
    assert all(p.ids == [1] * len(p.text.split()) for p in src.items) and tok.add_special_tokens
    with pytest.raises(DataError, match="every one of the 4 prompts is longer than 2 tokens"):
        PromptSource("file", str(path), tokenizer=tok, context_limit=2, overlong="drop")


def test_toy_prompts_are_deterministic():
    a, b = PromptSource("toy", seed=3), PromptSource("toy", seed=3)
    assert [p.text for p in a.next(20)] == [p.text for p in b.next(20)]


def test_prompts_without_an_answer_are_refused_by_name_when_something_scores_against_answers(tmp_path):
    from moe_rl.data.rewards import math_answer_reward
    from moe_rl.rollout.multi_turn.builtin_envs import env_class

    path = tmp_path / "math.jsonl"
    path.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n{"prompt": "2 + 2 ="}\n')
    with pytest.raises(DataError, match=f"{path}:2: the prompt has no answer .* rollout.multi_turn.env=math_retry"):
        PromptSource("file", str(path), answers_for="rollout.multi_turn.env=math_retry")
    assert len(PromptSource("file", str(path)).items) == 2  # answers are optional for what does not score them
    # what declares the need: the answer-scoring rewards and environments, not the toy ones
    assert numeric_answer_reward.needs_answer and math_answer_reward.needs_answer
    assert not getattr(toy_low_token_reward, "needs_answer", False)
    assert env_class("math_retry").needs_answer and env_class("calculator").needs_answer
    assert not getattr(env_class("toy"), "needs_answer", False)
