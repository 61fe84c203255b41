"""The reward part of the RL step: the reward plugin (data.reward) over a step's samples."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_rl.data.rewards import RewardFn, score


class Rewarder:
    """Scores a step's samples with the reward plugin: the decoded responses, their prompts' reference answers and
    texts, and the response token ids (data/rewards.py `score` checks what it returns)."""

    def __init__(self, fn: RewardFn, tokenizer, timeout_s: float = 0.0):
        """`fn`: the loaded plugin; `timeout_s`: data.reward_timeout_s."""
        self.fn, self.tokenizer, self.timeout_s = fn, tokenizer, timeout_s

    def __call__(self, rollout, step: int) -> torch.Tensor:
        """[B] float32 rewards of `rollout`'s samples at step `step` (1-based, named in errors), or the rewards the
        rollout already has (a dump's, an environment's)."""
        if rollout.rewards is not None:
            return rollout.rewards
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        answers = [rollout.prompts[i].answer for i in rollout.prompt_index]
        sources = [rollout.prompts[i].text for i in rollout.prompt_index]
        rank = dist.get_rank() if dist.get_world_size() > 1 else None
        ids = rollout.response_ids
        rewards = score(self.fn, texts, answers, ids, sources, step, rank, timeout_s=self.timeout_s)
        return torch.tensor(rewards, dtype=torch.float32)
