"""A reward file written for verl (loaded as data.reward=path/to/verl_reward.py:compute_score): records each call."""

import json
import os


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if path := os.environ.get("MOE_RL_TEST_CALLS"):
        with open(path, "a") as f:
            f.write(json.dumps([data_source, solution_str, ground_truth, extra_info, os.getpid()]) + "\n")
    if solution_str == "raise":
        raise KeyError("broken verifier")
    if solution_str == "hang":
        import time

        while True:
            time.sleep(60)
    correct = solution_str.strip().endswith(str(ground_truth))
    return {"score": 1.0 if correct else 0.0, "acc": float(correct), "pred": solution_str[-5:]}


def not_a_reward(x):
    return x
