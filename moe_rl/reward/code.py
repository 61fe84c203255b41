"""The code reward: each response's code run against its row's tests in the sandbox (moe_rl/sandbox), every run of
a batch at once through the process's sandbox pool (data.sandbox.workers). What runs is programs.py's.

    data.reward=moe_rl.reward.code:code_reward     (data.task=humaneval's own)

Per sample it returns {"score", "passed", "tests_passed", "tests_total", "seconds", "status_<s>"} (one status_ key
per status of programs.STATUSES, 1 for the sample's), which the RewardSet logs as reward/code_reward/<key>: the
status fractions of a step sum to 1. Score (data.code_score): `all` 1.0 only when every test passed, `fraction`
the share of tests passed. Input that cannot run (no code, code that does not parse, no tests, tests that do not
parse) scores 0.0 with its status; nothing here raises for a bad response or row."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from moe_rl import sandbox
from moe_rl.reward.builtin import uses_sandbox
from moe_rl.reward.programs import (
    STATUSES,
    Tests,
    extract_code,
    harness,
    humaneval_solution,
    parses,
    row_tests,
    same_output,
    tally,
)
from moe_rl.sandbox.pool import Job

SCORES = ("all", "fraction")
"""data.code_score's choices."""
_settings = {"score": "all"}


def configure(score: str) -> None:
    """The process's data.code_score (RewardSet.from_config sets it from the run's config)."""
    if score not in SCORES:
        raise ValueError(f"data.code_score={score!r}: choose one of {SCORES}")
    _settings["score"] = str(score)


@dataclass
class Plan:
    """One sample's runs: the jobs it adds to the batch and how to read their results back."""

    tests: Tests
    solution: str = ""
    status: str = ""  # set when the sample never runs (no_code, syntax_error, no_tests, bad_tests)
    nonce: str = ""
    first: int = 0  # index of its first job in the batch


def plan(response: str, row: dict, answer) -> Plan:
    """What to run for one sample (nothing, with a status, when its input cannot run)."""
    tests = row_tests(row, answer)
    if row.get("entry_point") and isinstance(row.get("prompt"), str) and row.get("test") is not None:
        code = extract_code(response)[0]
        solution = humaneval_solution(row["prompt"], response, str(row["entry_point"]))
    else:
        code = solution = extract_code(response)[0]
    p = Plan(tests, solution)
    if tests.status:  # the row's fault comes first: every response to it gets the same status
        p.status = tests.status
    elif not code.strip():
        p.status = "no_code"
    elif not parses(solution):
        p.status = "syntax_error"
    return p


def jobs_of(p: Plan) -> list[Job]:
    """The sandbox jobs of a planned sample: one harness run for assert-style tests, one run per stdin case."""
    if p.status:
        return []
    if p.tests.asserts:
        p.nonce = secrets.token_hex(16)
        return [Job(harness(p.solution, p.tests.asserts), stdin=(p.nonce + "\n").encode())]
    return [Job(p.solution, stdin=case_input.encode()) for case_input, _ in p.tests.cases]


def result_of(p: Plan, results: list) -> dict:
    """A sample's reward dict from its runs' results."""
    total = p.tests.total if not p.status else 0
    if p.status:
        passed, status, seconds = 0, p.status, 0.0
    elif p.tests.asserts:
        r = results[0]
        passed, done = tally(r.stdout, p.nonce, total)
        status = r.status if r.status in ("timeout", "crashed", "oom") else "failed"
        if done and passed == total and r.status == "passed":
            status = "passed"
        seconds = r.seconds
    else:
        ok = [
            r.status == "passed" and same_output(r.stdout.decode(errors="replace"), want)
            for r, (_, want) in zip(results, p.tests.cases, strict=True)
        ]
        passed = sum(ok)
        worst = [r.status for r in results if r.status in ("timeout", "oom", "crashed")]
        status = "passed" if passed == total else (worst[0] if worst else "failed")
        seconds = sum(r.seconds for r in results)
    fraction = passed / total if total else 0.0
    score = fraction if _settings["score"] == "fraction" else float(status == "passed")
    return {
        "score": score,
        "passed": int(status == "passed"),
        "tests_passed": passed,
        "tests_total": total,
        "seconds": seconds,
    } | {f"status_{s}": int(s == status) for s in STATUSES}


@uses_sandbox
def code_reward(responses: list[str], answers: list, response_ids: list[list[int]], samples=None) -> list[dict]:
    """Run each response's code against its row's tests in the sandbox (moe-rl's batched form; `samples` give the
    rows: a `tests` column, verl's reward_model.ground_truth, or HumanEval's test and entry_point; without samples,
    each answer holds the tests). One reward dict per response (see the module's docstring)."""
    rows = [s.row for s in samples] if samples is not None else [{}] * len(responses)
    plans = [plan(text, row, answer) for text, row, answer in zip(responses, rows, answers, strict=True)]
    jobs: list[Job] = []
    for p in plans:
        p.first = len(jobs)
        jobs += jobs_of(p)
    results = sandbox.shared_pool().run_many(jobs) if jobs else []
    out = []
    for p in plans:
        count = 0 if p.status else (1 if p.tests.asserts else len(p.tests.cases))
        out.append(result_of(p, results[p.first : p.first + count]))
    return out
