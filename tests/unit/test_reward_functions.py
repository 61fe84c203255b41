"""Reward functions users already write (moe_rl/reward): the three forms told from their signatures, the calls each
receives (recorded), weights, dicts and None, file-path loading and the errors of a bad spec or value."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.reward import RewardSet, Sample, combine
from moe_rl.reward.builtin import compute_score, gsm8k_score, per_sample
from moe_rl.reward.inprocess import RewardError
from moe_rl.reward.load import Kind, RewardLoadError, load

FILES = Path(__file__).parent / "reward_files"
VERL = f"{FILES / 'verl_reward.py'}:compute_score"
CALLS: list = []  # what the in-process functions of this module received


def _data(reward, **keys) -> SimpleNamespace:
    specs = reward if isinstance(reward, list) else [reward]
    base = dict(reward=reward, reward_specs=specs, reward_weights=None, reward_workers=2, reward_call_timeout_s=30.0)
    base |= dict(reward_timeout_score=0.0, reward_error_score=None, reward_timeout_s=0.0)
    return SimpleNamespace(**(base | keys))


def _sample(i: int, response: str, answer="7", source="openai/gsm8k", chat=True) -> Sample:
    messages = [{"role": "user", "content": f"question {i}"}]
    row = {"data_source": source, "prompt": messages if chat else f"question {i}", "ability": "math"}
    row |= {"reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": "train", "index": i}}
    text, messages = f"<user>question {i}", messages if chat else None
    return Sample(text, messages, response, [i, 5], answer, source, row, f"f:row {i}")


# ---- the forms, told from the signature without calling the function ----


def trl_reward(prompts, completions, completion_ids, **kwargs):
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **kwargs})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if t == "skip" else float(len(t)) for t in texts]


def trl_completions_only(completions, **kwargs):
    return [1.0] * len(completions)


def moe_batched(responses, answers, response_ids, samples=None):
    CALLS.append(samples)
    return [float(r == a) for r, a in zip(responses, answers, strict=True)]


@per_sample
def moe_per_sample(response, answer, response_ids):
    return float(len(response_ids))


@per_sample
async def moe_async_per_sample(response, answer, response_ids, sample=None):
    CALLS.append(sample)
    return 0.5


def two_args(a, b):
    return [0.0]


@pytest.mark.parametrize(
    "name,kind,pool",
    [
        ("trl_reward", Kind.trl, False),
        ("trl_completions_only", Kind.trl, False),
        ("moe_batched", Kind.batched, False),
        ("moe_per_sample", Kind.per_sample, True),
        ("moe_async_per_sample", Kind.per_sample, False),
    ],
)
def test_the_form_is_told_from_the_signature(name, kind, pool):
    CALLS.clear()
    rf = load(f"{__name__}:{name}")
    assert (rf.kind, rf.in_pool) == (kind, pool)
    assert not CALLS  # never called to find out


def test_verl_file_and_builtins_forms():
    assert load(VERL).kind is Kind.verl and load(VERL).in_pool
    assert load("moe_rl.reward.builtin:compute_score").kind is Kind.verl
    assert load("moe_rl.data.rewards:numeric_answer_reward").kind is Kind.batched
    assert load("moe_rl.data.rewards:math_answer_reward").kind is Kind.batched


def test_a_signature_of_no_form_is_refused_showing_the_three():
    with pytest.raises(RewardLoadError, match=r"matches none of the reward forms(.|\n)*verl:(.|\n)*TRL:(.|\n)*moe-rl:"):
        load(f"{__name__}:two_args")
    with pytest.raises(RewardLoadError, match="matches none"):
        load(f"{FILES / 'verl_reward.py'}:not_a_reward")


def test_a_missing_file_or_function_is_named():
    with pytest.raises(RewardLoadError, match=r"reward file .*/nope\.py does not exist"):
        load("nope.py:compute_score")
    with pytest.raises(RewardLoadError, match=r"verl_reward\.py has no function 'missing'"):
        load(f"{FILES / 'verl_reward.py'}:missing")
    with pytest.raises(ConfigError, match="config data.reward: .*no function 'missing'"):
        RewardSet.from_config(_data(f"{FILES / 'verl_reward.py'}:missing"))


# ---- the calls each form receives ----


def test_verl_calls_receive_the_rows_data_source_ground_truth_and_extra_info(tmp_path, monkeypatch):
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("MOE_RL_TEST_CALLS", str(calls))  # the worker processes inherit it
    samples = [_sample(0, "so 7", "7"), _sample(1, "so 8", "9", source="my/src")]
    with RewardSet.from_config(_data(VERL)) as rewards:
        scores = rewards.score(samples, step=1)
    got = sorted(json.loads(line)[:4] for line in calls.read_text().splitlines())
    assert got == [
        ["my/src", "so 8", "9", {"split": "train", "index": 1}],
        ["openai/gsm8k", "so 7", "7", {"split": "train", "index": 0}],
    ]
    assert scores.rewards == [1.0, 0.0]
    m = scores.metrics
    assert m["reward/compute_score/mean"] == 0.5 and m["reward/compute_score/acc"] == 0.5  # the dict's extra
    assert "reward/compute_score/pred" not in m  # a string extra is no metric
    assert m["reward/openai/gsm8k/mean"] == 1.0 and m["reward/my/src/mean"] == 0.0
    assert m["reward/timeouts"] == 0 and m["reward/errors"] == 0


def test_trl_calls_get_what_grpo_trainer_passes():
    CALLS.clear()
    samples = [_sample(0, "abc"), _sample(1, "skip"), _sample(2, "de", chat=False)]
    with RewardSet.from_config(_data(f"{__name__}:trl_reward")) as rewards:
        with pytest.raises(RewardError, match=r"no reward function scored sample 1 \(f:row 1, data_source"):
            rewards.score(samples, step=4)
        (call,) = CALLS
        assert call["prompts"] == [samples[0].row["prompt"], samples[1].row["prompt"], "question 2"]
        assert call["completions"][0] == [{"role": "assistant", "content": "abc"}] and call["completions"][2] == "de"
        assert call["completion_ids"] == [[0, 5], [1, 5], [2, 5]]
        assert call["data_source"] == ["openai/gsm8k"] * 3 and call["ability"] == ["math"] * 3
        assert call["extra_info"][2] == {"split": "train", "index": 2}
        assert "prompt" not in call and call["trainer_state"].global_step == 4
        assert callable(call["log_metric"]) and callable(call["log_extra"])


def test_weights_none_and_several_functions():
    """TRL's rule: the weighted sum over the functions that scored the sample (None: not scored)."""
    specs = [f"{__name__}:trl_reward", f"{__name__}:moe_batched", f"{__name__}:moe_batched"]
    samples = [_sample(0, "7"), _sample(1, "skip", answer="skip")]
    with RewardSet.from_config(_data(specs, reward_weights=[0.5, 2.0, 1.0])) as rewards:
        scores = rewards.score(samples, step=1)
        assert [line.split(":")[0] for line in rewards.describe()] == [
            "reward trl_reward",
            "reward moe_batched",
            "reward moe_batched_2",
        ]
    assert scores.rewards == [0.5 * 1 + 2.0 * 1 + 1.0 * 1, 2.0 + 1.0]
    m = scores.metrics
    assert m["reward/trl_reward/mean"] == 1.0  # one sample scored
    assert m["reward/moe_batched/mean"] == m["reward/moe_batched_2/mean"] == 1.0


def test_moe_forms_see_the_samples_and_async_per_sample_runs_in_process():
    CALLS.clear()
    samples = [_sample(0, "7"), _sample(1, "x")]
    with RewardSet.from_config(_data([f"{__name__}:moe_batched", f"{__name__}:moe_async_per_sample"])) as rewards:
        assert rewards.score(samples, step=1).rewards == [1.5, 0.5]
        assert rewards.pool is None  # nothing synchronous per sample: no worker process
    assert CALLS[0] == samples and CALLS[1:] == samples


def test_errors_name_the_sample_and_row_or_score_as_configured():
    samples = [_sample(0, "7"), _sample(1, "raise")]
    with RewardSet.from_config(_data(VERL)) as rewards:
        named = r"raised KeyError for sample 1 \(f:row 1, .*'ground_truth': '7'.*broken verifier"
        with pytest.raises(RewardError, match=named):
            rewards.score(samples, step=2)
    with RewardSet.from_config(_data(VERL, reward_error_score=-1.0)) as rewards:
        scores = rewards.score(samples, step=2)
    assert scores.rewards == [1.0, -1.0] and scores.metrics["reward/errors"] == 1


def test_bad_values_and_config_are_refused():
    with pytest.raises(ConfigError, match="data.reward_weights: 1 weights for 2"):
        RewardSet.from_config(_data([VERL, VERL], reward_weights=[1.0]))
    nan = SimpleNamespace(spec="x:f", fn=None)
    with RewardSet.from_config(_data(f"{__name__}:moe_batched")) as rewards:
        rewards.functions[0] = load(f"{__name__}:nan_reward")
        with pytest.raises(RewardError, match=r"returned nan for sample 0 \(f:row 0"):
            rewards.score([_sample(0, "7")], step=1)
    assert nan.fn is None


def nan_reward(responses, answers, response_ids):
    return [float("nan")] * len(responses)


def test_metrics_combine_over_ranks_with_different_data_sources():
    a = ({"reward/f/mean": [1.0, 2.0], "reward/gsm8k/mean": [1.0, 2.0]}, {"reward/timeouts": 1.0})
    b = ({"reward/f/mean": [3.0, 2.0], "reward/math/mean": [0.0, 2.0]}, {"reward/timeouts": 0.0})
    assert combine([a, b]) == {
        "reward/f/mean": 1.0,
        "reward/gsm8k/mean": 0.5,
        "reward/math/mean": 0.0,
        "reward/timeouts": 1.0,
    }


# ---- the built-ins ----


@pytest.mark.parametrize(
    "text,truth,want",
    [  # verl's gsm8k.py, method strict: the last '#### number' of the last 300 characters, ',' and '$' removed
        ("so #### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### 72.0", "72", 0.0),  # a string compare, as verl's
        ("the answer is 72", "72", 0.0),  # no '####': no answer (strict)
        ("#### 5 then #### 72", "72", 1.0),
        ("#### 72" + " pad" * 100, "72", 0.0),  # beyond the last 300 characters
    ],
)
def test_gsm8k_builtin_follows_verl(text, truth, want):
    assert gsm8k_score(text, truth) == want
    assert compute_score("openai/gsm8k", text, truth) == want


def test_builtin_dispatch_math_and_unknown_sources():
    assert compute_score("HuggingFaceH4/MATH-500", r"so \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert compute_score("aime_2024", r"\boxed{3}", "4") == 0.0
    with pytest.raises(NotImplementedError, match="no built-in reward for data_source 'who/knows'"):
        compute_score("who/knows", "1", "1")


def test_check_prompts_refuses_a_source_no_builtin_knows():
    p = [SimpleNamespace(data_source="openai/gsm8k", answer="1", source="t.parquet:row 0")]
    p.append(SimpleNamespace(data_source="", answer="1", source="t.parquet:row 1"))
    rewards = RewardSet.from_config(_data("moe_rl.reward.builtin:compute_score"))
    with pytest.raises(ConfigError, match=r"t.parquet:row 1 \(data.path\): data_source none \(no data_source column\)"):
        rewards.check_prompts(p, "data.path")
    rewards.check_prompts(p[:1], "data.path")
    p[0].answer = None
    with pytest.raises(ConfigError, match="row 0 .*has no answer"):
        rewards.check_prompts(p[:1], "data.path")
