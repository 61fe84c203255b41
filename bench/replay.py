"""Routing replay cost, printed as JSON:

1. forward+backward time of the Megatron actor with replayed routes vs live routing (same
   model, batch and micro-batching, alternating runs, best of N; ratio);
2. route bytes per rank for a 64 x 4096-token batch of a 48-layer, 128-expert, top-8 model:
   its data-parallel shard on the route holder (the others hold none) and each rank's replay targets
   of a pass (its SP/CP slice).

  python bench/replay.py
  python bench/replay.py --batch 8 --seq 512 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def route_memory(batch=64, seq=4096, layers=48, experts=128, topk=8, dp=8, tp=2, cp=2) -> dict:
    """Route bytes per rank, from the slicing functions the actor uses. Of a data-parallel rank's TP x CP ranks
    only the route holder keeps the shard's routes; every rank queues its own positions of a pass as replay
    targets in the record's dtype (int64 before 2026-11-26, when every TP/CP rank also kept the whole shard)."""
    from moe_rl.routing.layout import rank_positions
    from moe_rl.routing.records import route_dtype

    item = np.dtype(route_dtype(experts)).itemsize
    full = batch * seq * layers * topk * item
    rows = batch // dp  # data-parallel rank 0's shard
    host = rows * seq * layers * topk * item
    pos = rank_positions(seq, tp=tp, tp_rank=0, cp=cp, cp_rank=0, sequence_parallel=tp > 1)
    targets = rows * len(pos) * layers * topk
    return {
        "layout": {"dp": dp, "tp": tp, "cp": cp},
        "full_batch_bytes": full,
        "host_bytes_route_holder": host,
        "pass_targets_bytes_per_rank": targets * item,
        "pass_targets_bytes_per_rank_as_int64": targets * 8,
        "broadcast_full_batch_over_host_shard": full / host,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()

    import torch

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.forward import compute_logprobs, run_schedule, split_microbatches, vocab_parallel_logprobs
    from moe_rl.actor.model import load_model
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.actor.replay import RouteReplay
    from moe_rl.models.tiny import TinySpec, build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="moe-rl-bench-"))
    spec = TinySpec(arch="qwen3_moe", num_experts=32, topk=4, layers=4, hidden=256, head_dim=64, moe_intermediate=256)
    path = build_tiny_model(spec, tmp / "model")
    init_distributed(ParallelConfig())
    m = load_model(path, ParallelConfig())
    cfg, chunks = m.hf_config, m.chunks
    replay = RouteReplay(chunks, m.layout.moe_layers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
    mask = torch.ones_like(ids)
    routes = compute_logprobs(chunks, ids, mask, a.micro_batch, replay=replay, record=True)["routes"]

    def step(logits, mb):
        lp, _ = vocab_parallel_logprobs(logits[:, :-1], mb.input_ids[:, 1:], with_entropy=False)
        return -lp.mean(), {}

    def fwd_bwd(with_replay: bool) -> float:
        for c in chunks:
            c.train()
            c.zero_grad(set_to_none=True)
        mbs = split_microbatches(ids, mask, a.micro_batch, extra={"routes": routes} if with_replay else None)
        t0 = time.perf_counter()
        if with_replay:
            with replay.replay(mbs):
                run_schedule(chunks, mbs, step, forward_only=False)
        else:
            run_schedule(chunks, mbs, step, forward_only=False)
        return time.perf_counter() - t0

    fwd_bwd(False)
    fwd_bwd(True)  # warm-up
    times = {"live": [], "replay": []}
    for _ in range(a.repeats):
        times["live"].append(fwd_bwd(False))
        times["replay"].append(fwd_bwd(True))
    best = {k: min(v) for k, v in times.items()}
    out = {
        "model": spec.__dict__,
        "batch": a.batch,
        "seq": a.seq,
        "micro_batch": a.micro_batch,
        "threads": torch.get_num_threads(),
        "fwd_bwd_seconds": best,
        "replay_over_live": best["replay"] / best["live"],
        "route_memory": route_memory(),
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
