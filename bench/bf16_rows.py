"""A bf16 actor's forward + backward on CPU with megatron's linears on bucketed row counts (moe_rl.compat.megatron_cpu,
the default) against the same linears on the batch's own row counts, printed as one JSON line.

oneDNN compiles a bf16 GEMM kernel for each new matrix shape. An RL batch has another token count every step, and each
expert another share of it, so without buckets nearly every expert product pays a compile. Both variants run in one
process on the same ragged batches (a new length each iteration, as in RL steps), alternating, world 1, one thread;
the JSON has each variant's mean seconds per iteration, their ratio, and whether the losses and gradients were equal.

  python bench/bf16_rows.py                        # built-in tiny Qwen3-MoE, 16 samples, 30 iterations
  python bench/bf16_rows.py --model DIR --samples 8 --iters 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model folder (default: the built-in tiny Qwen3-MoE)")
    p.add_argument("--samples", type=int, default=16, help="samples per batch (a mini-batch of one rank)")
    p.add_argument("--min-len", type=int, default=20)
    p.add_argument("--max-len", type=int, default=60)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args()

    import torch
    from megatron.core.tensor_parallel import layers

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.forward import run_schedule, split_microbatches
    from moe_rl.actor.model import ModelOptions, load_model
    from moe_rl.actor.parallel import init_distributed
    from moe_rl.models.tiny import TinySpec, build_tiny_model

    torch.set_num_threads(1)
    model_dir = a.model or str(build_tiny_model(TinySpec(), Path(tempfile.mkdtemp(prefix="moe-rl-bench-")) / "toy"))
    init_distributed(ParallelConfig())
    chunks = load_model(model_dir, ParallelConfig(), ModelOptions(dtype="bfloat16")).chunks
    names = ("linear_with_grad_accumulation_and_async_allreduce", "linear_with_frozen_weight")
    bucketed = {n: getattr(layers, n) for n in names}
    plain = {n: f.__wrapped__ for n, f in bucketed.items()}
    vocab = chunks[0].vocab_size
    rng = random.Random(0)
    batches = []
    for _ in range(a.iters):
        n = rng.randint(a.min_len, a.max_len)
        batches.append(torch.randint(0, vocab, (a.samples, n), generator=torch.Generator().manual_seed(n)))

    def step(ids):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        losses = []

        def loss(logits, mb):
            value = logits.float().logsumexp(-1).mean()
            losses.append(value.detach())
            return value, {}

        mbs = split_microbatches(ids, torch.ones_like(ids), micro_batch_size=ids.shape[0])
        run_schedule(chunks, mbs, loss, forward_only=False)
        grads = [q.grad.float().clone() for c in chunks for q in c.parameters() if q.grad is not None]
        return losses[0], grads

    seconds = {"bucketed": [], "plain": []}
    equal = True
    for i, ids in enumerate(batches):
        results = {}
        for variant in ("bucketed", "plain") if i % 2 == 0 else ("plain", "bucketed"):
            for n, f in (bucketed if variant == "bucketed" else plain).items():
                setattr(layers, n, f)
            began = time.perf_counter()
            results[variant] = step(ids)
            seconds[variant].append(time.perf_counter() - began)
        (lb, gb), (lp, gp) = results["bucketed"], results["plain"]
        equal &= bool(torch.equal(lb, lp)) and all(torch.equal(x, y) for x, y in zip(gb, gp, strict=True))
    for n, f in bucketed.items():
        setattr(layers, n, f)
    mean = {k: sum(v[1:]) / len(v[1:]) for k, v in seconds.items()}  # the first iteration warms both up
    print(
        json.dumps(
            {
                "seconds_per_iteration": mean,
                "ratio_bucketed_over_plain": mean["bucketed"] / mean["plain"],
                "losses_and_gradients_equal": equal,
                "config": vars(a),
            }
        )
    )


if __name__ == "__main__":
    main()
