"""Forward tokens/s of the Megatron actor on the tiny models, world 1 and world 2, as JSON.

The baseline that later overhead ratios (replay, route handling) are measured against.

  python bench/forward_throughput.py                 # all layouts, prints one JSON document
  python bench/forward_throughput.py --batch 8 --seq 256 --iters 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"world1": (1, {}), "ep2": (2, {"ep": 2}), "tp2_sp": (2, {"tp": 2}), "pp2": (2, {"pp": 2})}


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.forward import compute_logprobs
    from moe_rl.actor.model import load_model
    from moe_rl.actor.parallel import init_distributed

    parallel = ParallelConfig(**json.loads(a.parallel))
    init_distributed(parallel)
    results = {}
    for path in a.models:
        m = load_model(path, parallel)
        cfg, chunks, conv = m.hf_config, m.chunks, m.conv
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
        mask = torch.ones_like(ids)
        compute_logprobs(chunks, ids, mask, micro_batch_size=a.micro_batch)  # warm-up
        times = []
        for _ in range(a.iters):
            dist.barrier()
            t0 = time.perf_counter()
            compute_logprobs(chunks, ids, mask, micro_batch_size=a.micro_batch)
            dist.barrier()
            times.append(time.perf_counter() - t0)
        best = min(times)
        # Each data-parallel replica scores its own batch (here: the same tokens) -> job tokens/s.
        dp = ps.get_data_parallel_world_size()
        results[conv.model_type] = {"tokens_per_s": dp * a.batch * a.seq / best, "seconds": best, "dp": dp}
    if dist.get_rank() == 0:
        Path(a.result).write_text(json.dumps(results))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--parallel", default="{}", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("models", nargs="*", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)

    tmp = Path(tempfile.mkdtemp(prefix="moe-rl-bench-"))
    from moe_rl.models.tiny import TinySpec, build_tiny_model

    models = [str(build_tiny_model(TinySpec(arch=arch), tmp / arch)) for arch in ("qwen3_moe", "mixtral", "olmoe")]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = {
        "config": {
            "batch": a.batch,
            "seq": a.seq,
            "micro_batch": a.micro_batch,
            "iters": a.iters,
            "omp_threads": env["OMP_NUM_THREADS"],
            "cpus": os.cpu_count(),
        },
        "layouts": {},
    }
    for name, (nproc, par) in LAYOUTS.items():
        res = tmp / f"{name}.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(Path(__file__).resolve()),
            "--worker",
            "--parallel",
            json.dumps(par),
            "--result",
            str(res),
            "--batch",
            str(a.batch),
            "--seq",
            str(a.seq),
            "--micro-batch",
            str(a.micro_batch),
            "--iters",
            str(a.iters),
            *models,
        ]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
        out["layouts"][name] = json.loads(res.read_text())
    base = out["layouts"]["world1"]
    out["ratio_vs_world1"] = {
        name: {arch: r[arch]["tokens_per_s"] / base[arch]["tokens_per_s"] for arch in r}
        for name, r in out["layouts"].items()
        if name != "world1"
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
