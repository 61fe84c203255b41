"""The reward part of the RL step: the run's RewardSet over a step's samples, computed once per data-parallel
replica. The ranks that share a data-parallel rank (tensor-, pipeline- and context-parallel peers) hold the same
samples: the lowest of them scores, and the rewards and metrics go to the others over a gloo group of their own
(used by nothing else: the step may score on another thread than the trainer's collectives)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_rl.common.distributed import all_gather_objects
from moe_rl.reward import RewardSet, samples_of
from moe_rl.reward.inprocess import RewardError


@dataclass
class RewardPeers:
    """The ranks that share this rank's samples, and which of them scores."""

    scorer: int  # global rank that calls the reward functions
    group: dist.ProcessGroup | None  # the peers' gloo group (None: no peer)

    @property
    def scores(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == self.scorer


def reward_peers(dp_rank: int) -> RewardPeers:
    """Collective (every rank calls it once, after the parallel layout is set): the peers of `dp_rank`, this rank's
    data-parallel rank (trainer.run.data_parallel: context-parallel peers share it, as they share samples)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return RewardPeers(0, None)
    dp_of = all_gather_objects(dp_rank)
    mine = None
    for d in sorted(set(dp_of)):  # every rank creates every group, in the same order
        ranks = [r for r, x in enumerate(dp_of) if x == d]
        group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
        if d == dp_rank:
            mine = RewardPeers(min(ranks), group)
    return mine


class Rewarder:
    """Scores a step's samples with the run's RewardSet on one rank per data-parallel replica."""

    def __init__(self, rewards: RewardSet, tokenizer, peers: RewardPeers):
        self.rewards, self.tokenizer, self.peers = rewards, tokenizer, peers
        self.parts: list[tuple[dict, dict]] = []  # this step's (totals, counts), scorer ranks only

    def __call__(self, rollout, step: int) -> torch.Tensor:
        """[B] float32 rewards of `rollout`'s samples at step `step` (1-based, named in errors), or the rewards the
        rollout already has (a dump's, an environment's)."""
        if rollout.rewards is not None:
            return rollout.rewards
        payload = None
        if self.peers.scores:
            try:
                texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
                samples = samples_of(rollout.prompts, rollout.prompt_index, texts, rollout.response_ids)
                rank = f"(rank {dist.get_rank()})" if dist.is_initialized() and dist.get_world_size() > 1 else ""
                scores = self.rewards.score(samples, step, phase=rank)
                payload = ("ok", scores.rewards, scores.totals, scores.counts)
                self.parts.append((scores.totals, scores.counts))
            except Exception as e:
                payload = ("error", f"{e}")
                self._share(payload)  # the peers stop with the same error instead of waiting
                raise
        payload = self._share(payload)
        if payload[0] == "error":
            raise RewardError(f"(scored on rank {self.peers.scorer}) {payload[1]}")
        return torch.tensor(payload[1], dtype=torch.float32)

    def _share(self, payload):
        if self.peers.group is None:
            return payload
        box = [payload]
        dist.broadcast_object_list(box, src=self.peers.scorer, group=self.peers.group)
        return box[0]

    def take(self) -> list[tuple[dict, dict]]:
        """The (totals, counts) of the step's scoring on this rank (empty on a peer that did not score), for
        trainer.metrics.reward_metrics; cleared for the next step."""
        parts, self.parts = self.parts, []
        return parts

    def close(self) -> None:
        """Stop the reward worker processes."""
        self.rewards.close()
