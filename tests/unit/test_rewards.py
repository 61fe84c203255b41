"""Reward plugins: the math-answer reward on tricky answers; async and per-sample plugins through `score`."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from moe_rl.data.math_reward import last_boxed
from moe_rl.data.rewards import RewardError, load_reward, math_answer_reward, per_sample, score

# (response, reference answer, equal?) -- expected by hand from the mathematics, not from the code.
MATH_CASES = [
    (r"So the answer is \boxed{\frac{\sqrt{3}}{2}}.", r"\frac{\sqrt{3}}{2}", True),  # nested braces
    (r"\boxed{\left(1, 2\right)}", "(1,2)", True),
    (r"\boxed{\dfrac{1}{2}}", "0.5", True),
    (r"\boxed{0.5}", r"\frac{1}{2}", True),
    ("The answer is 1/2", r"\frac12", True),
    (r"\boxed{2/4}", "1/2", True),
    (r"$\frac{1}{3}$", "0.33", False),  # not equal, only close
    (r"$\boxed{5\text{ cm}}$", "5", True),  # units
    ("#### 5 cm", "5", True),
    (r"\boxed{12 \text{ dollars}}", "12", True),
    (r"\boxed{\text{12 dollars}}", "12", True),
    (r"\boxed{5 x}", "5", False),  # a variable, not a unit
    (r"\boxed{\text{(B)} \text{ or } \text{(C)}}", "B", False),
    (r"\boxed{\$18.00}", "18", True),
    ("So she earns $18 per hour.\n#### $18", "18", True),
    (r"\boxed{50\%}", r"50\%", True),  # percent
    (r"\boxed{50\%}", "50", True),
    (r"\boxed{-3}", "-3", True),  # negative numbers
    (r"\boxed{3}", "-3", False),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 1,234", "1234", True),  # thousands separators
    ("#### 1,234", "She had <<1000+234=1234>>1234 apples.\n#### 1234", True),  # GSM8K reference solution
    ("#### 1234", "#### 1,243", False),
    (r"\boxed{-1{,}234.5}", "-1234.5", True),
    (r"\boxed{10}", "1,000", False),
    (r"First \boxed{3}, no wait, \boxed{4}", "4", True),  # several boxed: the last one counts
    (r"First \boxed{3}, no wait, \boxed{4}", "3", False),
    ("I don't know.", "7", False),  # no answer in the response
    ("", "7", False),
    (r"The answer is \boxed{\frac{1}{2}", "1/2", False),  # unclosed (truncated) box: no answer
    ("Adding them, 3 + 4 = 7.", "7", True),  # no marker: the last expression
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True),  # equivalent expressions
    (r"\boxed{\sqrt{8}}", r"2\sqrt{3}", False),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True),
    (r"the answer is \boxed{7}", r"Solution: so $x=7$, i.e. \boxed{7}.", True),  # MATH reference solution
]


@pytest.mark.parametrize("response,answer,equal", MATH_CASES)
def test_math_answer_reward(response, answer, equal):
    assert math_answer_reward([response], [answer], [[]]) == [1.0 if equal else 0.0]


def test_math_answer_reward_batch_and_missing_answer():
    responses, answers, want = zip(*MATH_CASES, strict=True)
    assert math_answer_reward(list(responses), list(answers), [[]] * len(want)) == [float(w) for w in want]
    with pytest.raises(ValueError, match="data.answer_key"):
        math_answer_reward([r"\boxed{1}"], [None], [[]])


def test_math_answer_reward_off_the_main_thread():
    """math-verify's signal-based timeouts fail outside the main thread: the reward must not."""
    got = []
    thread = threading.Thread(
        target=lambda: got.append(math_answer_reward([r"\boxed{0.5}", "7"], ["1/2", "8"], [[]] * 2))
    )
    thread.start()
    thread.join()
    assert got == [[1.0, 0.0]]


def test_last_boxed_matches_nested_braces():
    assert last_boxed(r"\boxed{1} and \boxed{\frac{a}{b^{2}}} end") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\fbox{x}") == "x"
    assert last_boxed("no box") is None
    assert last_boxed(r"\boxed{\frac{1}{2}") == ""


def test_math_answer_reward_loads_by_name():
    assert load_reward("moe_rl.data.rewards:math_answer_reward") is math_answer_reward


# ---- async and per-sample plugins ----

RESPONSES = ["r0", "r1", "r2", "r3"]
PROMPTS = [f"prompt number {i}" for i in range(4)]


def _score(fn, responses=RESPONSES):
    n = len(responses)
    return score(fn, responses, list(range(n)), [[i] * (i + 1) for i in range(n)], PROMPTS[:n], step=3)


async def async_batched(responses, answers, ids):
    await asyncio.sleep(0)
    return [float(a) + len(x) for a, x in zip(answers, ids, strict=True)]


@per_sample
def sync_per_sample(response, answer, response_ids):
    return float(answer) + len(response_ids) + 0.5 * (response == f"r{answer}")


@per_sample
async def async_per_sample(response, answer, response_ids):
    await asyncio.sleep(0.001 * (4 - answer))  # later samples finish first
    return float(answer) + len(response_ids) + 0.5 * (response == f"r{answer}")


def test_async_batched_plugin_is_awaited():
    assert _score(async_batched) == [1.0, 3.0, 5.0, 7.0]


def test_async_plugin_inside_a_running_event_loop():
    async def caller():
        return _score(async_batched), _score(async_per_sample)

    assert asyncio.run(caller()) == ([1.0, 3.0, 5.0, 7.0], [1.5, 3.5, 5.5, 7.5])


@pytest.mark.parametrize("fn", [sync_per_sample, async_per_sample])
def test_per_sample_plugins_get_one_sample_each_in_order(fn):
    assert _score(fn) == [1.5, 3.5, 5.5, 7.5]
    assert load_reward(f"{__name__}:{fn.__name__}") is fn


def test_async_per_sample_calls_run_concurrently():
    started, all_started = 0, asyncio.Event()

    @per_sample
    async def waits_for_all(response, answer, response_ids):
        nonlocal started
        started += 1
        if started == len(RESPONSES):
            all_started.set()
        await asyncio.wait_for(all_started.wait(), timeout=5)  # run one at a time, the first times out
        return float(answer)

    assert _score(waits_for_all) == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("is_async", [False, True])
def test_per_sample_exception_names_the_sample(is_async):
    def body(response, answer, response_ids):
        if answer == 2:
            raise ZeroDivisionError("no judge")
        return 1.0

    async def async_body(*args):
        return body(*args)

    fn = per_sample(async_body if is_async else body)
    with pytest.raises(RewardError, match=r"step 3: reward function .* raised ZeroDivisionError for sample 2 ") as err:
        _score(fn)
    assert "prompt number 2" in str(err.value) and "no judge" in str(err.value)
    assert isinstance(err.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("is_async", [False, True])
def test_per_sample_nan_names_the_sample(is_async):
    def body(response, answer, response_ids):
        return float("nan") if answer == 1 else 0.0

    async def async_body(*args):
        return body(*args)

    with pytest.raises(RewardError, match=r"step 3: .* returned nan for sample 1 \(prompt 'prompt number 1'\)"):
        _score(per_sample(async_body if is_async else body))


@pytest.mark.parametrize("form", ["per_sample", "async_per_sample", "batched"])
def test_a_plugin_that_never_returns_is_named_with_the_samples_pending(form):
    """data.reward_timeout_s: a judge that stops answering on sample 2 ends the step within the limit, naming the
    plugin and the samples not scored (per-sample forms: 2 and 3; a batched plugin: all of them)."""
    release = threading.Event()  # never set while the test waits: the plugin hangs

    def judge(response, answer, ids):
        if response == "c":
            release.wait(30)
        return 1.0

    async def async_judge(response, answer, ids):
        if response == "c":
            await asyncio.sleep(30)
        return 1.0

    def batched_judge(responses, answers, ids):
        release.wait(30)
        return [1.0] * len(responses)

    fn = {"per_sample": per_sample(judge), "async_per_sample": per_sample(async_judge), "batched": batched_judge}[form]
    t0 = time.perf_counter()
    with pytest.raises(RewardError) as e:
        score(fn, ["a", "b", "c", "d"], [None] * 4, [[1]] * 4, ["p0", "p1", "p2", "p3"], 7, rank=1, timeout_s=0.5)
    assert time.perf_counter() - t0 < 2.0
    message = str(e.value)
    assert "step 7 (rank 1)" in message and fn.__qualname__ in message and "data.reward_timeout_s=0.5 s" in message
    if form == "batched":
        assert "4 of 4 samples pending (samples 0, 1, 2, 3; the first's prompt 'p0')" in message
    elif form == "per_sample":  # the sync plugin is called in order: it hangs on 2, so 3 is never called
        assert "2 of 4 samples pending (samples 2, 3; the first's prompt 'p2')" in message
    else:  # the async calls run concurrently: only 2 is left
        assert "1 of 4 samples pending (samples 2; the first's prompt 'p2')" in message
    release.set()


def test_a_plugin_within_its_time_is_scored_as_without_a_limit():
    for fn in (sync_per_sample, async_per_sample, async_batched):
        assert score(fn, RESPONSES, list(range(4)), [[1]] * 4, PROMPTS, 1, timeout_s=30) == score(
            fn, RESPONSES, list(range(4)), [[1]] * 4, PROMPTS, 1
        )
    with pytest.raises(RewardError, match="raised ValueError for sample 0"):  # an error in the thread comes through
        score(per_sample(_raises), RESPONSES, [None] * 4, [[1]] * 4, PROMPTS, 1, timeout_s=30)


def _raises(response, answer, ids):
    raise ValueError("bad")
