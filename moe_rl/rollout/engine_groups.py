"""Which ranks run a rollout engine and which samples go where.

`rollout.engines` engines (default: one per data-parallel rank) serve the data-parallel ranks in
equal, consecutive shares. An engine lives on the lowest global rank among the ranks whose
data-parallel rank it serves (its leader); every other rank of that group (TP/PP/CP peers, and
further data-parallel ranks when engines are fewer) has none. Per step the leader gathers each
served data-parallel rank's prompts, samples them in one call with seeds that depend only on
the step and the data-parallel rank, and sends each rank the samples of its data-parallel rank.
So changing TP/PP/CP/EP changes neither what is sampled nor who trains on it.

That exchange runs on a gloo group of its own, used by nothing else: under trainer.max_staleness it runs
on the rollout thread while the trainer's collectives run on the main thread, and two threads must never
share a group (their messages would interleave).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from moe_rl.common.distributed import all_gather_objects


@dataclass
class EngineGroups:
    """This rank's place in the engine layout (build with `engine_groups`)."""

    engines: int
    dp_rank: int
    dp_size: int
    served: list[int]  # data-parallel ranks served by this rank's engine, in order
    leader: int  # global rank of that engine
    group: dist.ProcessGroup | None  # every rank served by that engine, for the exchange only (None: only this rank)
    group_ranks: list[int]
    leaders: list[int]  # every engine's leader (weight sync delivers to each)

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader

    def sampling_stream(self, step: int) -> int:
        """Index of the first served data-parallel rank's prompt stream at `step`: prompt j of data-parallel
        rank d gets seed `sampling.seed + (step * dp_size + d) * prompts_per_step + j`."""
        return step * self.dp_size + self.served[0]


def engine_groups(engines: int, dp_rank: int, dp_size: int) -> EngineGroups:
    """Collective (every rank calls it once): `engines` = rollout.engines (0: one per data-parallel rank)."""
    engines = engines or dp_size
    if engines < 1 or dp_size % engines:
        raise ValueError(
            f"config rollout.engines: {engines} engines cannot share {dp_size} data-parallel ranks equally "
            f"(choose a divisor of {dp_size}, or 0 for one per data-parallel rank)"
        )
    per = dp_size // engines
    world = dist.get_world_size()
    dp_of = all_gather_objects(dp_rank)
    mine, leaders = None, []
    for e in range(engines):  # every rank creates every group, in the same order
        ranks = [r for r in range(world) if e * per <= dp_of[r] < (e + 1) * per]
        group = dist.new_group(ranks, backend="gloo") if len(ranks) > 1 else None
        leaders.append(min(ranks))
        if dist.get_rank() in ranks:
            mine = (list(range(e * per, (e + 1) * per)), ranks, group)
    served, ranks, group = mine
    return EngineGroups(engines, dp_rank, dp_size, served, min(ranks), group, ranks, leaders)
