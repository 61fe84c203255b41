"""Reward calls made in this process: batched functions (moe-rl's batched form and TRL's) and async per-sample ones,
under data.reward_timeout_s for the whole batch (synchronous per-sample functions go to the worker pool, pool.py).
Also the checked call of one moe-rl reward function, `score`, as moe_rl.data.rewards has always offered it."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from moe_rl.common import progress
from moe_rl.reward.load import Kind, RewardFunction, RewardLoadError, load_function
from moe_rl.reward.sample import Sample

RewardFn = Callable[[list[str], list, list[list[int]]], list[float]]

TRL_RESERVED = ("prompt", "completion", "completion_ids")
"""Row columns TRL does not pass on as keyword lists (GRPOTrainer._calculate_rewards)."""


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one finite number per sample."""


class SampleFailed(Exception):
    """A per-sample function raised on sample `index` (its exception is the cause)."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


class TimedOut(Exception):
    """The function did not return within its time."""


def load_reward(spec: str) -> RewardFn:
    """`module:function` (or `path/to/reward.py:function`) -> the function (clear error when missing or not
    callable)."""
    try:
        return load_function(spec)
    except RewardLoadError as e:
        raise ValueError(f"data.reward={spec!r} cannot be loaded: {e}") from e


def run_awaitable(awaitable: Awaitable):
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


def per_sample_calls(calls: list[Callable[[], Any]], done: set[int]) -> list:
    """One call per sample, in order; the awaitables async functions return then run concurrently. `done` collects
    the samples scored so far (named when the function times out)."""
    out = []
    for i, call in enumerate(calls):
        try:
            out.append(call())
        except Exception as e:
            raise SampleFailed(i) from e
        if not inspect.isawaitable(out[-1]):
            done.add(i)
            progress.mark()
    pending = [i for i, r in enumerate(out) if inspect.isawaitable(r)]
    if pending:
        scored = run_awaitable(_gather([_scored(i, out[i], done) for i in pending]))
        for i, r in zip(pending, scored, strict=True):
            if isinstance(r, BaseException):
                raise SampleFailed(i) from r
            out[i] = r
    return out


def within(timeout_s: float, fn: Callable[[], Any]) -> Any:
    """fn() on a daemon thread, waited for at most `timeout_s` seconds (0: no limit, on this thread). A daemon
    thread: a function that never returns must not keep the interpreter from exiting when the run stops."""
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
        raise TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


def sample_call(rf: RewardFunction, s: Sample) -> Callable[[], Any]:
    """The call of a per-sample function (verl or @per_sample) on one sample."""
    if rf.kind is Kind.verl:
        kwargs = {"data_source": s.data_source, "solution_str": s.response, "ground_truth": s.answer}
        return lambda: rf.fn(**kwargs, extra_info=s.row.get("extra_info"))
    more = {"sample": s} if rf.takes_samples else {}
    return lambda: rf.fn(s.response, s.answer, s.response_ids, **more)


def trl_arguments(samples: list[Sample], step: int, log_metric: Callable[[str, float], None]) -> dict:
    """The keywords TRL's GRPOTrainer passes a reward function: prompts (the row's prompt column: a string, or chat
    messages), completions (text, or [{"role": "assistant", "content": text}] for a chat prompt), completion_ids,
    every other row column as a list, trainer_state, log_extra and log_metric."""
    prompts = [s.row["prompt"] if "prompt" in s.row else (s.prompt_messages or s.prompt) for s in samples]
    completions = [
        [{"role": "assistant", "content": s.response}] if isinstance(p, list) else s.response
        for s, p in zip(samples, prompts, strict=True)
    ]
    columns = list(dict.fromkeys(k for s in samples for k in s.row if k not in TRL_RESERVED))
    kwargs = {k: [s.row.get(k) for s in samples] for k in columns}
    kwargs |= {
        "trainer_state": SimpleNamespace(global_step=step),  # the fields reward functions read of TRL's TrainerState
        "log_extra": lambda column, values: None,  # TRL's completions table: moe-rl keeps none
        "log_metric": log_metric,
    }
    ids = [s.response_ids for s in samples]
    return {"prompts": prompts, "completions": completions, "completion_ids": ids, **kwargs}


def call_batch(rf: RewardFunction, samples: list[Sample], step: int, done: set[int], log_metric) -> list:
    """`rf`'s raw results for `samples`, called in this process (one call per batch, or per sample gathered)."""
    if rf.per_sample:
        return per_sample_calls([sample_call(rf, s) for s in samples], done)
    if rf.kind is Kind.trl:
        kwargs = trl_arguments(samples, step, log_metric)
        if rf.accepts is not None:  # no **kwargs: only what it names (TRL itself would raise a TypeError)
            kwargs = {k: v for k, v in kwargs.items() if k in rf.accepts}
        out = rf.fn(**kwargs)
    else:
        more = {"samples": samples} if rf.takes_samples else {}
        responses, answers = [s.response for s in samples], [s.answer for s in samples]
        out = rf.fn(responses, answers, [s.response_ids for s in samples], **more)
    return run_awaitable(out) if inspect.isawaitable(out) else out


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
    """Call a moe-rl reward function (batched or `@per_sample`, sync or async) in this process and check its
    output: one finite real number per sample. `phase` names what was scored in errors (e.g. "validation").

    A bad value stops the run with the step, the sample index, the prompt's start and the value:
    a NaN reward would otherwise turn every weight into NaN a step later. `timeout_s` > 0: a function
    that has not returned by then stops the run naming it and the samples still pending.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    where = f"step {step}" + (f" {phase}" if phase else "") + (f" (rank {rank})" if rank is not None else "")
    done: set[int] = set()  # the samples a per-sample function has scored

    def call():
        if getattr(fn, "reward_per_sample", False):
            rows = zip(responses, answers, response_ids, strict=True)
            return per_sample_calls([lambda a=a: fn(*a) for a in rows], done)
        out = fn(responses, answers, response_ids)
        return run_awaitable(out) if inspect.isawaitable(out) else out

    try:
        rewards = within(timeout_s, call)
    except TimedOut:
        pending = [i for i in range(len(responses)) if i not in done]
        shown = ", ".join(map(str, pending[:10])) + (", ..." if len(pending) > 10 else "")
        first = f"; the first's prompt {prompts[pending[0]][:60]!r}" if pending else ""
        raise RewardError(
            f"{where}: reward function {name} did not return within data.reward_timeout_s={timeout_s:g} s; "
            f"{len(pending)} of {len(responses)} samples pending (samples {shown}{first}). A judge or sandbox that "
            "stopped answering? Raise data.reward_timeout_s if the function is only slow"
        ) from None
    except SampleFailed as e:  # the function's own traceback is chained below
        cause, i = e.__cause__, e.index
        raise RewardError(
            f"{where}: reward function {name} raised {type(cause).__name__} for sample {i} "
            f"(prompt {prompts[i][:60]!r}): {cause}"
        ) from cause
    except Exception as e:
        raise RewardError(f"{where}: reward function {name} raised {type(e).__name__}: {e}") from e
    return check_values(rewards, len(responses), f"{where}: reward function {name}", prompts)


def check_values(rewards, count: int, who: str, prompts: list[str]) -> list[float]:
    """`rewards` as floats: one finite real number per sample, else RewardError naming `who`, the sample and value."""
    try:
        got = len(rewards)
    except TypeError:
        raise RewardError(f"{who} returned {type(rewards).__name__}, not a list") from None
    if got != count:
        raise RewardError(f"{who} returned {got} rewards for {count} samples")
    out = []
    for i, r in enumerate(rewards):
        value = as_number(r)
        if value is None:
            raise RewardError(
                f"{who} returned {r!r} for sample {i} (prompt {prompts[i][:60]!r}); "
                "rewards must be finite real numbers (no NaN, inf, strings or None)"
            )
        out.append(value)
    return out


def as_number(r) -> float | None:
    """`r` as a float when it is one finite real number (a 0-d tensor or array too), else None."""
    value = r.item() if hasattr(r, "item") and getattr(r, "ndim", 1) == 0 else r
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return float(value)
