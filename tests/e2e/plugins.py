"""Reward plugins for end-to-end tests of bad rewards (selected with data.reward=tests.e2e.plugins:NAME)."""

from __future__ import annotations


def nan_reward(responses, answers, response_ids):
    """What a broken verifier returns: NaN for every sample."""
    return [float("nan")] * len(responses)
