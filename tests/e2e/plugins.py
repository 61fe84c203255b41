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


def count_calls(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-form reward that records each call (the trainer rank whose worker process made it, and the response)
    in $MOE_RL_TEST_REWARD_CALLS and scores 0: given weight 0 beside the task's reward, it counts the reward calls
    of a run without changing what it learns."""
    import json
    import os

    with open(os.environ["MOE_RL_TEST_REWARD_CALLS"], "a") as f:
        f.write(json.dumps({"rank": os.environ.get("RANK"), "source": data_source, "response": solution_str}) + "\n")
    return 0.0


def trl_accuracy(prompts, completions, completion_ids, **kwargs):
    """A reward function written for TRL's GRPOTrainer (conversational data: completions are message lists), run
    unchanged: records what it was given and scores 1.0 when the completion ends with the row's `solution` column."""
    import json
    import os

    with open(os.environ["MOE_RL_TEST_REWARD_CALLS"], "a") as f:
        for row in zip(prompts, completions, completion_ids, kwargs["solution"], strict=True):
            f.write(json.dumps(dict(zip(("prompt", "completion", "ids", "solution"), row, strict=True))) + "\n")
    return [float(c[0]["content"].strip().endswith(s)) for c, s in zip(completions, kwargs["solution"], strict=True)]
