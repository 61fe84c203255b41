"""reasoning-gym rows (moe_rl/data/reasoning_gym.py): verl's schema as written to parquet, disjoint draws per split and
seed, and compute_score against reasoning-gym's own score_answer on entries reasoning-gym builds itself."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import reasoning_gym

from moe_rl.common.errors import ConfigError
from moe_rl.data import reasoning_gym as rg
from moe_rl.data import reasoning_gym_files, tasks

SMALL = {
    "basic_arithmetic": rg.DatasetSpec(
        1.0, {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"], "allow_parentheses": False}
    ),
    "chain_sum": rg.DatasetSpec(2.0, {"min_terms": 2, "max_terms": 2, "max_digits": 1}),
}


def test_written_rows_are_verls_schema(tmp_path):
    out = tmp_path / "train.parquet"
    assert tasks.main(["reasoning_gym", "--datasets", "chain_sum,leg_counting", "--n", "30", "--out", str(out)]) == 0
    table = pq.read_table(out)
    assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    assert len(rows) == 30 and {r["data_source"] for r in rows} == {
        "reasoning_gym/chain_sum",
        "reasoning_gym/leg_counting",
    }
    for i, r in enumerate(rows):
        (message,) = r["prompt"]
        assert message["role"] == "user" and message["content"] == r["extra_info"]["question"]
        assert r["reward_model"]["style"] == "rule" and r["reward_model"]["ground_truth"]
        assert r["extra_info"]["split"] == "train" and r["extra_info"]["index"] == i
        assert json.loads(r["extra_info"]["metadata"])["source_dataset"] == r["extra_info"]["dataset"]
    assert {r["ability"] for r in rows} == {"arithmetic"}


def test_sft_rows_hold_the_answer_as_the_assistant_turn(tmp_path):
    out = tmp_path / "sft.parquet"
    args = ["reasoning_gym", "--datasets", "chain_sum", "--n", "5", "--format", "sft", "--out", str(out)]
    assert tasks.main(args) == 0
    verl = rg.generate({"chain_sum": rg.DatasetSpec()}, "train", 5, 0)
    assert [r["messages"] for r in pq.read_table(out).to_pylist()] == [
        [
            {"role": "user", "content": v["prompt"][0]["content"]},
            {"role": "assistant", "content": v["reward_model"]["ground_truth"]},
        ]
        for v in verl
    ]


def test_worked_sft_responses_end_in_the_answer(tmp_path):
    """--response worked: the entry's own expression (reasoning-gym's metadata), '=' and the answer; scored 1.0 by
    the dataset's score_answer through compute_score. A dataset without an expression keeps the bare answer."""
    out = tmp_path / "sft.parquet"
    args = ["reasoning_gym", "--datasets", "basic_arithmetic,leg_counting", "--n", "40", "--format", "sft"]
    assert tasks.main([*args, "--response", "worked", "--out", str(out)]) == 0
    verl = rg.generate({"basic_arithmetic": rg.DatasetSpec(), "leg_counting": rg.DatasetSpec()}, "train", 40, 0)
    sources = set()
    for v, sft in zip(verl, pq.read_table(out).to_pylist(), strict=True):
        response = sft["messages"][1]["content"]
        answer, info = v["reward_model"]["ground_truth"], v["extra_info"]
        if v["data_source"] == "reasoning_gym/basic_arithmetic":
            assert response == json.loads(info["metadata"])["expression"].replace(" ", "") + "=" + answer
            assert response != answer and " " not in response
        else:
            assert response == answer
        assert rg.compute_score(v["data_source"], response, answer, info) == 1.0
        sources.add(v["data_source"])
    assert len(sources) == 2
    with pytest.raises(ConfigError, match="response"):
        rg.sft_row(verl[0], "essay")


def test_splits_and_seeds_draw_from_disjoint_streams():
    ranges = [rg.seed_range(split, seed) for split in ("train", "val", "test") for seed in (0, 1, rg.MAX_SEED - 1)]
    ranges.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1][1] <= 2**32  # reasoning-gym seeds are 32-bit
    with pytest.raises(ConfigError, match="seed"):
        rg.seed_range("train", rg.MAX_SEED)


def test_held_out_questions_exclude_the_train_draw():
    train = rg.generate(SMALL, "train", 300, 0)
    questions = {r["extra_info"]["question"] for r in train}
    assert len(questions) == 300  # distinct within a draw
    test = rg.generate(SMALL, "test", 100, 0, exclude=questions)
    test_questions = {r["extra_info"]["question"] for r in test}
    assert len(test_questions) == 100 and not test_questions & questions
    # without the exclusion this small task space does repeat train questions in the test stream
    assert {r["extra_info"]["question"] for r in rg.generate(SMALL, "test", 100, 0)} & questions
    assert rg.generate(SMALL, "test", 100, 0, exclude=questions) == test  # deterministic


def test_the_entries_are_reasoning_gyms_own():
    """Each row is the entry reasoning-gym builds from the row's seed stream (seed = the split's start)."""
    start, _ = rg.seed_range("val", 3)
    rows = rg.generate({"count_bits": rg.DatasetSpec()}, "val", 10, 3)
    ds = reasoning_gym.create_dataset("count_bits", seed=start, size=10)
    assert [(r["extra_info"]["question"], r["reward_model"]["ground_truth"]) for r in rows] == [
        (ds[i]["question"], ds[i]["answer"]) for i in range(10)
    ]


@pytest.mark.parametrize(
    "name", ["basic_arithmetic", "chain_sum", "leg_counting", "count_bits", "number_sorting", "fraction_simplification"]
)
def test_compute_score_is_score_answer(name):
    """On entries reasoning-gym generates itself (not through our draw), right, wrong, partial and tagged answers
    score as the dataset's own score_answer scores the extracted answer."""
    ds = reasoning_gym.create_dataset(name, seed=12345, size=8)
    (row,) = rg.generate({name: rg.DatasetSpec()}, "test", 1, 5)  # the extra_info layout compute_score reads
    scores = []
    for entry in ds:
        info = row["extra_info"] | {"question": entry["question"], "metadata": json.dumps(entry["metadata"])}
        for response, answers in (
            (entry["answer"], [entry["answer"]]),
            (f"<think>x</think><answer>{entry['answer']}</answer>", [entry["answer"]]),
            ("12345678", ["12345678"]),
            (f" {entry['answer']}9 \n", [f"{entry['answer']}9"]),
            ("<answer>1</answer> then <answer>2</answer>", ["2"]),
            # a worked step: the better of the whole response and what follows its last '='
            (f"1+2= {entry['answer']}\n", [f"1+2= {entry['answer']}", entry["answer"]]),
            (f"{entry['answer']}=7", [f"{entry['answer']}=7", "7"]),
        ):
            got = rg.compute_score(f"reasoning_gym/{name}", response, entry["answer"], info)
            assert got == pytest.approx(max(ds.score_answer(a, entry) for a in answers)), (response, entry)
            scores.append(got)
    assert 1.0 in scores and min(scores) < 1.0  # both right and wrong answers were scored


def test_bad_datasets_and_settings_are_named():
    with pytest.raises(ConfigError, match=r"datasets\.no_such_set: not a reasoning-gym dataset"):
        rg.check_datasets({"no_such_set": rg.DatasetSpec()})
    with pytest.raises(ConfigError, match=r"chain_sum\.weight: 0"):
        rg.check_datasets({"chain_sum": rg.DatasetSpec(weight=0)})
    with pytest.raises(ConfigError, match=r"chain_sum\.settings: .*refuses"):
        rg.check_datasets({"chain_sum": rg.DatasetSpec(settings={"min_terms": 3, "max_terms": 2})})
    with pytest.raises(ConfigError, match="only 10 new ones"):  # one-digit +- with 1 term: 10 questions at most
        rg.generate(
            {"chain_sum": rg.DatasetSpec(settings={"min_terms": 1, "max_terms": 1, "max_digits": 1})}, "train", 20, 0
        )
    with pytest.raises(ValueError, match="not a reasoning-gym one"):
        rg.compute_score("openai/gsm8k", "1", "1")


def test_cli_errors(tmp_path, capsys):
    out = str(tmp_path / "x.parquet")
    assert tasks.main(["reasoning_gym", "--datasets", "nope", "--out", out]) == 2
    assert "not a reasoning-gym dataset" in capsys.readouterr().err
    assert (
        reasoning_gym_files.main(["--datasets", "chain_sum", "--settings", '{"leg_counting": {}}', "--out", out]) == 2
    )
    assert "keyed by datasets of --datasets" in capsys.readouterr().err


def test_builtin_task_prompts_are_the_rows(tmp_path):
    """data.task=reasoning_gym through the RL prompt loader: chat messages, the ground truth as the answer, the row
    kept; validation holds no train question."""
    from moe_rl.config.schema import DataConfig
    from moe_rl.data.prompts import PromptSource
    from moe_rl.models.tiny import build_tokenizer

    d = DataConfig(task="reasoning_gym", apply_chat_template=True)
    d.reasoning_gym.train_size, d.reasoning_gym.val_size = 50, 20
    tok = build_tokenizer(512)
    train = PromptSource.from_config(d, seed=0, tokenizer=tok, problems=(d.reasoning_gym, "train", 50)).items
    val = PromptSource.from_config(d, seed=0, tokenizer=tok, problems=(d.reasoning_gym, "val", 20)).items
    rows = rg.generate(d.reasoning_gym.datasets, "train", 50, 0)
    assert [(p.messages, p.answer, p.data_source) for p in train] == [
        (r["prompt"], r["reward_model"]["ground_truth"], r["data_source"]) for r in rows
    ]
    assert train[0].text == tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert len(val) == 20 and not {p.messages[0]["content"] for p in val} & {p.messages[0]["content"] for p in train}
