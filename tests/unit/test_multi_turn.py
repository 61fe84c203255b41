"""Multi-turn pieces without an engine: append-only route stitching, observation tokens, built-in environments,
the environment loader and the multi_turn config checks."""

from __future__ import annotations

import numpy as np
import pytest

from moe_rl.config import TrainConfig
from moe_rl.config.validate import validate
from moe_rl.models.tiny import build_tokenizer
from moe_rl.rollout.multi_turn.builtin_envs import (
    CalculatorEnv,
    MathRetryEnv,
    ToyEnv,
    calculate,
    env_class,
    parse_tool_call,
)
from moe_rl.rollout.multi_turn.environment import EnvSample, StepResult, Turn
from moe_rl.rollout.multi_turn.loop import ObservationEncoder
from moe_rl.rollout.multi_turn.routes import StitchedRoutes, check_append_only, expert_sets_differ
from moe_rl.routing.records import RouteError

L, K, E = 3, 2, 8


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def _rows(rng, n: int) -> np.ndarray:
    return np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(L)]) for _ in range(n)]).astype(np.uint8)


def _turns(rng, lengths=(10, 17, 25), cached=(0, 8, 16)):
    """Engine captures of three turns: turn k sees `lengths[k]` tokens (rows for lengths[k] - 1 positions) and
    computes every position from `cached[k]` on; a recomputed position keeps its expert set unless changed."""
    truth = _rows(rng, lengths[-1] - 1)
    out = []
    for n, c in zip(lengths, cached, strict=True):
        rows = np.zeros((n - 1, L, K), dtype=np.uint8)
        computed = np.zeros(n - 1, dtype=bool)
        rows[c:], computed[c:] = truth[c : n - 1], True
        out.append((rows, computed))
    return truth, out


def test_stitched_routes_are_append_only_and_count_recomputed_rows():
    rng = np.random.default_rng(0)
    truth, turns = _turns(rng)
    turns[1][0][8] = turns[1][0][8][:, ::-1]  # turn 1 recomputes position 8 (a partial block) in another slot order
    s = StitchedRoutes(L, K, np.uint8)
    for k, (rows, computed) in enumerate(turns):
        before = s.rows.copy()
        assert s.add_turn(rows, computed, rows.shape[0]) == []
        check_append_only(before, s.rows, "0", k)
    np.testing.assert_array_equal(s.rows, truth)  # position 8 keeps turn 0's row
    assert (s.computed, s.recomputed, s.recomputed_changed) == (9 + 8 + 8, 1, 0)


def test_recomputed_disagreement_counts_changed_expert_sets():
    rng = np.random.default_rng(1)
    truth, turns = _turns(rng, lengths=(10, 20), cached=(0, 0))  # no cache: turn 1 prefills everything again
    rows = turns[1][0]
    rows[2, 0] = np.array(sorted(set(range(E)) - set(truth[2, 0].tolist())))[:K]
    rows[5] = rows[5][:, ::-1]  # same sets, other slot order
    s = StitchedRoutes(L, K, np.uint8)
    for r, c in turns:
        s.add_turn(r, c, r.shape[0])
    assert (s.recomputed, s.recomputed_changed, s.computed) == (9, 1, 9 + 19)
    np.testing.assert_array_equal(s.rows[:9], truth[:9])  # turn 0's rows, not the later prefill's


def test_overwriting_earlier_turns_rows_is_caught():
    """verl keeps the route tensor of a trajectory's last turn, so a later prefill replaces the rows earlier
    turns sampled with (verl #5825). The per-turn check refuses such a record, naming sample, turn, position."""
    rng = np.random.default_rng(2)
    truth, turns = _turns(rng, lengths=(10, 20), cached=(0, 0))
    later = turns[1][0].copy()
    later[4] = np.array(sorted(set(range(E)) - set(truth[4, 0].tolist())))[:K]  # the weights changed in between
    s = StitchedRoutes(L, K, np.uint8)
    s.add_turn(*turns[0], 9)
    before = s.rows.copy()
    s.add_turn(later, turns[1][1], 19)
    check_append_only(before, s.rows, "3 (prompt 1, sample 1)", 1)  # append-only: passes
    assert s.recomputed_changed == 1
    verl_style = later  # the last turn's tensor as the trajectory's record
    with pytest.raises(RouteError, match=r"sample 3 \(prompt 1, sample 1\), turn 1: .*overwritten.*position 4"):
        check_append_only(before, verl_style, "3 (prompt 1, sample 1)", 1)


def test_positions_no_turn_computed_are_returned_as_gaps():
    rng = np.random.default_rng(3)
    _, turns = _turns(rng, lengths=(10, 20), cached=(0, 12))  # a cache hit reaching past what turn 0 recorded
    s = StitchedRoutes(L, K, np.uint8)
    s.add_turn(*turns[0], 9)
    assert s.add_turn(*turns[1], 19) == [9, 10, 11]
    with pytest.raises(RouteError, match="captured rows"):
        s.add_turn(turns[1][0][:5], turns[1][1][:5], 19)


def test_expert_sets_differ_ignores_slot_order():
    a = np.array([[[1, 2], [3, 4]]])
    assert not expert_sets_differ(a, a[..., ::-1]).any()
    assert expert_sets_differ(a, np.array([[[1, 2], [3, 5]]])).all()


def test_observation_tokens_follow_the_chat_template(tokenizer):
    enc = ObservationEncoder(tokenizer, max_tokens=64)
    ids, cut = enc("wrong, try again", "user", after_eos=False)
    assert tokenizer.decode(ids) == "\n<|user|>\nwrong, try again\n<|assistant|>\n" and not cut
    ids, _ = enc("42", "tool", after_eos=True)  # the tiny template's end of turn is "\n", not the EOS text
    assert tokenizer.decode(ids) == "\n<|tool|>\n42\n<|assistant|>\n"
    # what the template renders for the whole conversation is the turns plus these observation tokens
    history = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    full = tokenizer.apply_chat_template([*history, {"role": "user", "content": "x y"}], tokenize=False)
    assert full + "<|assistant|>\n" == tokenizer.apply_chat_template(history, tokenize=False)[:-1] + tokenizer.decode(
        enc("x y", "user", after_eos=False)[0]
    )
    limit = len(enc("", "user", False)[0]) + 5  # the markers and about 5 tokens of content
    long, cut = ObservationEncoder(tokenizer, limit)("one two three four five six seven eight nine", "user", False)
    text = tokenizer.decode(long)
    assert cut and len(long) <= limit and text.startswith("\n<|user|>\none") and text.endswith("\n<|assistant|>\n")
    assert enc([5, 6, 7], "user", False) == ([5, 6, 7], False)
    assert ObservationEncoder(tokenizer, 2)([5, 6, 7], "user", False) == ([5, 6], True)
    with pytest.raises(ValueError, match="max_observation_tokens=3"):
        ObservationEncoder(tokenizer, 3)("hello", "user", False)


def test_chatml_end_of_turn_is_not_doubled_after_eos(tokenizer):
    """ChatML (Qwen) closes an assistant turn with <|im_end|>, which is also the EOS the model samples."""
    tok = build_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>", "<|im_start|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    enc = ObservationEncoder(tok, 64)
    after_eos = tok.decode(enc("hi", "user", after_eos=True)[0])
    assert after_eos == "\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(enc("hi", "user", after_eos=False)[0]) == "<|im_end|>" + after_eos


def _sample(tokenizer, answer=None, max_turns=3, seed=0):
    return EnvSample("prompt", answer, 0, 0, seed, max_turns, tokenizer)


def test_toy_env_scores_each_turn_and_observes_unrewarded_tokens(tokenizer):
    env = ToyEnv()
    env.reset(_sample(tokenizer))
    r0 = env.step(Turn("", [2, 3, 100, 4], 0, "length"))
    assert r0.reward == pytest.approx(3 / 16 / 3) and not r0.done
    assert len(r0.observation) == 4 and all(64 <= t < 256 for t in r0.observation)
    r1 = env.step(Turn("", list(range(2, 40)), 1, "length"))
    assert r1.reward == pytest.approx(1 / 3) and not r1.done
    last = env.step(Turn("", [300], 2, "stop"))
    assert last.done and last.observation is None and last.reward == 0
    again = ToyEnv()
    again.reset(_sample(tokenizer))
    assert again.step(Turn("", [], 0, "stop")).observation == r0.observation  # seeded per trajectory


def test_math_retry_rewards_are_discounted_per_turn(tokenizer):
    env = MathRetryEnv()
    env.reset(_sample(tokenizer, answer="42"))
    wrong = env.step(Turn("I think 41", [], 0, "stop"))
    assert (wrong.reward, wrong.done, wrong.observation) == (0.0, False, MathRetryEnv.FEEDBACK)
    right = env.step(Turn("so #### 42", [], 1, "stop"))
    assert (right.reward, right.done) == (0.5, True)
    env.reset(_sample(tokenizer, answer="7", max_turns=2))
    assert env.step(Turn("7", [], 0, "stop")).reward == 1.0
    env.reset(_sample(tokenizer, answer="7", max_turns=2))
    env.step(Turn("8", [], 0, "stop"))
    assert env.step(Turn("9", [], 1, "stop")) == StepResult(done=True)
    with pytest.raises(ValueError, match="reference answer"):
        env.reset(_sample(tokenizer, answer=None))


def test_calculator_parses_tool_calls_and_scores_the_final_answer(tokenizer):
    assert (
        parse_tool_call('x <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>') == "6*7"
    )
    assert parse_tool_call(
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    ) == ("1+1")
    assert parse_tool_call("<tool_call> 12 / 4 </tool_call> then") == "12 / 4"
    assert parse_tool_call("no call here") is None
    assert calculate("(2 + 3) * -4 ** 2 // 3") == (2 + 3) * -(4**2) // 3
    for bad in ("__import__('os')", "2 ** 1000", "1 / 0", "x + 1", "1 +"):
        with pytest.raises(ValueError):
            calculate(bad)
    env = CalculatorEnv()
    env.reset(_sample(tokenizer, answer="84"))
    call = env.step(Turn("<tool_call>12*7</tool_call>", [], 0, "stop"))
    assert (call.observation, call.role, call.done, call.reward) == (
        "<tool_response>84</tool_response>",
        "tool",
        False,
        0,
    )
    err = env.step(Turn("<tool_call>12*</tool_call>", [], 1, "stop"))
    assert err.observation.startswith("<tool_response>error:")
    reminder = env.step(Turn("hmm 12", [], 1, "stop"))  # neither a call nor a final answer
    assert (reminder.observation, reminder.role, reminder.done) == (CalculatorEnv.REMINDER, "user", False)
    final = env.step(Turn("The answer is 84", [], 2, "stop"))  # the last turn: scored as the answer
    assert (final.reward, final.done, final.info) == (1.0, True, {"tool_calls": 2})
    env.reset(_sample(tokenizer, answer="84"))
    assert env.step(Turn("so #### 85", [], 0, "stop")) == StepResult(done=True, info={"tool_calls": 0})
    env.reset(_sample(tokenizer, answer="84", max_turns=1))
    assert env.step(Turn("<tool_call>12*7</tool_call>", [], 0, "length")) == StepResult(
        done=True, info={"tool_calls": 0}
    )


class NoStep:
    def reset(self, sample):
        pass


def test_env_loader_and_config_checks():
    assert env_class("toy") is ToyEnv
    assert env_class("moe_rl.rollout.multi_turn.builtin_envs:CalculatorEnv") is CalculatorEnv
    with pytest.raises(ValueError, match="has no step method"):
        env_class("tests.unit.test_multi_turn:NoStep")
    with pytest.raises(ValueError, match="cannot load"):
        env_class("no_such_module:Env")
    cfg = TrainConfig()
    cfg.rollout.multi_turn.env = "maths"
    with pytest.raises(ValueError, match=r"config rollout.multi_turn.env: .*choose none, toy, math_retry, calculator"):
        validate(cfg, 2)
    for key, value, match in [
        ("max_turns", 0, "max_turns"),
        ("env_timeout_s", 0.0, "env_timeout_s"),
        ("missing_routes", "skip", "missing_routes"),
    ]:
        cfg = TrainConfig()
        cfg.rollout.multi_turn.env = "toy"
        setattr(cfg.rollout.multi_turn, key, value)
        with pytest.raises(ValueError, match=f"config rollout.multi_turn.{match}"):
            validate(cfg, 2)
    cfg = TrainConfig()
    cfg.rollout.multi_turn.env = "toy"
    cfg.buffer.enable = True
    with pytest.raises(ValueError, match="do not combine with buffer.enable"):
        validate(cfg, 2)
    cfg.buffer.enable = False
    validate(cfg, 2)


def test_padded_batch_trains_only_the_sampled_tokens_of_a_fixed_trajectory():
    """prompt [5, 6] | turn 0 samples [7, 8] | observation [9] | turn 1 samples [10]: the loss mask is 1 on 7, 8
    and 10, mu sits at those positions, and a split by prompt keeps the multi-turn fields with their samples."""
    from moe_rl.common.batch import RolloutBatch

    lp = np.array([-0.5, -0.25, 0.0, -1.0], dtype=np.float32)
    routes = np.zeros((6, L, K), dtype=np.uint8)
    batch = RolloutBatch(
        [[5, 6], [5, 6]],
        [[7, 8, 9, 10], [11]],
        [lp, np.array([-2.0], dtype=np.float32)],
        ["stop", "length"],
        np.array([0, 1]),
        np.array([0, 0]),
        [routes, routes[:3]],
        [0, 1, 2],
        E,
        K,
        response_masks=[np.array([1, 1, 0, 1], dtype=np.float32), np.array([1], dtype=np.float32)],
        turn_index=[np.array([0, 0, -1, 1]), np.array([0])],
        rewards=np.array([0.5, 1.0], dtype=np.float32),
        info={"turns": np.array([2.0, 1.0])},
    )
    p = batch.to_padded(pad_id=0)
    assert p.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1], [0, 0, 1, 0, 0, 0]]
    assert p.rollout_logprobs[0].tolist() == [0, 0, -0.5, -0.25, 0, -1.0]
    second = batch.split_by_prompt(1)[1]
    assert second.response_masks[0].tolist() == [1] and second.turn_index[0].tolist() == [0]
    assert second.rewards.tolist() == [1.0] and second.info["turns"].tolist() == [1.0]
