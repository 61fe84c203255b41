"""torchrun worker: vocab-parallel fused log-prob on 2 ranks vs full-vocab reference."""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(out: Path) -> None:
    from kernels.linear_logprob import fused_linear_logprob, linear_logprob_reference

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    n, d, v = 29, 40, 2 * 157
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * 0.3
    y = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    b, wb = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    lr, er = linear_logprob_reference(b, wb, y)
    (lr * g_lp + er * g_ent).sum().backward()
    shard = slice(rank * v // world, (rank + 1) * v // world)
    rel = lambda x, r: ((x - r).abs().max() / r.abs().max()).item()  # noqa: E731
    for backend in ("triton", "torch"):
        a, wa = h.clone().requires_grad_(True), w[shard].clone().requires_grad_(True)
        lp, ent = fused_linear_logprob(a, wa, y, group=dist.group.WORLD, backend=backend, chunk_tokens=8)
        (lp * g_lp + ent * g_ent).sum().backward()
        res = {
            "rank": rank,
            "backend": backend,
            "logp": rel(lp, lr),
            "entropy": rel(ent, er),
            "grad_hidden": rel(a.grad, b.grad),
            "grad_weight_shard": rel(wa.grad, wb.grad[shard]),
        }
        (out / f"{backend}.rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main(Path(sys.argv[1]))
