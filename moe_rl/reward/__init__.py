"""Reward functions users already write (verl's compute_score, TRL's reward functions, moe-rl's own), loaded by
spec, run on whole Samples (sync per-sample ones in a pool of worker processes) and combined with weights.

One module one job: sample.py (what a reward sees), load.py (spec -> function and its form), builtin.py (the built-in
rewards and the data_source dispatch), math_answer.py (math-verify), inprocess.py (calls in this process), pool.py
(the worker processes), scoring.py (RewardSet: the run's rewards together)."""

from moe_rl.reward.sample import Sample, samples_of
from moe_rl.reward.scoring import RewardSet, Scores, combine

__all__ = ["RewardSet", "Sample", "Scores", "combine", "samples_of"]
