"""Reward plugins for end-to-end tests of bad rewards (selected with data.reward=tests.e2e.plugins:NAME)."""

from __future__ import annotations


def nan_reward(responses, answers, response_ids):
    """What a broken verifier returns: NaN for every sample."""
    return [float("nan")] * len(responses)


def never_returns(responses, answers, response_ids):
    """A judge that stopped answering: appends the time of its call to $MOE_RL_TEST_CALLED, then waits for ever."""
    import os
    import time

    with open(os.environ["MOE_RL_TEST_CALLED"], "a") as f:
        f.write(f"{time.time()}\n")
    while True:
        time.sleep(60)
