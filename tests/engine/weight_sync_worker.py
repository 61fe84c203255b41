"""torchrun worker: the streaming weight sync into real engines under a parallel layout.

  torchrun --nproc-per-node=2 -m tests.engine.weight_sync_worker MODEL --layout tp=2 --transport shm --out DIR

Every rank perturbs its shards the same way (an "update"), `WeightSync` streams the model into
the engines on the engine leaders (1 MiB buckets), and each leader writes DIR/rank<r>.json with
the largest |engine - actor| log-prob on fixed sequences before and after the sync.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path


def main() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.forward import compute_logprobs
    from moe_rl.actor.model import load_model
    from moe_rl.actor.parallel import destroy_distributed, init_distributed
    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.engine_groups import engine_groups
    from moe_rl.weight_sync import WeightSync

    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--layout", required=True, help="e.g. tp=2 or ep=2")
    p.add_argument("--transport", default="shm")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    key, value = a.layout.split("=")
    parallel = ParallelConfig(**{key: int(value)})
    init_distributed(parallel)
    m = load_model(a.model, parallel)
    groups = engine_groups(0, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    engine = None
    if groups.is_leader:
        cfg = RolloutConfig(model=a.model, dtype="float32", weight_sync_bucket_mb=1, weight_transport=a.transport)
        engine = RolloutEngine(cfg, m.layout.moe_layers, m.layout.num_experts, m.layout.topk)
    with torch.no_grad():  # the same elementwise change on every shard of every parameter
        for c in m.chunks:
            for q in c.parameters():
                q.mul_(0.8).add_(0.01)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (9, 17, 12, 5)]
    ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    actor = compute_logprobs(m.chunks, ids, mask)["logprobs"]

    def diff() -> float:
        got = engine.prompt_logprobs(seqs)
        return max((torch.from_numpy(v) - actor[i, : len(v)]).abs().max().item() for i, v in enumerate(got))

    before = diff() if engine is not None else None
    sync = WeightSync(types.SimpleNamespace(chunks=m.chunks, conv=m.conv), engine, groups.leaders, 1, a.transport)
    stats = sync()
    if engine is not None:
        out = {"before": before, "after": diff(), **stats, "leaders": groups.leaders}
        Path(a.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
        engine.shutdown()
    dist.barrier()
    destroy_distributed()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
