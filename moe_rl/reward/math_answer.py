"""Math-answer reward: 1 if the response's final answer equals the reference answer, else 0.

The final answer is the last `\\boxed{...}` (nested braces allowed), else the first line after the
last '####' (GSM8K), else math-verify's own pick from the whole text (an "answer is ..." phrase,
else the last expression). The reference answer goes through the same steps, except that one with
neither marker is the answer itself: a MATH solution, a GSM8K solution ending in '#### 1,234' and a
bare answer ('\\frac{1}{2}', '(1,2)', '50\\%') all work.
Equality is math-verify's (https://github.com/huggingface/Math-Verify): LaTeX (`\\dfrac`,
`\\left(`, `\\text{}` units), fractions = decimals, thousands separators, percent, and symbolic
equality (`2\\sqrt{2}` = `\\sqrt{8}`).
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A number followed only by unit words ('5 cm', '12 \text{dollars}', '$18 per hour'): keep the number,
# since math-verify reads bare words inside LaTeX as a product of symbols (5*c*m). A bare single letter
# is a variable ('2 i', '5 x'), not a unit.
_NUMBER_WITH_UNIT = re.compile(
    r"\s*(\\?\$?\s*-?[\d,]*\.?\d+)\s*(?:\\(?:text|mbox|mathrm)\s*\{\s*[A-Za-z][A-Za-z .]*\}|[A-Za-z]{2,}[A-Za-z .]*)\s*"
)
_TEXT_WRAPPED = re.compile(r"\s*\\(?:text|mbox|textbf|mathrm)\s*\{([^{}]*)\}\s*")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces); None if there is none,
    "" (no answer) if it is unclosed, e.g. cut off by the length limit."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return ""


def final_answer(text: str, reference: bool = False) -> str:
    """The part of `text` holding its final answer, as math-verify input (see the module docstring)."""
    answer = last_boxed(text)
    if answer is None and "####" in text:
        answer = (text.rsplit("####", 1)[1].strip().splitlines() or [""])[0]
    if answer is None:
        if not reference:
            return text
        answer = text
    if m := _TEXT_WRAPPED.fullmatch(answer):
        answer = m.group(1)
    if m := _NUMBER_WITH_UNIT.fullmatch(answer):
        answer = m.group(1)
    return answer if "$" in answer.replace("\\$", "") else f"${answer}$"


def math_answer_reward(responses: list[str], answers: list, response_ids: list[list[int]]) -> list[float]:
    """1.0 when the response's final answer equals the reference answer (math-verify), else 0.0.

    math-verify's timeouts use `signal.alarm`, which only works in the main thread (elsewhere it
    raises ValueError). So a call from the main thread keeps its 5 s limit on parsing and comparing
    (a pathological expression cannot stall the step); from any other thread it runs without one.
    """
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    golds: dict[str, list] = {}  # the n samples of a prompt share one answer: parse it once
    out = []
    for text, answer in zip(responses, answers, strict=True):
        if answer is None:
            raise ValueError("math_answer_reward needs an answer for every prompt: set data.answer_key")
        key = str(answer)
        if key not in golds:
            golds[key] = parse(final_answer(key, reference=True), parsing_timeout=timeout)
        pred = parse(final_answer(text), parsing_timeout=timeout)
        ok = bool(golds[key] and pred) and verify(golds[key], pred, timeout_seconds=timeout)
        out.append(1.0 if ok else 0.0)
    return out


math_answer_reward.needs_answer = True  # as builtin.needs_answer marks it (that module imports this one)


def compute_score(solution_str: str, ground_truth) -> float:
    """verl's per-sample form of math_answer_reward: 1.0 when the final answers are equal (math-verify), else 0.0."""
    return math_answer_reward([solution_str], [ground_truth], [[]])[0]
