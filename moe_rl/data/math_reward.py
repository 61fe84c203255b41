"""Where the math-answer reward used to live (moe_rl/reward/math_answer.py now): its names keep importing."""

from __future__ import annotations

from moe_rl.reward.math_answer import final_answer, last_boxed, math_answer_reward

__all__ = ["final_answer", "last_boxed", "math_answer_reward"]
