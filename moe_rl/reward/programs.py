"""What the code reward runs in the sandbox for one sample: the response's code (a fenced block or the whole
response; a HumanEval completion joined to its prompt), the row's tests (assert-style, HumanEval's `check`, or
stdin/stdout cases) and the programs that run them. Pure text work: code is parsed here (`ast.parse`, never run).

Assert-style tests run in one program per sample (the harness, `HARNESS`): it executes the solution, then each test
in its own try/except, printing one tally line per test behind a per-run nonce read from stdin; a solution that
exits early (`sys.exit(0)`) or prints a fake tally cannot pass tests it did not run. One run per sample, not one per
assert: starting a sandboxed interpreter costs more than most tests, and the solution is executed once.
Stdin/stdout tests run the solution once per case, the case's input as stdin."""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

STATUSES = ("passed", "failed", "timeout", "crashed", "oom", "no_code", "syntax_error", "no_tests", "bad_tests")
"""Every status a sample gets: the sandbox's five, and the four of input that never ran."""

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_OPEN_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*)\Z", re.DOTALL)
PYTHON_TAGS = ("", "python", "py", "python3")
"""Fence tags whose block is Python code (an untagged ``` block counts; ```text, ```bash do not)."""


def extract_code(response: str) -> tuple[str, bool]:
    """(the code of `response`, whether it came from a fenced block): the last ```python (or bare ```) block when
    the response has one (an unclosed fence at the end, a response cut off by max_tokens, counts up to the end);
    else the whole response."""
    blocks = [(m.group(1).lower(), m.group(2), m.end()) for m in _FENCE.finditer(response)]
    tail_start = blocks[-1][2] if blocks else 0
    if (m := _OPEN_FENCE.search(response, tail_start)) is not None:
        blocks.append((m.group(1).lower(), m.group(2), len(response)))
    python = [code for tag, code, _ in blocks if tag in PYTHON_TAGS]
    if python:
        return python[-1], True
    return response, False


def parses(source: str) -> bool:
    """Whether `source` is valid Python (parsed only, never run)."""
    try:
        ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a NUL byte
        return False
    return True


def defines(source: str, name: str) -> bool:
    """Whether `source` parses and defines a top-level function `name`."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def humaneval_solution(prompt: str, response: str, entry_point: str) -> str:
    """The program of a HumanEval-style row: `prompt` (imports, helpers, the signature and docstring) continued by
    the response's code; a response whose code is a whole definition of `entry_point` (a chat model's fenced
    answer) follows the prompt instead of continuing it, so it replaces the prompt's function and still sees the
    prompt's imports and helpers (every HumanEval prompt parses on its own: a docstring is a function body)."""
    code, _ = extract_code(response)
    if defines(code, entry_point):
        return prompt.rstrip("\n") + "\n\n" + code
    return prompt + code


@dataclass
class Tests:
    """A row's tests: assert-style (`asserts`: each a source run after the solution) or stdin/stdout (`cases`:
    (input, expected output) pairs), or the reason there are none usable (`status` no_tests / bad_tests)."""

    asserts: list[str] = field(default_factory=list)
    cases: list[tuple[str, str]] = field(default_factory=list)
    status: str = ""  # "" usable; no_tests; bad_tests
    why: str = ""

    @property
    def total(self) -> int:
        return len(self.asserts) or len(self.cases)


def row_tests(row: dict, answer) -> Tests:
    """The tests of a row: HumanEval's `test` + `check(entry_point)`, a `tests` column, or verl's
    `reward_model.ground_truth`; with no row, the sample's `answer` (a batched call without samples=)."""
    if row.get("test") is not None and row.get("entry_point"):
        if not isinstance(row["test"], str) or not isinstance(row["entry_point"], str):
            return Tests(status="bad_tests", why="test and entry_point must be strings")
        return assert_tests([row["test"] + f"\n\ncheck({row['entry_point']})\n"])
    value = row.get("tests")
    if value is None:
        reward_model = row.get("reward_model")
        value = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    if value is None and not row:
        value = answer
    return parse_tests(value)


def parse_tests(value) -> Tests:
    """Tests from a column's value: a list of assert strings; a JSON object (or its text) {"inputs": [...],
    "outputs": [...]} of stdin/stdout cases; or a string of Python (each top-level assert a test)."""
    if value is None or (isinstance(value, (str, list, tuple, dict)) and not value):
        return Tests(status="no_tests", why="the row has no tests")
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            return Tests(status="bad_tests", why=f"tests look like JSON but do not parse: {e}")
    if isinstance(value, dict):
        return io_tests(value)
    if isinstance(value, (list, tuple)):
        if not all(isinstance(t, str) for t in value):
            return Tests(status="bad_tests", why="a list of tests must hold strings of Python")
        return assert_tests(list(value))
    if isinstance(value, str):
        return assert_tests(split_asserts(value))
    return Tests(status="bad_tests", why=f"tests of type {type(value).__name__}")


def assert_tests(sources: list[str]) -> Tests:
    """Assert-style tests, each checked to parse (one that does not: bad_tests)."""
    sources = [s for s in sources if s.strip()]
    if not sources:
        return Tests(status="no_tests", why="the tests are empty")
    for i, s in enumerate(sources):
        if not parses(s):
            return Tests(status="bad_tests", why=f"test {i} does not parse")
    return Tests(asserts=sources)


def split_asserts(source: str) -> list[str]:
    """A string of Python tests as one test per top-level assert: the statements before an assert (imports,
    helpers) go with it, the statements after the last assert with the last one. A string that does not parse is
    returned whole (and refused as bad_tests); one without asserts is one test."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return [source]
    lines = source.splitlines(keepends=True)
    ends = [n.end_lineno for n in tree.body if isinstance(n, ast.Assert)]
    if len(ends) < 2:
        return [source]
    ends[-1] = len(lines)
    out, start = [], 0
    for end in ends:
        out.append("".join(lines[start:end]))
        start = end
    return out


def _text(value) -> str | None:
    """A case's input or output: a string, or a list of lines (joined with newlines)."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return None


def io_tests(spec: dict) -> Tests:
    """Stdin/stdout cases from {"inputs": [...], "outputs": [...]} (verl's and PRIME's code datasets)."""
    if "fn_name" in spec:
        return Tests(status="bad_tests", why="call-based tests (fn_name) are not supported; use stdin/stdout")
    inputs, outputs = spec.get("inputs"), spec.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        return Tests(status="bad_tests", why='stdin/stdout tests need "inputs" and "outputs" lists of one length')
    if not inputs:
        return Tests(status="no_tests", why="no stdin/stdout cases")
    cases = [(_text(i), _text(o)) for i, o in zip(inputs, outputs, strict=True)]
    if any(i is None or o is None for i, o in cases):
        return Tests(status="bad_tests", why="each input and output must be a string (or a list of lines)")
    return Tests(cases=cases)


def same_output(got: str, want: str) -> bool:
    """Stdout matches: equal after stripping trailing whitespace from each line and trailing blank lines."""

    def norm(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]

    return norm(got) == norm(want)


HARNESS = """\
import sys


def _main(solution, tests):
    nonce = sys.stdin.readline().strip()
    out = sys.stdout  # kept: the solution may replace sys.stdout or print

    def say(word):
        out.write("\\n" + nonce + " " + word + "\\n")
        out.flush()

    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(solution, "solution.py", "exec"), scope)
    except MemoryError:
        raise
    except BaseException as e:  # SystemExit too: a solution that exits early runs no test
        say("solution " + type(e).__name__)
        raise SystemExit(1)
    failed = memory = False
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d.py" % i, "exec"), scope)
        except MemoryError:
            memory = failed = True
            say("fail %d" % i)
        except BaseException:
            failed = True
            say("fail %d" % i)
        else:
            say("ok %d" % i)
    say("done")
    if memory:
        raise MemoryError("a test ran out of memory")
    raise SystemExit(1 if failed else 0)


_main(SOLUTION, TESTS)
"""


def harness(solution: str, tests: list[str]) -> str:
    """The program that runs `solution` then each assert-style test (see the module's docstring)."""
    return HARNESS.replace("_main(SOLUTION, TESTS)", f"_main({solution!r}, {tests!r})")


def tally(stdout: bytes, nonce: str, total: int) -> tuple[int, bool]:
    """(tests that passed, whether the harness reached its end) from a harness run's stdout: only lines behind
    this run's nonce count, each test at most once."""
    passed, done = set(), False
    mark = nonce.encode() + b" "
    for line in stdout.split(b"\n"):
        if not line.startswith(mark):
            continue
        word = line[len(mark) :].decode(errors="replace").split()
        if word[:1] == ["ok"] and len(word) == 2 and word[1].isdigit() and int(word[1]) < total:
            passed.add(int(word[1]))
        elif word == ["done"]:
            done = True
    return len(passed), done
