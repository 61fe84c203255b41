"""torchrun worker: balance_rollout over 2 gloo ranks on rollouts with uneven token counts.

  torchrun --nproc-per-node=2 -m tests.distributed.balance_worker OUT_DIR

Rank r builds GROUPS groups of N samples (seeded by r; rank 0's responses are long, rank 1's short),
balances them within each of MINI_BATCHES mini-batches, and writes OUT_DIR/rank_<r>.pt with what it
held before and after, and the metrics.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

GROUPS, N, LAYERS, TOPK, MINI_BATCHES = 4, 3, 2, 2, 2


def rollout_for(rank: int):
    from moe_rl.common.batch import RolloutBatch
    from moe_rl.data.prompts import Prompt
    from moe_rl.rollout.source import Rollout

    rng = np.random.default_rng(rank)
    prompts = [Prompt(text=f"r{rank}p{g}", answer=str(g), ids=[rank + 1, g + 1]) for g in range(GROUPS)]
    hi = 40 if rank == 0 else 8
    responses = [list(rng.integers(1, 90, rng.integers(1, hi))) for _ in range(GROUPS * N)]
    batch = RolloutBatch(
        prompt_ids=[prompts[i // N].ids for i in range(GROUPS * N)],
        response_ids=[[int(x) for x in r] for r in responses],
        rollout_logprobs=[rng.normal(size=len(r)).astype(np.float32) for r in responses],
        finish_reasons=["stop"] * (GROUPS * N),
        prompt_index=np.repeat(np.arange(GROUPS), N),
        sample_index=np.arange(GROUPS * N),
        routes=[rng.integers(0, 8, (2 + len(r), LAYERS, TOPK)).astype(np.uint8) for r in responses],
        moe_layers=list(range(LAYERS)),
        num_experts=8,
        topk=TOPK,
    )
    padded = batch.to_padded(min_length=2 + 40)  # the world's longest, as EngineSource pads
    return Rollout(
        padded,
        policy_version=torch.full((GROUPS * N,), 7 + rank),
        response_lengths=torch.tensor([len(r) for r in responses]),
        prompts=prompts,
        prompt_index=[int(i) for i in batch.prompt_index],
        response_ids=batch.response_ids,
        rewards=torch.arange(GROUPS * N, dtype=torch.float32) + 100 * rank,
        truncated=torch.zeros(GROUPS * N, dtype=torch.bool),
    )


def main() -> None:
    from moe_rl.rollout.balance import balance_rollout

    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    before = rollout_for(rank)
    after, metrics = balance_rollout(before, N, MINI_BATCHES, dist.group.WORLD)
    torch.save({"before": before, "after": after, "metrics": metrics}, out / f"rank_{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    from moe_rl.trainer.signals import run_then_exit

    run_then_exit(main)
