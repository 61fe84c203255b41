"""Update-step time with padding-free packing (actor.packing) on vs off, printed as one JSON line.

Each of 2 data-parallel ranks (gloo) draws its own long-tailed batch, as RL rollouts have:
prompt lengths uniform in [32, 256], response lengths log-uniform in [16, 1024] (seeded), random
token ids, loss_mask on the response tokens, random R3 routes (distinct experts per token),
rollout log-probs = old log-probs + N(0, 0.05) noise, random advantages; the batch is padded to
the world's longest sample, as the rollout source pads it. Two `Actor`s are built from the same
tiny HF model (qwen3_moe: 4 layers, hidden 128, 8 experts top-2, fp32):
  padded  actor.packing=false, micro-batches of actor.micro_batch_size samples;
  packed  actor.packing=true, bins of at most actor.max_tokens_per_micro_batch tokens.
Each runs the old-log-prob pass and one warm-up `Actor.train` (the update: 2 mini-batches,
forward+backward, gradient sync, clipping, Adam), then `--repeats` timed `Actor.train` calls,
the two variants alternating so that background load hits both alike. Reported: the medians (wall
time; CPU time summed over the ranks as a check on a busy machine), the update's
perf/padding_fraction and perf/micro_batches, and what each variant computes per pass, summed over
the ranks: positions (every linear layer; packed / padded = positions_ratio) and attention scores
(padded: a dense [T, T] block per row, b * T^2; packed: each bin's samples in length classes, n * L^2 per
class, as actor/packed_attention.py computes them; attention_scores_ratio).

  python bench/packing.py                        # launches torchrun --nproc-per-node=2 itself
  torchrun --standalone --nproc-per-node=2 bench/packing.py --samples 16 --repeats 3
  python bench/packing.py --max-tokens 1024 --micro-batch-size 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def rollout_batch(rng: np.random.Generator, a, vocab: int, moe_layers: list[int], experts: int, topk: int):
    """This rank's RolloutBatch: long-tailed lengths, random ids and routes (rollout log-probs 0: set
    from the old pass later)."""
    from moe_rl.common.batch import RolloutBatch
    from moe_rl.routing.records import route_dtype

    prompt_lens = rng.integers(a.prompt_len[0], a.prompt_len[1] + 1, a.samples)
    lo, hi = np.log(a.response_len[0]), np.log(a.response_len[1])
    response_lens = np.exp(rng.uniform(lo, hi, a.samples)).round().astype(int)
    prompts = [rng.integers(1, vocab, p).tolist() for p in prompt_lens]
    responses = [rng.integers(1, vocab, r).tolist() for r in response_lens]
    # distinct experts per token and layer: the first topk of a random permutation
    routes = [
        rng.random((p + r, len(moe_layers), experts)).argsort(-1)[..., :topk].astype(route_dtype(experts))
        for p, r in zip(prompt_lens, response_lens, strict=True)
    ]
    return RolloutBatch(
        prompts,
        responses,
        [np.zeros(r, dtype=np.float32) for r in response_lens],
        ["length"] * a.samples,
        np.arange(a.samples),
        np.zeros(a.samples, dtype=int),
        routes,
        moe_layers,
        experts,
        topk,
    )


def build_actors(a, model: str) -> dict:
    """The two variants' Actors, same weights (the HF folder), same layout (DP = world)."""
    from moe_rl.actor.actor import Actor
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.config import ActorConfig, ModelConfig

    common = dict(router_replay="r3", mini_batches=a.mini_batches, micro_batch_size=a.micro_batch_size)
    variants = {
        "padded": ActorConfig(**common, packing=False),
        "packed": ActorConfig(**common, packing=True, max_tokens_per_micro_batch=a.max_tokens),
    }
    return {
        name: Actor(cfg, ModelConfig(), ParallelConfig(), model, record_routes=False) for name, cfg in variants.items()
    }


def _packed_scores(lengths: list[int], row_len: int) -> int:
    """Attention scores the packed path computes for one bin (its samples, then the row's tail padding)."""
    import torch

    from moe_rl.actor.packed_attention import row_plan
    from moe_rl.actor.packing import _block_causal_mask

    sample = torch.cat(
        [torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((row_len - sum(lengths),), -1)]
    )
    plan = row_plan(_block_causal_mask(sample))
    if plan is None:  # one sample, no padding: megatron's own [S, S]
        return row_len * row_len
    return sum(at.shape[1] * at.shape[0] ** 2 for at, _, _ in plan.classes)


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.parallel import destroy_distributed, init_distributed
    from moe_rl.common.distributed import world_max
    from moe_rl.config import AlgorithmConfig
    from moe_rl.models.tiny import TinySpec, build_tiny_model
    from moe_rl.objectives import Objective

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[packing] {msg}", file=sys.stderr, flush=True)

    init_distributed(ParallelConfig(), seed=a.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = TinySpec(arch="qwen3_moe")
    box = [tempfile.mkdtemp(prefix="moe-rl-bench-") if rank == 0 else None]
    if rank == 0:
        build_tiny_model(spec, Path(box[0]) / "model")
    dist.broadcast_object_list(box, src=0)
    model = str(Path(box[0]) / "model")

    torch.manual_seed(a.seed)
    actors = build_actors(a, model)
    layout, vocab = actors["padded"].layout, actors["padded"].hf_config.vocab_size
    rng = np.random.default_rng([a.seed, rank])  # each rank its own samples
    batch = rollout_batch(rng, a, vocab, layout.moe_layers, layout.num_experts, layout.topk)
    (longest,) = world_max(max(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)))
    padded = batch.to_padded(min_length=longest)
    noise = torch.from_numpy(0.05 * rng.standard_normal(padded.loss_mask.shape).astype(np.float32))
    advantages = torch.from_numpy(rng.standard_normal(a.samples).astype(np.float32))
    objective = Objective(AlgorithmConfig(), group_size=1)

    old = {}
    for name, actor in actors.items():
        log(f"{name}: old log-probs")
        old[name] = actor.old_logprobs(padded)
    # one behaviour policy for both: the padded pass's log-probs (the two agree to ~1e-6)
    padded.rollout_logprobs = (old["padded"]["logprobs"] + noise) * padded.loss_mask

    def train(name: str) -> tuple[float, float, dict]:
        """Wall seconds of one update, CPU seconds of it summed over the ranks (less sensitive to
        other jobs on the machine than wall time), its metrics."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        m = actors[name].train(padded, old[name], advantages, objective, on_skip=lambda skipped, i: skipped)
        dist.barrier()
        wall, cpu = time.perf_counter() - t0, torch.tensor([time.process_time() - c0], dtype=torch.float64)
        dist.all_reduce(cpu)
        return wall, float(cpu), m

    warmup, times, cpu_times, metrics = {}, {name: [] for name in actors}, {name: [] for name in actors}, {}
    for name in actors:
        log(f"{name}: warm-up update")
        warmup[name], _, metrics[name] = train(name)
    for r in range(a.repeats):
        for name in actors:
            wall, cpu, _ = train(name)
            times[name].append(wall)
            cpu_times[name].append(cpu)
        log(f"repeat {r + 1}/{a.repeats}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()))
    plan = actors["packed"].pack_plan(padded)
    median = {name: statistics.median(t) for name, t in times.items()}
    best = {name: min(t) for name, t in times.items()}
    cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    tokens = padded.attention_mask.sum(-1)
    # what each variant computes per pass, summed over the ranks: positions (every linear layer) and
    # attention scores (padded: a dense [T, T] block per row, b * T^2; packed: each bin's samples in their
    # length classes, n * L^2 per class, as actor/packed_attention.py runs them)
    b, t = padded.input_ids.shape
    packed_scores = sum(
        _packed_scores(tokens[rows].tolist(), n) for rows, n in zip(plan.bins, plan.seq_lens, strict=True)
    )
    work = torch.tensor([b * t, b * t * t, sum(plan.seq_lens), packed_scores], dtype=torch.float64)
    dist.all_reduce(work)
    if rank == 0:
        out = {
            "step_time_ratio": median["packed"] / median["padded"],
            "step_time_ratio_best": best["packed"] / best["padded"],
            "cpu_time_ratio": cpu["packed"] / cpu["padded"],
            "time_packed_s": median["packed"],
            "time_padded_s": median["padded"],
            "padding_fraction_packed": metrics["packed"]["perf/padding_fraction"],
            "padding_fraction_padded": metrics["padded"]["perf/padding_fraction"],
            "micro_batches_packed": metrics["packed"]["perf/micro_batches"],
            "micro_batches_padded": metrics["padded"]["perf/micro_batches"],
            "packed_row_lens_rank0": plan.seq_lens,
            "padded_row_len": padded.input_ids.shape[1],
            "tokens_per_step": metrics["packed"]["perf/tokens"],
            "positions_ratio": float(work[2] / work[0]),
            "attention_scores_ratio": float(work[3] / work[1]),
            "warmup_grad_norm": {n: m["actor/grad_norm"] for n, m in metrics.items()},
            "times_s": times,
            "cpu_times_s": cpu_times,
            "warmup_s": warmup,
            "config": {
                "world": world,
                "dp": ps.get_data_parallel_world_size(),
                "samples_per_rank": a.samples,
                "mini_batches": a.mini_batches,
                "micro_batch_size": a.micro_batch_size,
                "max_tokens_per_micro_batch": a.max_tokens,
                "repeats": a.repeats,
                "seed": a.seed,
                "threads_per_rank": torch.get_num_threads(),
                "model": spec.__dict__,
                "lengths": {
                    "prompt": f"uniform {a.prompt_len[0]}..{a.prompt_len[1]}",
                    "response": f"log-uniform {a.response_len[0]}..{a.response_len[1]}",
                    "rank0_total": {
                        "min": int(tokens.min()),
                        "median": float(tokens.median()),
                        "mean": float(tokens.float().mean()),
                        "max": int(tokens.max()),
                    },
                },
            },
        }
        print(json.dumps(out), flush=True)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0], ignore_errors=True)
    destroy_distributed()


def main() -> None:
    from moe_rl.config import ActorConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=16, help="samples per rank")
    p.add_argument("--repeats", type=int, default=3, help="timed updates per variant (median)")
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--micro-batch-size", type=int, default=4, help="padded variant")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=ActorConfig().max_tokens_per_micro_batch,
        help="packed variant's token budget per forward (default: actor.max_tokens_per_micro_batch's)",
    )
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    p.add_argument("--response-len", type=int, nargs=2, default=[16, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2, help="ranks when it launches torchrun itself")
    a = p.parse_args()
    if "LOCAL_RANK" in os.environ:  # under torchrun
        return worker(a)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={a.nproc}",
        str(Path(__file__).resolve()),
        *sys.argv[1:],
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    sys.exit(subprocess.run(cmd, cwd=REPO, env=env).returncode)


if __name__ == "__main__":
    main()
