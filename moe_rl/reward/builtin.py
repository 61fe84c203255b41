"""The built-in rewards: the toy and arithmetic tasks' own, and the per-data_source dispatch of a file dataset with
no data.reward (`compute_score`, the shape of verl's default_compute_score): GSM8K's `#### answer` (verl's
gsm8k.py semantics), MATH-style boxed answers through math-verify, reasoning-gym's datasets by their own scorer."""

from __future__ import annotations

import re
from collections.abc import Callable

from moe_rl.reward.load import RewardLoadError, load_function

TOY_TARGET_IDS = range(2, 64)  # byte-level tokens of the tiny tokenizer; 0/1 are EOS/pad
TOY_HORIZON = 16

GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
MATH_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "math",
    "math_dapo",
    "math_dapo_reasoning",
)
MATH_PREFIXES = ("aime",)  # verl: data_source.startswith("aime")
REASONING_GYM_PREFIX = "reasoning_gym/"
REASONING_GYM_SCORER = "moe_rl.data.reasoning_gym:compute_score"
"""reasoning-gym rows are scored by the dataset's own score_answer behind this function (data.task=reasoning_gym)."""


def needs_answer(fn: Callable) -> Callable:
    """Mark a reward plugin as scoring against each prompt's reference answer (data.answer_key): the trainer
    refuses data with a prompt that has none before any engine starts."""
    fn.needs_answer = True
    return fn


def per_sample(fn: Callable) -> Callable:
    """Mark a reward plugin as per-sample, `fn(response: str, answer, response_ids: list[int]) -> float`
    (sync or async): it is called once per sample instead of once per batch."""
    fn.reward_per_sample = True
    return fn


def uses_sandbox(fn: Callable) -> Callable:
    """Mark a reward function as running programs in the sandbox (moe_rl/sandbox): the reward set configures the
    sandbox from data.sandbox and checks that it can run on this machine before the model is built."""
    fn.uses_sandbox = True
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


_GSM8K_CLIP_CHARS = 300  # verl matches on the last 300 characters only
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_score(solution_str: str, ground_truth) -> float:
    """verl's gsm8k.compute_score (method "strict"): 1.0 when the last `#### number` of the response's last 300
    characters, commas and `$` removed, equals the ground truth as a string; else 0.0 (no format score)."""
    found = _GSM8K_STRICT.findall(solution_str[-_GSM8K_CLIP_CHARS:])
    if not found:
        return 0.0
    return 1.0 if found[-1].replace(",", "").replace("$", "") == str(ground_truth) else 0.0


def knows(data_source: str) -> bool:
    """Whether `compute_score` has a reward for rows of `data_source`."""
    return (
        data_source in GSM8K_SOURCES
        or data_source in MATH_SOURCES
        or data_source.startswith(MATH_PREFIXES)
        or data_source.startswith(REASONING_GYM_PREFIX)
    )


KNOWN = (
    f"{', '.join(GSM8K_SOURCES)} (#### answer); {', '.join(MATH_SOURCES)}, aime* (boxed answers, math-verify); "
    f"{REASONING_GYM_PREFIX}<dataset> (reasoning-gym's own scorer)"
)
"""The data sources the dispatch knows, as messages name them."""


@needs_answer
def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """The built-in reward of a row, chosen by its data_source as verl's default_compute_score does."""
    if data_source in GSM8K_SOURCES:
        return gsm8k_score(solution_str, ground_truth)
    if data_source in MATH_SOURCES or data_source.startswith(MATH_PREFIXES):
        # heavy: math-verify (sympy, antlr), imported on first use
        from moe_rl.reward.math_answer import compute_score as math_score

        return math_score(solution_str, ground_truth)
    if data_source.startswith(REASONING_GYM_PREFIX):
        return reasoning_gym_scorer()(data_source, solution_str, ground_truth, extra_info)
    raise NotImplementedError(f"no built-in reward for data_source {data_source!r}; known: {KNOWN}")


def reasoning_gym_scorer() -> Callable:
    """moe_rl.data.reasoning_gym:compute_score, loaded by its spec (the data part's; a clear error if absent)."""
    try:
        return load_function(REASONING_GYM_SCORER)
    except RewardLoadError as e:
        raise RuntimeError(
            f"rows with data_source {REASONING_GYM_PREFIX}* are scored by {REASONING_GYM_SCORER}, which is not "
            f"available ({e}); install moe-rl's `tasks` extra (reasoning-gym) or set data.reward"
        ) from e
