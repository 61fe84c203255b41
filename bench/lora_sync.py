"""LoRA weight sync (actor.lora, merged mode) against full sync, into real vLLM engines, side by side in one run.
Prints one JSON line.

On a tiny Qwen3-MoE with a dense layer (EP=2 on 2 ranks by default, each rank leading one engine), times
`moe_rl.weight_sync.WeightSync` three ways: `full` (every tensor: what full RL sends), `lora_all` (actor.lora with
targets=all: the merged attention, dense-MLP and expert linears, the only tensors a LoRA update changes; the
embedding, LM head, norms and routers stay as loaded) and `lora_attention` (targets=[attention]). Per variant: bytes
each engine received, tensors, seconds (best of --repeats) and both as a fraction of full's. The adapter-only mode
(vLLM's LoRA layers) is not built: its MoE LoRA runs Triton kernels only (actor.lora.weight_sync).

  python bench/lora_sync.py                         # EP=2 on 2 ranks, rank 32
  python bench/lora_sync.py --rank 8 --layout parallel.tp=2
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

from ranks import arguments, parallel_config, run_on_ranks


def spec(a) -> dict:
    shape = dict(hidden=a.hidden, moe_intermediate=a.moe_intermediate, heads=4, kv_heads=2, head_dim=64)
    return dict(arch="qwen3_moe", num_experts=16, topk=2, layers=4, vocab_size=4096, **shape)


def child(a) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor import lora
    from moe_rl.actor.config import LoraConfig
    from moe_rl.actor.model import load_model
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.rollout.config import RolloutConfig
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.rollout.engine_groups import engine_groups
    from moe_rl.weight_sync import WeightSync

    parallel = parallel_config(a.layout)
    init_distributed(parallel)
    groups = engine_groups(0, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size())
    m = load_model(a.model, parallel)
    engine = None
    if groups.is_leader:
        cfg = RolloutConfig(model=a.model, dtype="float32", weight_sync_bucket_mb=a.bucket_mb)
        engine = RolloutEngine(cfg, m.layout.moe_layers, m.layout.num_experts, m.layout.topk)

    def measure(targets: list[str] | None) -> dict:
        model = load_model(a.model, parallel)
        sites = lora.attach(model.chunks, LoraConfig(rank=a.rank, targets=targets)) if targets else []
        if sites:
            lora.init_adapters(model.chunks, seed=1, b_std=0.01)  # a trained adapter: the merged weights differ
        actor = types.SimpleNamespace(chunks=model.chunks, conv=model.conv, lora=sites)
        sync = WeightSync(actor, engine, groups.leaders, a.bucket_mb)
        stats, best = sync(), float("inf")  # plans once; warm-up
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            stats = sync()
            best = min(best, time.perf_counter() - t0)
        t = torch.tensor([best], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return {"bytes": stats["bytes"], "tensors": stats["tensors"], "seconds": t.item()}

    variants = {"full": measure(None), "lora_all": measure(["all"]), "lora_attention": measure(["attention"])}
    for v in variants.values():
        v["bytes_fraction"] = v["bytes"] / variants["full"]["bytes"]
        v["seconds_fraction"] = v["seconds"] / variants["full"]["seconds"]
    if dist.get_rank() == 0:
        out = {"layout": a.layout, "world": dist.get_world_size(), "lora_rank": a.rank, "model": spec(a)}
        Path(a.out).write_text(json.dumps(out | {"variants": variants}))
    if engine is not None:
        engine.shutdown()
    dist.barrier()


def main() -> None:
    p = arguments(__doc__, "parallel.ep=2", 3, "one parallel.<key>=<size> override")
    p.add_argument("--rank", type=int, default=32, help="actor.lora.rank")
    p.add_argument("--bucket-mb", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (a multiple of 32)")
    p.add_argument("--moe-intermediate", type=int, default=384, help="each expert's FFN size")
    a = p.parse_args()
    if a.child:
        return child(a)
    args = [f"--layout={a.layout}", "--bucket-mb", str(a.bucket_mb), "--repeats", str(a.repeats)]
    args += ["--rank", str(a.rank), "--hidden", str(a.hidden), "--moe-intermediate", str(a.moe_intermediate)]
    print(run_on_ranks(__file__, a.nproc, spec(a), args))


if __name__ == "__main__":
    main()
