"""moe-rl-eval's argument errors: refused before any model, tokenizer or engine is loaded, naming the argument."""

from __future__ import annotations

import shutil

import pytest

from moe_rl.data.config import Split
from moe_rl.reward import RewardSet
from moe_rl.tools import evaluate


@pytest.fixture
def model(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return str(tmp_path / "model")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/dir"], "--model /no/such/dir: no config.json there"),
        (["--task", "file"], "--task file needs --data"),
        (["--data", "/no/such.parquet", "--reward", "m:f"], "--data /no/such.parquet: does not exist"),
        (["--data", "DATA", "--task", "arithmetic"], "--task arithmetic generates its problems"),
        (["--data", "DATA", "--task", "humaneval"], "--task humaneval generates its problems"),
        (["--data", "DATA", "--reward", "/no/such_reward.py:f"], "/no/such_reward.py"),
        (["--data", "DATA", "--reward", "m:f", "--set", "format"], "--set 'format': expected KEY=VALUE"),
        (["--k", "0"], "--k, --n and --max-tokens must be at least 1"),
        (["--task", "gsm8k"], "argument --task: invalid choice"),
    ],
)
def test_bad_arguments_are_refused(model, tmp_path, capsys, args, message):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [str(data) if a == "DATA" else a for a in args]
    try:  # argparse's refusals exit; the reward's and the data's return the status
        code = evaluate.main(args if "--model" in args else ["--model", model, *args])
    except SystemExit as e:
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_set_the_schema_refuses_is_named(model, tmp_path):
    with pytest.raises(SystemExit, match="--set apply_chat_template=maybe"):
        evaluate.data_config("file", [str(tmp_path)], ["apply_chat_template=maybe"], "m:f")


def test_summary_per_source():
    out = evaluate.summarize({"pass@1": [1.0, 0.0, 1.0], "pass@2": [1.0, 1.0, 1.0]}, ["a", "b", "a"])
    assert out == {
        "pass@1": pytest.approx(2 / 3),
        "pass@2": 1.0,
        "problems": 3,
        "by_source": {
            "a": {"pass@1": 1.0, "pass@2": 1.0, "problems": 2},
            "b": {"pass@1": 0.0, "pass@2": 1.0, "problems": 1},
        },
    }


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    assert "examples:" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed here")
def test_task_humaneval_loads_its_split_and_scores_it_by_the_problems_tests(tiny_models):
    """moe-rl-eval --task humaneval up to the engine: its data section, reward, prompts and scorer (main's path)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])
    data = evaluate.data_config("humaneval", [], ["humaneval.holdout=20"], "")
    rewards = RewardSet.from_config(data)
    assert any("moe_rl.reward.code:code_reward" in line for line in rewards.describe())
    everything = evaluate.load_prompts(data, [], (data.humaneval, Split.test, None), 7, None, tokenizer)
    assert len(everything) == 20 and everything[0].row["task_id"] == "HumanEval/144"  # the held-out 20
    prompts = evaluate.load_prompts(data, [], (data.humaneval, Split.test, 3), 7, 3, tokenizer)
    assert [p.row["task_id"] for p in prompts] == ["HumanEval/144", "HumanEval/145", "HumanEval/146"]
    assert prompts[0].text == prompts[0].row["prompt"] and prompts[0].ids == tokenizer(prompts[0].text)["input_ids"]
    rewards.check_prompts(prompts, "humaneval")
    texts = [p.row["canonical_solution"] for p in prompts] + ["    pass\n", "    return 0\n"]
    with rewards:
        scores = evaluate.scorer(rewards)(prompts, [0, 1, 2, 0, 1], texts, [[1]] * 5)
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0]
