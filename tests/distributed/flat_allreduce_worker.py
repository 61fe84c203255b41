"""torchrun worker: the gradient sync's flat all-reduce (train_step._all_reduce_flat) against one all-reduce per
tensor, on 2 ranks, with mixed dtypes and buckets small enough to split the tensors over several all-reduces."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: Path) -> None:
    from moe_rl.actor import train_step

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own gradients
    shapes = [(7, 5), (3,), (64, 33), (1,), (130,), (9, 9, 2)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.float64, torch.bfloat16, torch.float32]
    grads = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes, strict=True)]
    train_step.SYNC_BUCKET_BYTES = 1024  # 64x33 fp32 travels alone, the small ones share buckets
    result = {"rank": rank}
    for divide in (1, 2):
        flat = [t.clone() for t in grads]
        train_step._all_reduce_flat(flat, dist.group.WORLD, divide=divide)
        for t in (per := [t.clone() for t in grads]):
            dist.all_reduce(t)
            if divide != 1:
                t /= divide
        result[f"bitwise_equal_divide_{divide}"] = all(torch.equal(a, b) for a, b in zip(flat, per, strict=True))
        result[f"dtypes_kept_divide_{divide}"] = [a.dtype == t.dtype for a, t in zip(flat, grads, strict=True)]
        result[f"changed_divide_{divide}"] = all(not torch.equal(a, t) for a, t in zip(flat, grads, strict=True))
    (out / f"rank_{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
