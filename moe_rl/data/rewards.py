"""Where moe-rl's reward functions used to live: the names user configs give (`data.reward=moe_rl.data.rewards:...`)
and code imports keep working. The rewards themselves are in moe_rl/reward/ (docs/guides/reward-functions.md)."""

from __future__ import annotations

from moe_rl.reward.builtin import (
    TOY_HORIZON,
    TOY_TARGET_IDS,
    needs_answer,
    numeric_answer_reward,
    per_sample,
    toy_low_token_reward,
)
from moe_rl.reward.inprocess import RewardError, RewardFn, load_reward, score

__all__ = [  # noqa: F822 -- math_answer_reward comes from __getattr__
    "TOY_HORIZON",
    "TOY_TARGET_IDS",
    "RewardError",
    "RewardFn",
    "load_reward",
    "math_answer_reward",
    "needs_answer",
    "numeric_answer_reward",
    "per_sample",
    "score",
    "toy_low_token_reward",
]


def __getattr__(name: str):
    # `math_answer_reward` is imported on first use: math-verify (sympy, antlr) takes ~1 s to import.
    if name == "math_answer_reward":
        # heavy: math-verify, imported on first use
        from moe_rl.reward.math_answer import math_answer_reward

        return math_answer_reward
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
