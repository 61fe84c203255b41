"""Rewards for the reward-service tests (tests/unit/test_reward_service.py), loaded by path on the server and in
process: each records the samples it scores (the server's pid and the response) when $MOE_RL_TEST_SERVICE_CALLS
names a file, then waits $MOE_RL_TEST_SERVICE_SLEEP seconds (so a batch is in flight when the test kills the
server)."""

import os
import time


def lengths(responses, answers, response_ids):
    """moe-rl batched form, in the server's own process: a quarter of the response's length (exact in binary)."""
    if path := os.environ.get("MOE_RL_TEST_SERVICE_CALLS"):
        with open(path, "a") as f:
            f.writelines(f"{os.getpid()} {r}\n" for r in responses)
    time.sleep(float(os.environ.get("MOE_RL_TEST_SERVICE_SLEEP", "0")))
    return [len(r) / 4 for r in responses]


def trl_format(prompts, completions, completion_ids, **kwargs):
    """TRL's form with log_metric and a None (not scored) for a response that says 'skip'."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    kwargs["log_metric"]("short", float(sum(len(t) < 6 for t in texts)))
    return [None if t.startswith("skip") else float(t.endswith("7")) for t in texts]
