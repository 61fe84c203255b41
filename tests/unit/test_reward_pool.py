"""The worker processes of synchronous per-sample rewards (moe_rl/reward/pool.py): a call that never returns costs
its own time limit only, scores data.reward_timeout_score and is counted; math-verify's own timeout works in a worker
(calls run on its main thread); no reward process outlives close()."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import psutil

from moe_rl.reward import RewardSet, Sample

VERL = f"{Path(__file__).parent / 'reward_files' / 'verl_reward.py'}:compute_score"
# math-verify spends its whole own 5 s limit on this answer (then scores 0; measured: 5.2 s) where a boxed number
# takes milliseconds: an exponent tower sympy tries to evaluate
TOWER = r"so \boxed{9^{9^{9^{9}}}}"


def _data(reward: str, call_timeout_s: float) -> SimpleNamespace:
    return SimpleNamespace(
        reward=reward,
        reward_specs=[reward],
        reward_weights=None,
        reward_workers=2,
        reward_call_timeout_s=call_timeout_s,
        reward_timeout_score=-0.5,
        reward_error_score=None,
        reward_timeout_s=0.0,
    )


def _samples(bad: int, bad_response: str, source: str) -> list[Sample]:
    out = []
    for i in range(64):
        text = bad_response if i == bad else f"the answer is {i}"
        row = {"data_source": source, "extra_info": {"index": i}}
        out.append(Sample(f"q{i}", None, text, [1], str(i), source, row, f"t:row {i}"))
    return out


def _children() -> set[int]:
    """This process's descendants, less multiprocessing's resource tracker: one per process, shared by every user of
    multiprocessing (vLLM's too), exiting with the process; no reward runs in it."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _timed_score(rewards: RewardSet, samples: list[Sample]):
    rewards.score(samples[:2], step=0)  # the workers started (spawn + imports), as they are from the second step on
    start = time.monotonic()
    scores = rewards.score(samples, step=1)
    return scores, time.monotonic() - start


def test_a_call_that_never_returns_scores_the_timeout_value_and_leaves_no_process():
    before = _children()
    rewards = RewardSet.from_config(_data(VERL, call_timeout_s=5))
    try:
        scores, took = _timed_score(rewards, _samples(17, "hang", "my/source"))
        # the workers ran as processes of their own (one may be between the killed hung worker and its replacement)
        assert _children() - before
    finally:
        rewards.close()
    print(f"\n64 samples, one never returning: {took:.1f} s")
    assert 5 <= took < 15  # the others' scores take milliseconds: the batch waits the 5 s limit, not for ever
    assert scores.rewards[17] == -0.5 and scores.metrics["reward/timeouts"] == 1
    assert scores.rewards[:17] + scores.rewards[18:] == [1.0] * 63
    assert not (_children() - before), "reward worker processes left after close()"


def test_math_verify_keeps_its_own_timeout_in_a_worker_and_the_call_limit_cuts_it_shorter():
    before = _children()
    builtin = "moe_rl.reward.builtin:compute_score"
    with RewardSet.from_config(_data(builtin, call_timeout_s=30)) as rewards:
        own, took_own = _timed_score(rewards, _samples(5, TOWER, "HuggingFaceH4/MATH-500"))
    with RewardSet.from_config(_data(builtin, call_timeout_s=2)) as rewards:
        cut, took_cut = _timed_score(rewards, _samples(5, TOWER, "HuggingFaceH4/MATH-500"))
    print(f"\nmath-verify's own limit: {took_own:.1f} s; data.reward_call_timeout_s=2: {took_cut:.1f} s")
    # on the worker's main thread math-verify's signal timeout fires (5 s) and the answer scores 0, not a timeout
    assert 4.5 <= took_own < 20 and own.rewards[5] == 0.0 and own.metrics["reward/timeouts"] == 0
    assert cut.rewards[5] == -0.5 and cut.metrics["reward/timeouts"] == 1 and 2 <= took_cut < took_own
    assert own.rewards[:5] + own.rewards[6:] == cut.rewards[:5] + cut.rewards[6:] == [1.0] * 63  # "the answer is 4"
    assert not (_children() - before)
