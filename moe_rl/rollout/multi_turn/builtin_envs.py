"""Built-in environments (`rollout.multi_turn.env`): toy, math_retry and calculator; `env_class` resolves the
setting (a built-in or `module:Class`)."""

from __future__ import annotations

import ast
import importlib
import json
import operator
import re

import numpy as np

from moe_rl.data.rewards import TOY_TARGET_IDS, numeric_answer_reward, toy_low_token_reward
from moe_rl.rollout.multi_turn.config import BUILTIN_ENVS
from moe_rl.rollout.multi_turn.environment import EnvSample, StepResult, Turn


class ToyEnv:
    """The toy reward (data/rewards.py:toy_low_token_reward) on every model turn, divided by max_turns so a
    trajectory scores in [0, 1], with 4 random tokens (outside the rewarded ids) as the observation between
    turns: learnable by the tiny random model on CPU, and it exercises every multi-turn path."""

    OBSERVATION_TOKENS = 4

    def reset(self, sample: EnvSample) -> None:
        self.max_turns = sample.max_turns
        self.rng = np.random.default_rng(sample.seed)
        self.low = max(TOY_TARGET_IDS) + 1
        self.high = max(self.low + 1, min(len(sample.tokenizer), 256))

    def step(self, turn: Turn) -> StepResult:
        reward = toy_low_token_reward([turn.text], [None], [turn.token_ids])[0] / self.max_turns
        if turn.index + 1 >= self.max_turns:
            return StepResult(reward=reward, done=True)
        observation = self.rng.integers(self.low, self.high, self.OBSERVATION_TOKENS).tolist()
        return StepResult(observation=observation, reward=reward)


class MathRetryEnv:
    """A math problem with feedback and retries (after AReaL's multi-turn math workflow): a right final
    number ends the trajectory with reward `discount ** turn`; a wrong one gets "wrong, try again"; the last
    turn's wrong answer scores 0. The prompt row's answer is the reference (data.answer_key)."""

    discount = 0.5
    FEEDBACK = "Your answer is wrong. Try again."
    needs_answer = True  # every prompt's reference answer (checked before any engine starts)

    def reset(self, sample: EnvSample) -> None:
        if sample.answer is None:
            raise ValueError("math_retry needs a reference answer for every prompt (data.answer_key)")
        self.answer, self.max_turns = sample.answer, sample.max_turns

    def step(self, turn: Turn) -> StepResult:
        if numeric_answer_reward([turn.text], [self.answer], [turn.token_ids])[0] == 1.0:
            return StepResult(reward=self.discount**turn.index, done=True)
        if turn.index + 1 >= self.max_turns:
            return StepResult(done=True)
        return StepResult(observation=self.FEEDBACK)


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def calculate(expression: str) -> float:
    """Evaluate arithmetic (numbers, + - * / // % **, parentheses, unary minus); ValueError otherwise."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        return ev(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError, OverflowError) as e:
        raise ValueError(str(e)) from None


def parse_tool_call(text: str) -> str | None:
    """The expression of the turn's first `<tool_call>...</tool_call>`, or None without one. The call is a JSON
    object `{"name": "calculator", "arguments": {"expression": "12 * 7"}}` (the Hermes/Qwen tool-call format
    chat templates render) or the bare expression."""
    m = _TOOL_CALL.search(text)
    if m is None:
        return None
    body = m.group(1).strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return body
    if isinstance(call, dict):
        args = call.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return args
        if isinstance(args, dict) and "expression" in args:
            return str(args["expression"])
    return body


class CalculatorEnv:
    """A calculator tool (after verl's GSM8K tool agent): a turn with a `<tool_call>` gets the result as a `tool`
    message (`<tool_response>...</tool_response>`); a turn with `####` is the final answer, scored 1/0 against the
    reference (numeric_answer_reward); a turn with neither is reminded how to do either. The last turn is scored
    as the answer whatever it holds."""

    REMINDER = "Call the calculator as <tool_call>expression</tool_call>, or give the final answer after ####."
    needs_answer = True  # every prompt's reference answer (checked before any engine starts)

    def reset(self, sample: EnvSample) -> None:
        if sample.answer is None:
            raise ValueError("calculator needs a reference answer for every prompt (data.answer_key)")
        self.answer, self.max_turns = sample.answer, sample.max_turns
        self.calls = 0

    def step(self, turn: Turn) -> StepResult:
        expression = parse_tool_call(turn.text)
        if turn.index + 1 >= self.max_turns or (expression is None and "####" in turn.text):
            score = numeric_answer_reward([turn.text], [self.answer], [turn.token_ids])[0]
            return StepResult(reward=score, done=True, info={"tool_calls": self.calls})
        if expression is None:
            return StepResult(observation=self.REMINDER)
        self.calls += 1
        try:
            value = calculate(expression)
            result = str(int(value)) if float(value).is_integer() else f"{value:.6g}"
        except ValueError as e:
            result = f"error: {e}"
        return StepResult(observation=f"<tool_response>{result}</tool_response>", role="tool")


def env_class(spec: str) -> type:
    """The environment class `rollout.multi_turn.env` names: a built-in or `module:Class`."""
    builtin = dict(zip(BUILTIN_ENVS, (ToyEnv, MathRetryEnv, CalculatorEnv), strict=True))
    if spec in builtin:
        return builtin[spec]
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"rollout.multi_turn.env={spec!r}: choose none, {', '.join(BUILTIN_ENVS)} or module:Class")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.multi_turn.env={spec!r}: cannot load it ({e})") from e
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"rollout.multi_turn.env={spec!r}: {cls.__name__} has no {' or '.join(missing)} method")
    return cls
