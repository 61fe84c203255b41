"""Reward functions, selected by `data.reward = "module:function"`. Two forms, each sync or `async def`:

- batched: `fn(responses: list[str], answers: list[str | None], response_ids: list[list[int]]) -> list[float]`;
- per sample, marked with `@per_sample`: `fn(response: str, answer, response_ids: list[int]) -> float`;
  async ones run concurrently (asyncio.gather), e.g. calls to a judge model or a sandbox.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import numbers
import re
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from moe_rl.common import progress

RewardFn = Callable[[list[str], list, list[list[int]]], list[float]]

TOY_TARGET_IDS = range(2, 64)  # byte-level tokens of the tiny tokenizer; 0/1 are EOS/pad
TOY_HORIZON = 16


def needs_answer(fn: Callable) -> Callable:
    """Mark a reward plugin as scoring against each prompt's reference answer (data.answer_key): the trainer
    refuses data with a prompt that has none before any engine starts."""
    fn.needs_answer = True
    return fn


def toy_low_token_reward(responses: list[str], answers: list, response_ids: list[list[int]]) -> list[float]:
    """Toy task: (number of response tokens with id in [2, 64)) / 16, capped at 1.

    About 1/8 of the tiny vocabulary qualifies, so a random tiny model scores ~0.15 on 24-token
    responses; the policy learns to prefer those tokens within minutes. Special tokens never
    count and the fixed horizon rewards long on-target responses, so stopping early does not pay.
    """
    return [min(sum(t in TOY_TARGET_IDS for t in ids) / TOY_HORIZON, 1.0) for ids in response_ids]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@needs_answer
def numeric_answer_reward(responses: list[str], answers: list, response_ids: list[list[int]]) -> list[float]:
    """GSM8K style: 1 if the last number in the response (or the one after '####') equals the answer."""
    out = []
    for text, answer in zip(responses, answers, strict=True):
        if answer is None:
            raise ValueError("numeric_answer_reward needs an answer for every prompt (data.answer_key)")
        tail = text.split("####")[-1]
        nums = _NUMBER.findall(tail)
        want = _NUMBER.findall(str(answer))
        ok = bool(nums and want) and float(nums[-1].replace(",", "")) == float(want[-1].replace(",", ""))
        out.append(1.0 if ok else 0.0)
    return out


def per_sample(fn: Callable) -> Callable:
    """Mark a reward plugin as per-sample, `fn(response: str, answer, response_ids: list[int]) -> float`
    (sync or async): `score` calls it once per sample instead of once per batch."""
    fn.reward_per_sample = True
    return fn


def __getattr__(name: str):
    # `math_answer_reward` is imported on first use: math-verify (sympy, antlr) takes ~1 s to import.
    if name == "math_answer_reward":
        # heavy: math-verify, imported on first use
        from moe_rl.data.math_reward import math_answer_reward

        return math_answer_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_reward(spec: str) -> RewardFn:
    """`module:function` -> the function (clear error when missing or not callable)."""
    if ":" not in spec:
        raise ValueError(f"data.reward={spec!r} must look like 'module:function'")
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"data.reward={spec!r} cannot be loaded: {e}") from e
    if not callable(fn):
        raise ValueError(f"data.reward={spec!r} is a {type(fn).__name__}, not a function")
    return fn


class RewardError(RuntimeError):
    """The reward plugin failed or returned something that is not one finite number per sample."""


class _SampleFailed(Exception):
    """A per-sample plugin raised on sample `index` (the plugin's exception is the cause)."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


def _run(awaitable: Awaitable):
    """Await from sync code. Inside a running event loop (a notebook, an async caller) asyncio.run
    refuses to nest, so the awaitable runs on a fresh loop in a helper thread."""

    async def main():
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, main()).result()


async def _gather(awaitables: list[Awaitable]) -> list:
    return await asyncio.gather(*awaitables, return_exceptions=True)


async def _scored(i: int, awaitable: Awaitable, done: set[int]):
    value = await awaitable
    done.add(i)
    progress.mark()
    return value


def _per_sample_rewards(
    fn: Callable, responses: list[str], answers: list, response_ids: list[list[int]], done: set[int]
) -> list:
    """One call per sample, in order; the awaitables async plugins return then run concurrently. `done` collects
    the samples scored so far (named when the plugin times out)."""
    out = []
    for i, args in enumerate(zip(responses, answers, response_ids, strict=True)):
        try:
            out.append(fn(*args))
        except Exception as e:
            raise _SampleFailed(i) from e
        if not inspect.isawaitable(out[-1]):
            done.add(i)
            progress.mark()
    pending = [i for i, r in enumerate(out) if inspect.isawaitable(r)]
    if pending:
        scored = _run(_gather([_scored(i, out[i], done) for i in pending]))
        for i, r in zip(pending, scored, strict=True):
            if isinstance(r, BaseException):
                raise _SampleFailed(i) from r
            out[i] = r
    return out


class _TimedOut(Exception):
    """The plugin did not return within its time."""


def _within(timeout_s: float, fn: Callable[[], Any]) -> Any:
    """fn() on a daemon thread, waited for at most `timeout_s` seconds (0: no limit, on this thread). A daemon
    thread: a plugin that never returns must not keep the interpreter from exiting when the run stops."""
    if timeout_s <= 0:
        return fn()
    box: dict[str, Any] = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the calling thread
            box["error"] = e

    thread = threading.Thread(target=run, name="moe-rl-reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def _call(fn: Callable, responses: list[str], answers: list, response_ids: list[list[int]], done: set[int]):
    if getattr(fn, "reward_per_sample", False):
        return _per_sample_rewards(fn, responses, answers, response_ids, done)
    rewards = fn(responses, answers, response_ids)
    return _run(rewards) if inspect.isawaitable(rewards) else rewards


def score(
    fn: RewardFn,
    responses: list[str],
    answers: list,
    response_ids: list[list[int]],
    prompts: list[str],
    step: int,
    rank: int | None = None,
    phase: str = "",
    timeout_s: float = 0.0,
) -> list[float]:
    """Call the reward plugin (batched or `@per_sample`, sync or async) and check its output: one
    finite real number per sample. `phase` names what was scored in errors (e.g. "validation").

    A bad value stops the run with the step, the sample index, the prompt's start and the value:
    a NaN reward would otherwise turn every weight into NaN a step later. `timeout_s` > 0: a plugin
    that has not returned by then stops the run naming it and the samples still pending
    (data.reward_timeout_s).
    """
    name = getattr(fn, "__qualname__", repr(fn))
    where = f"step {step}" + (f" {phase}" if phase else "") + (f" (rank {rank})" if rank is not None else "")
    done: set[int] = set()  # the samples a per-sample plugin has scored
    try:
        rewards = _within(timeout_s, lambda: _call(fn, responses, answers, response_ids, done))
    except _TimedOut:
        pending = [i for i in range(len(responses)) if i not in done]
        shown = ", ".join(map(str, pending[:10])) + (", ..." if len(pending) > 10 else "")
        first = f"; the first's prompt {prompts[pending[0]][:60]!r}" if pending else ""
        raise RewardError(
            f"{where}: reward function {name} did not return within data.reward_timeout_s={timeout_s:g} s; "
            f"{len(pending)} of {len(responses)} samples pending (samples {shown}{first}). A judge or sandbox that "
            "stopped answering? Raise data.reward_timeout_s if the plugin is only slow"
        ) from None
    except _SampleFailed as e:  # the plugin's own traceback is chained below
        cause, i = e.__cause__, e.index
        raise RewardError(
            f"{where}: reward function {name} raised {type(cause).__name__} for sample {i} "
            f"(prompt {prompts[i][:60]!r}): {cause}"
        ) from cause
    except Exception as e:
        raise RewardError(f"{where}: reward function {name} raised {type(e).__name__}: {e}") from e
    try:
        count = len(rewards)
    except TypeError:
        raise RewardError(f"{where}: reward function {name} returned {type(rewards).__name__}, not a list") from None
    if count != len(responses):
        raise RewardError(f"{where}: reward function {name} returned {count} rewards for {len(responses)} samples")
    out = []
    for i, r in enumerate(rewards):
        value = r.item() if hasattr(r, "item") and getattr(r, "ndim", 1) == 0 else r
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(
                f"{where}: reward function {name} returned {value!r} for sample {i} (prompt {prompts[i][:60]!r}); "
                "rewards must be finite real numbers (no NaN, inf, strings or None)"
            )
        out.append(float(value))
    return out
