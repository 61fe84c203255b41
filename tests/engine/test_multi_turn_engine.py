"""The multi-turn agent loop on a real vLLM engine (prefix caching on, 32-token blocks): environments that raise,
overrun their timeout or overflow the context end their trajectory with a counted reason, never the call; the
batch's masks, log-probs, turn tags and routes line up with the trajectories."""

from __future__ import annotations

import time

import numpy as np
import pytest

from moe_rl.data.prompts import Prompt
from moe_rl.rollout.config import SamplingConfig
from moe_rl.rollout.multi_turn.config import MultiTurnConfig
from moe_rl.rollout.multi_turn.environment import EnvSample, StepResult, Turn
from moe_rl.rollout.multi_turn.loop import AgentLoop
from tests.engine.conftest import start_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

ENV = "tests.engine.test_multi_turn_engine:"


class Flaky:
    """Sample 1 raises in step, sample 2 sleeps past the timeout, sample 3 answers with a 100-token observation
    (the context limit ends it), the others observe 3 tokens; every step that returns scores 1."""

    def reset(self, sample: EnvSample) -> None:
        self.kind = sample.sample_index

    def step(self, turn: Turn) -> StepResult:
        if self.kind == 1:
            raise ValueError("tool crashed")
        if self.kind == 2:
            time.sleep(3)
        if self.kind == 3:
            return StepResult(observation=[70] * 100, reward=1.0)
        return StepResult(observation=[70, 71, 72], reward=1.0)


class Broken:
    def reset(self, sample: EnvSample) -> None:
        raise RuntimeError("no sandbox")

    def step(self, turn: Turn) -> StepResult:
        return StepResult()


@pytest.fixture(scope="module")
def engine(tiny_models):
    e = start_engine(tiny_models["qwen3_moe"], multi_turn=MultiTurnConfig(env="toy"), block_size=32)
    yield e
    e.shutdown()


def _prompts(tokenizer, n: int = 2) -> list[Prompt]:
    texts = ["count the numbers one two three", "experts route tokens to a few experts"][:n]
    return [Prompt(t, answer="1", ids=tokenizer(t)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def tok(tiny_models):
    # imported here, not at collection: transformers imports triton, which must come after tests/kernels sets
    # TRITON_INTERPRET=1
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["qwen3_moe"])


def test_failures_end_their_trajectory_with_a_counted_reason(engine, tok):
    prompts = _prompts(tok)
    longest = max(len(p.ids) for p in prompts)
    limit = longest + 3 * 16 + 2 * 3  # room for 3 turns with 3-token observations, not for 100 tokens
    cfg = MultiTurnConfig(
        env=ENV + "Flaky", max_turns=3, env_timeout_s=1.0, max_observation_tokens=128, max_context_tokens=limit
    )
    batch = AgentLoop(engine, cfg, tok, context_limit=4096)(prompts, SamplingConfig(n=5, max_tokens=16, seed=3))
    assert len(batch) == 10 and list(batch.sample_index) == [0, 1, 2, 3, 4] * 2
    ends = {k[6:]: v.tolist() for k, v in batch.info.items() if k.startswith("ended_")}
    assert ends["env_error"] == [0, 1, 0, 0, 0] * 2
    assert ends["env_timeout"] == [0, 0, 1, 0, 0] * 2
    assert ends["context_limit"] == [0, 0, 0, 1, 0] * 2  # its observation does not fit after turn 1
    assert ends["max_turns"] == [1, 0, 0, 0, 1] * 2
    assert batch.info["turns"].tolist() == [3, 1, 1, 1, 3] * 2
    assert batch.rewards.tolist() == [3, 0, 0, 1, 3] * 2
    for i in range(len(batch)):
        mask, turns, logps = batch.response_masks[i], batch.turn_index[i], batch.rollout_logprobs[i]
        assert len(mask) == len(turns) == len(logps) == len(batch.response_ids[i])
        np.testing.assert_array_equal(mask == 1, turns >= 0)
        assert (logps[turns < 0] == 0).all() and (logps[turns >= 0] <= 0).all()
        obs = np.asarray(batch.response_ids[i])[turns < 0]
        assert obs.tolist() == [70, 71, 72] * int(batch.info["turns"][i] - 1)  # appended verbatim between turns
        assert turns.max() == batch.info["turns"][i] - 1
        t = len(batch.prompt_ids[i]) + len(batch.response_ids[i])
        assert batch.routes[i].shape == (t, len(engine.moe_layers), engine.topk)
        assert t <= cfg.max_context_tokens
    assert batch.info["cached_tokens"].sum() > 0  # later turns reused earlier turns' blocks


def test_a_step_where_every_environment_fails_is_an_error(engine, tok):
    loop = AgentLoop(engine, MultiTurnConfig(env=ENV + "Broken"), tok, context_limit=4096)
    with pytest.raises(
        RuntimeError, match=r"every trajectory's environment failed.*reset raised RuntimeError\('no sandbox'\)"
    ):
        loop(_prompts(tok, 1), SamplingConfig(n=2, max_tokens=4, seed=0))
