"""Reward functions: `fn(responses: list[str], answers: list[str | None], response_ids: list[list[int]])
-> list[float]`, selected by `data.reward = "module:function"`."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

RewardFn = Callable[[list[str], list, list[list[int]]], list[float]]

TOY_TARGET_IDS = range(2, 64)  # byte-level tokens of the tiny tokenizer; 0/1 are EOS/pad
TOY_HORIZON = 16


def toy_low_token_reward(responses: list[str], answers: list, response_ids: list[list[int]]) -> list[float]:
    """Toy task: (number of response tokens with id in [2, 64)) / 16, capped at 1.

    About 1/8 of the tiny vocabulary qualifies, so a random tiny model scores ~0.15 on 24-token
    responses; the policy learns to prefer those tokens within minutes. Special tokens never
    count and the fixed horizon rewards long on-target responses, so stopping early does not pay.
    """
    return [min(sum(t in TOY_TARGET_IDS for t in ids) / TOY_HORIZON, 1.0) for ids in response_ids]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


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


def load_reward(spec: str) -> RewardFn:
    """`module:function` -> the function (clear error when missing)."""
    if ":" not in spec:
        raise ValueError(f"data.reward={spec!r} must look like 'module:function'")
    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"data.reward={spec!r} cannot be loaded: {e}") from e
    return fn
