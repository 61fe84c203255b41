"""torchrun worker (tests/distributed/jobs.py): the bytes a real actor holds after one update, per rank.

run(["--model", DIR, "--layout", "tp2", "--dtype", "bfloat16", "--out", DIR]): builds the trainer's Actor under the
layout, trains it on one random batch (2 mini-batches: autograd's gradients, AdamW's states and, for bf16, the fp32
master weights and their gradients as the update leaves them) and writes rank{R}.json: {"stage", "parameters",
"parameters_bytes", "gradients_bytes", "optimizer_bytes"}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

LAYOUTS = {
    "w1": {},
    "tp2": {"tp": 2},
    "ep2": {"ep": 2},
    "pp2_first3": {"pp": 2, "first_stage_layers": 3},  # uneven stages (3 + 1 layers): their rows too
    "tp2ep2": {"tp": 2, "ep": 2},
}


def run(argv: list[str]) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor.actor import Actor
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.common.batch import PaddedBatch
    from moe_rl.config import ActorConfig, AlgorithmConfig, ModelConfig
    from moe_rl.objectives import Objective

    p = argparse.ArgumentParser()
    for flag in ("--model", "--layout", "--dtype", "--out"):
        p.add_argument(flag, required=True)
    a = p.parse_args(argv)
    parallel = ParallelConfig(**LAYOUTS[a.layout])
    init_distributed(parallel, seed=7)
    actor_cfg = ActorConfig(router_replay="off", lr=1e-4, mini_batches=2, micro_batch_size=2)
    actor = Actor(actor_cfg, ModelConfig(dtype=a.dtype), parallel, a.model, record_routes=False)
    g = torch.Generator().manual_seed(3 + ps.get_data_parallel_rank())
    rows, length = 4, 12
    ids = torch.randint(3, 200, (rows, length), generator=g)
    loss_mask = torch.zeros(rows, length)
    loss_mask[:, 6:] = 1
    batch = PaddedBatch(ids, torch.ones(rows, length, dtype=torch.long), loss_mask, torch.zeros(rows, length), None)
    old = actor.old_logprobs(batch)
    batch.rollout_logprobs = old.logprobs.detach().clone()
    actor.train(
        batch, old, torch.randn(rows, generator=g), Objective(AlgorithmConfig(), 1), on_skip=lambda skipped, i: skipped
    )

    params = [q for c in actor.chunks for q in c.parameters()]
    # bf16: the optimizer's own fp32 master weights (its parameters) and their gradients
    masters = [q for opt in actor.optimizer.chained_optimizers for q in getattr(opt, "fp32_from_float16_groups", [])]
    masters = [q for group in masters for q in group]
    grads = [q.grad for q in params + masters if q.grad is not None]
    states = masters + [
        t
        for opt in actor.optimizer.chained_optimizers
        for state in opt.optimizer.state.values()
        for key, t in state.items()
        if key in ("exp_avg", "exp_avg_sq")  # Adam's moments ("step" is one scalar per tensor)
    ]

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "stage": ps.get_pipeline_model_parallel_rank(),
        "parameters": sum(q.numel() for q in params),
        "parameters_bytes": nbytes(params),
        "gradients_bytes": nbytes(grads),
        "optimizer_bytes": nbytes(states),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
