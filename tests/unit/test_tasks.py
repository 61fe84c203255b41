"""Built-in verifiable tasks (moe_rl/data/tasks.py): splits never share a problem whatever the seeds, answers are
right (the expression evaluated here by Python's own parser), worked solutions end with the answer as their last
integer, the CLI writes rows, and impossible settings are refused naming the key."""

from __future__ import annotations

import ast
import json
import operator
import random

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.data.config import ArithmeticConfig, Split
from moe_rl.data.rewards import numeric_answer_reward
from moe_rl.data.tasks import generate, main, split_of

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node: ast.AST) -> int:
    """An integer expression of + - * evaluated from Python's parse tree (precedence as Python has it)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.BinOp):
        return OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
    return node.value


@pytest.mark.parametrize("operators", ["+-", "+-*", "*"])
def test_answers_are_the_expressions_values_and_the_last_integer_of_the_solution(operators):
    seed = random.randrange(2**31)
    cfg = ArithmeticConfig(operands=random.choice([2, 3, 4]), digits=random.choice([2, 3]), operators=operators)
    problems = generate(cfg, Split.train, 200, seed)
    for p in problems:
        assert p.prompt.endswith("=")
        assert p.answer == _evaluate(ast.parse(p.prompt[:-1], mode="eval")), (seed, p)
    rows = [p.row() for p in problems]
    # the reward the task is scored with: the solution is right, a wrong final number is not
    assert numeric_answer_reward([r["response"] for r in rows], [r["answer"] for r in rows], []) == [1.0] * 200
    wrong = [r["response"] + f", {int(r['answer']) + 1}" for r in rows]
    assert numeric_answer_reward(wrong, [r["answer"] for r in rows], []) == [0.0] * 200


def test_a_mix_of_operand_counts_draws_every_count_with_right_answers():
    """data.arithmetic.max_operands (the long-tail task): every count in operands..max_operands is drawn, answers
    are right, solutions vary several-fold in length; max_operands=0 keeps one count."""
    seed = random.randrange(2**31)
    cfg = ArithmeticConfig(operands=2, max_operands=8, digits=1)
    problems = generate(cfg, Split.train, 2000, seed)
    counts = {p.prompt.count("+") + p.prompt.count("-") + 1 for p in problems}
    assert counts == set(range(2, 9)), (seed, counts)
    assert all(p.answer == _evaluate(ast.parse(p.prompt[:-1], mode="eval")) for p in problems), seed
    lengths = sorted(len(p.response) for p in problems)
    assert lengths[-1] >= 5 * lengths[0], (seed, lengths[0], lengths[-1])
    fixed = generate(ArithmeticConfig(operands=3, max_operands=0, digits=2), Split.test, 50, seed)
    assert [p.prompt.count("+") + p.prompt.count("-") for p in fixed] == [2] * 50
    assert cfg.space() == sum(10**k * 2 ** (k - 1) for k in range(2, 9))


def test_splits_are_disjoint_for_any_seeds_and_a_problem_is_drawn_once():
    cfg = ArithmeticConfig(operands=2, digits=2, operators="+-")  # 20 000 problems: draws overlap by chance
    seeds = random.sample(range(2**31), 3)
    drawn = {s: {p.prompt for seed in seeds for p in generate(cfg, s, 600, seed)} for s in Split}
    for a in Split:
        assert all(split_of(text) == a for text in drawn[a])
        for b in Split:
            assert a == b or not drawn[a] & drawn[b], (a, b, seeds)
    one = generate(cfg, Split.test, 600, seeds[0])
    assert len({p.prompt for p in one}) == 600
    assert one == generate(cfg, Split.test, 600, seeds[0])  # the seed decides
    assert one != generate(cfg, Split.test, 600, seeds[1])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"operands": 1}, "config data.arithmetic.operands: 1: a problem needs at least 2 operands"),
        (
            {"operands": 3, "max_operands": 3},
            "config data.arithmetic.max_operands: 3: choose 0 (every problem has operands=3 numbers) or more than 3",
        ),
        ({"digits": 0}, "config data.arithmetic.digits: 0: choose 1 to 6"),
        ({"operators": "+/"}, "config data.arithmetic.operators: '+/': choose one or more of '+-*' ('/' is not one)"),
        ({"operators": ""}, "config data.arithmetic.operators: '': choose one or more of '+-*'"),
    ],
)
def test_impossible_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(ConfigError) as e:
        generate(ArithmeticConfig(**settings), Split.train, 10, 0)
    assert str(e.value) == message


def test_more_problems_than_a_split_holds_are_refused():
    with pytest.raises(ConfigError, match="500 test problems asked of about 10 distinct ones"):
        generate(ArithmeticConfig(operands=2, digits=1, operators="+"), Split.test, 500, 0)


def test_the_cli_writes_rows_and_refuses_bad_settings(tmp_path, capsys):
    out = tmp_path / "test.jsonl"
    assert main(["arithmetic", "--split", "test", "--n", "50", "--seed", "7", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 50 and all(r.keys() == {"prompt", "response", "answer"} for r in rows)
    assert [r["prompt"] for r in rows] == [p.prompt for p in generate(ArithmeticConfig(), "test", 50, 7)]
    assert main(["arithmetic", "--operators", "x"]) == 2
    assert "--operators: 'x': choose one or more of '+-*'" in capsys.readouterr().err


def test_rl_reads_the_task_directly_with_answers_and_its_own_reward():
    """data.task=arithmetic: the prompt pool is the train split drawn with trainer.seed, each prompt with its answer,
    scored by the task's reward unless data.reward names another."""
    from moe_rl.config import TrainConfig
    from moe_rl.data.prompts import PromptSource

    cfg = ArithmeticConfig(operands=2, digits=2)
    source = PromptSource("arithmetic", problems=(cfg, "train", 300), seed=5, dp_rank=1, dp_size=2)
    drawn = generate(cfg, "train", 300, 5)
    assert [p.text for p in source.items] == [p.prompt for p in drawn][1::2]  # this data-parallel rank's share
    assert [p.answer for p in source.items] == [str(p.answer) for p in drawn][1::2]
    assert source.items[0].source == "arithmetic:train:1"
    train = TrainConfig()
    train.data.task = "arithmetic"
    assert train.data.reward_spec == "moe_rl.data.rewards:numeric_answer_reward"
    train.data.reward = "moe_rl.data.rewards:toy_low_token_reward"
    assert train.data.reward_spec == train.data.reward


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"operands": 1}, "config data.arithmetic.operands: 1: a problem needs at least 2 operands"),
        ({"operators": "x"}, "config data.arithmetic.operators: 'x': choose one or more of '+-*' ('x' is not one)"),
        ({"digits": 1, "operands": 2}, "config data.problems: 8000 train problems asked of about 160 distinct ones"),
    ],
)
def test_the_trainer_refuses_an_impossible_task_setting_before_anything_is_built(overrides, message):
    from moe_rl.config import TrainConfig
    from moe_rl.config.validate import validate

    cfg = TrainConfig()
    cfg.data.task = "arithmetic"
    for key, value in overrides.items():
        setattr(cfg.data.arithmetic, key, value)
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=2)
    assert str(e.value).startswith(message)
