"""The environment interface of multi-turn rollouts (`rollout.multi_turn.env`; builtin_envs.env_class loads one).

An environment is a class built with no arguments, one instance per trajectory:

    from moe_rl.rollout.multi_turn.environment import EnvSample, StepResult, Turn

    class Countdown:
        '''Ask the model for a number; tell it "higher"/"lower" until it finds it (reward 1, less per turn).'''

        def reset(self, sample: EnvSample) -> None:
            self.target = int(sample.answer)  # the prompt row's data.answer_key

        def step(self, turn: Turn) -> StepResult:
            numbers = [int(w) for w in turn.text.split() if w.lstrip("-").isdigit()]
            if numbers and numbers[-1] == self.target:
                return StepResult(reward=0.8**turn.index, done=True)
            hint = "no number found" if not numbers else ("higher" if numbers[-1] < self.target else "lower")
            return StepResult(observation=hint)  # rendered as a user message by the chat template

    # rollout.multi_turn.env=my_package.envs:Countdown

`step` gets each model turn as text and token ids; it returns the observation (text, rendered as a
`role` message by the tokenizer's chat template, or token ids appended as they are), the reward of this
turn (a trajectory's reward is the sum over its turns) and whether the trajectory is over. The loop ends
every trajectory after `rollout.multi_turn.max_turns` model turns. `reset` and `step` run on the engine's
rank, on a worker thread under `rollout.multi_turn.env_timeout_s`; an exception or a timeout ends that
trajectory (counted in multi_turn/ended_env_error, ended_env_timeout), not the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class EnvSample:
    """What an environment's `reset` gets: the trajectory's prompt and where it is in the step."""

    prompt: str  # the prompt text as the engine sees it (after the chat template, if applied)
    answer: Any  # the prompt row's reference answer (data.answer_key), None when the data has none
    prompt_index: int  # the prompt within this engine's batch
    sample_index: int  # the sample within the prompt's group (0 .. sampling.n - 1)
    seed: int  # for an environment's own randomness: differs per trajectory and step
    max_turns: int
    tokenizer: Any  # the model's tokenizer (for token-id observations)


@dataclass
class Turn:
    """One model turn, as `step` receives it."""

    text: str  # the turn's tokens decoded (special tokens dropped)
    token_ids: list[int]
    index: int  # 0-based
    finish_reason: str  # stop | length (sampling.max_tokens or the context limit)


@dataclass
class StepResult:
    observation: str | list[int] | None = None
    """Text (a chat message of `role`, rendered by the chat template) or token ids appended verbatim; None when
    the trajectory ends."""
    reward: float = 0.0
    """This turn's reward; the trajectory's reward is the sum over its turns."""
    done: bool = False
    role: str = "user"
    """The chat role of a text observation (calculator results are `tool` messages)."""
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    """An environment class may also set `needs_answer = True`: it scores against each prompt's reference answer
    (data.answer_key), and the trainer refuses data with a prompt that has none before any engine starts."""

    def reset(self, sample: EnvSample) -> None: ...

    def step(self, turn: Turn) -> StepResult: ...
