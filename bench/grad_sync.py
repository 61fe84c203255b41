"""The CPU path's gradient sync (train_step.sync_gradients: one gloo all-reduce per flat bucket of one dtype) vs one
all-reduce per gradient tensor (the path before 2026-11-27), on the default job's tiny model, printed as JSON.

Runs `torchrun --nproc-per-node=N` on itself with the given layout, gives every parameter a random gradient (each
rank its own), and times both ways over the same tensors (best of --repeats); reports whether they leave bitwise
equal gradients.

  python bench/grad_sync.py                             # data parallel on 2 ranks
  python bench/grad_sync.py --layout parallel.ep=2      # experts over the expert-data-parallel group
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ranks import arguments, parallel_config, run_on_ranks


def child(a) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor.model import load_model
    from moe_rl.actor.optimizer import is_expert
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.actor.train_step import sync_gradients

    parallel = parallel_config(a.layout)
    init_distributed(parallel)
    m = load_model(a.model, parallel)
    params = [(n, p) for c in m.chunks for n, p in c.named_parameters()]
    g = torch.Generator().manual_seed(dist.get_rank())
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for _, p in params]

    dp, edp = ps.get_data_parallel_group(with_context_parallel=True), ps.get_expert_data_parallel_group()

    def per_tensor():  # the previous sync (no TP here: one group per parameter)
        for (name, p), grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
            group = edp if is_expert(name) else dp
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)

    def flat():
        for (_, p), grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        sync_gradients(m.chunks)

    seconds, results = {}, {}
    for name, fn in (("per_tensor", per_tensor), ("flat", flat)) * 2:  # interleaved, best of both rounds
        for _ in range(a.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            seconds[name] = min(seconds.get(name, float("inf")), time.perf_counter() - t0)
        results[name] = [p.grad.clone() for _, p in params]
    t = torch.tensor([seconds["per_tensor"], seconds["flat"]], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    equal = all(torch.equal(x, y) for x, y in zip(results["per_tensor"], results["flat"], strict=True))
    if dist.get_rank() == 0:
        out = {
            "layout": a.layout or "data parallel",
            "world": dist.get_world_size(),
            "tensors": len(params),
            "gradient_bytes": sum(p.numel() * p.element_size() for _, p in params),
            "seconds": {"per_tensor": t[0].item(), "flat": t[1].item()},
            "speedup": t[0].item() / t[1].item(),
            "bitwise_equal": equal,
        }
        Path(a.out).write_text(json.dumps(out))
    dist.barrier()


def main() -> None:
    layout_help = "one parallel.<key>=<size> override (default: data parallel only)"
    a = arguments(__doc__, "", 10, layout_help).parse_args()
    if a.child:
        return child(a)
    print(run_on_ranks(__file__, a.nproc, {}, [f"--layout={a.layout}", "--repeats", str(a.repeats)]))  # default model


if __name__ == "__main__":
    main()
