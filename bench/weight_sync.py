"""Streaming weight sync (actor -> rollout engines) vs a plain in-process copy of the same tensors.
Prints one JSON line.

Builds a tiny Qwen3-MoE large enough for >= 10 buckets, runs `torchrun --nproc-per-node=N` on
itself with the given layout (default EP=2 on 2 ranks: each rank owns half the experts and leads
one engine, so half of every engine's experts arrive from the other rank), and times
`moe_rl.weight_sync.WeightSync` into real vLLM engines. Variants, side by side in one run:
  shm            streaming, bucket buffer in /dev/shm mapped by the engine worker, one engine call per
                 sync, buckets announced on a socket (default); its `engine_load_seconds`: the time
                 the engine workers spent in vLLM's load (max over workers), `engine_repack_seconds`
                 the part of it in the CPU experts' repack into their grouped-GEMM layout
  rpc            streaming, each bucket as a safetensors blob through its own collective_rpc
  allgather_rpc  the previous path: the whole HF state dict all_gather_object'ed to every rank,
                 then rpc buckets (every rank holds the whole model)
Per variant: seconds (best of --repeats), bytes/s into each engine, `throughput_ratio` =
sync bytes/s / plain-copy bytes/s (copying the same tensors once in-process),
`peak_extra_bytes` = max over ranks of peak RSS during the sync (VmHWM reset before it) minus
the RSS before it (the rank's own parameters are already resident).

  python bench/weight_sync.py                          # EP=2 on 2 ranks, 4 MiB buckets
  python bench/weight_sync.py --bucket-mb 8 --nproc 2 --layout parallel.tp=2
  python bench/weight_sync.py --hidden 512 --moe-intermediate 1024 --bucket-mb 16   # 411 MB, 5x the bytes
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ranks import arguments, parallel_config, run_on_ranks


def spec(a) -> dict:
    """The benchmark's tiny qwen3_moe; --hidden / --moe-intermediate scale its bytes."""
    shape = dict(hidden=a.hidden, moe_intermediate=a.moe_intermediate, heads=4, kv_heads=2, head_dim=64)
    return dict(arch="qwen3_moe", num_experts=16, topk=2, layers=4, vocab_size=512, **shape)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(a) -> None:
    import types

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor.model import load_model
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.actor.weights import export_hf_state_dict
    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.engine_groups import engine_groups
    from moe_rl.trainer.metrics import PeakMemory
    from moe_rl.weight_sync import WeightSync, push_weights

    parallel = parallel_config(a.layout)
    init_distributed(parallel)
    m = load_model(a.model, parallel)
    actor = types.SimpleNamespace(chunks=m.chunks, conv=m.conv)
    groups = engine_groups(0, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    engine = None
    if groups.is_leader:
        cfg = RolloutConfig(model=a.model, dtype="float32", weight_sync_bucket_mb=a.bucket_mb)
        engine = RolloutEngine(cfg, m.layout.moe_layers, m.layout.num_experts, m.layout.topk)
    memory = PeakMemory()

    engine_keys = ("engine_load_seconds", "engine_repack_seconds")  # shm: reported by the engine workers

    def measure(run) -> dict:
        best, peak, engine_s = float("inf"), 0, [0.0] * len(engine_keys)
        for _ in range(a.repeats):
            dist.barrier()
            before = _rss()
            memory.reset()
            t0 = time.perf_counter()
            stats = run() or {}
            seconds = time.perf_counter() - t0
            if seconds < best:
                best, engine_s = seconds, [stats.get(k, 0.0) for k in engine_keys]
            peak = max(peak, int(memory.read()["memory/peak_rss_gib"] * 2**30) - before)
        t = torch.tensor([best, peak, *engine_s], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stats = {k: v for k, v in stats.items() if k != "seconds" and k not in engine_keys}
        out = {"seconds": t[0].item(), "peak_extra_bytes": int(t[1].item()), **stats}
        return out | {k: v.item() for k, v in zip(engine_keys, t[2:], strict=True) if v}

    variants = {}
    for transport in ("shm", "rpc"):
        sync = WeightSync(actor, engine, groups.leaders, a.bucket_mb, transport)
        sync()  # plans once; warm-up
        variants[transport] = measure(sync)

    def allgather_rpc():
        named = export_hf_state_dict(m.chunks, m.conv)
        if engine is not None:
            engine.cfg.weight_transport = "rpc"
            return push_weights(engine, named.items())

    variants["allgather_rpc"] = measure(allgather_rpc)
    full = export_hf_state_dict(m.chunks, m.conv)
    model_bytes = sum(t.numel() * t.element_size() for t in full.values())
    dst = {k: torch.empty_like(t) for k, t in full.items()}
    copy_s = float("inf")
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        for k, t in full.items():
            dst[k].copy_(t)
        copy_s = min(copy_s, time.perf_counter() - t0)
    copy_bps = model_bytes / copy_s
    for v in variants.values():
        v["bytes_per_s"] = model_bytes / v["seconds"]
        v["throughput_ratio"] = v["bytes_per_s"] / copy_bps
        v["peak_extra_buckets"] = v["peak_extra_bytes"] / (a.bucket_mb * 2**20)
    if dist.get_rank() == 0:
        out = {
            "layout": a.layout,
            "world": dist.get_world_size(),
            "engines": groups.engines,
            "model": spec(a),
            "model_bytes": model_bytes,
            "bucket_bytes": a.bucket_mb * 2**20,
            "buckets": variants["shm"].get("buckets"),
            "plain_copy_bytes_per_s": copy_bps,
            **{k: variants["shm"][k] for k in ("throughput_ratio", "peak_extra_bytes")},
            "variants": variants,
        }
        Path(a.out).write_text(json.dumps(out))
    if engine is not None:
        engine.shutdown()
    dist.barrier()


def main() -> None:
    p = arguments(__doc__, "parallel.ep=2", 3, "one parallel.<key>=<size> override")
    p.add_argument("--bucket-mb", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (a multiple of 32)")
    p.add_argument("--moe-intermediate", type=int, default=384, help="each expert's FFN size")
    a = p.parse_args()
    if a.child:
        return child(a)
    args = [f"--layout={a.layout}", "--bucket-mb", str(a.bucket_mb), "--repeats", str(a.repeats)]
    args += ["--hidden", str(a.hidden), "--moe-intermediate", str(a.moe_intermediate)]
    print(run_on_ranks(__file__, a.nproc, spec(a), args))


if __name__ == "__main__":
    main()
