"""Replay buffer: samples generated until the policy reaches a mean reward of 0.8 on the toy task, with no
buffer, a uniform buffer and an advantage-prioritized one (3 seeds each), printed as JSON.

Each run is `torchrun --nproc-per-node=1 launch/train_moe.py` for --steps steps at trainer.seed=<seed>. A run
"reaches" the target at the first step whose freshly generated samples (the current policy's: reward/mean
without a buffer, buffer/fresh_reward_mean with one) have a mean reward >= --target; samples generated
count every generation batch up to that step (data.prompts_per_step x sampling.n per batch). Reports
per variant the samples of each seed (null: not reached within --steps), their mean and standard deviation
over the seeds that reached it, and `samples_ratio` = variant mean / no-buffer mean.

  python bench/buffer.py                      # 40 steps, seeds 1 2 3
  python bench/buffer.py --steps 30 --seeds 1 2 --target 0.7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from step_time import run

PROMPTS, N = 4, 8  # data.prompts_per_step and sampling.n of the default config
VARIANTS = {
    "no_buffer": [],
    "uniform": ["buffer.enable=true", "buffer.priority=uniform"],
    "advantage": ["buffer.enable=true", "buffer.priority=advantage"],
}


def samples_to_target(history: list[dict], target: float) -> int | None:
    generated = 0
    for h in history:
        generated += int(h.get("buffer/generation_batches", 1)) * PROMPTS * N
        if h.get("buffer/fresh_reward_mean", h["reward/mean"]) >= target:
            return generated
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    a = p.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            per_seed = {}
            for seed in a.seeds:
                cfg = [*overrides, f"trainer.seed={seed}", f"data.prompts_per_step={PROMPTS}", f"sampling.n={N}"]
                history = run(f"{name}_{seed}", a.steps, 1, a.extra, Path(tmp), cfg)
                per_seed[seed] = samples_to_target(history, a.target)
            reached = [v for v in per_seed.values() if v is not None]
            out[name] = {
                "samples_per_seed": per_seed,
                "samples_mean": statistics.mean(reached) if reached else None,
                "samples_std": statistics.stdev(reached) if len(reached) > 1 else None,
                "reached": f"{len(reached)}/{len(per_seed)}",
            }
    base = out["no_buffer"]["samples_mean"]
    for v in out.values():
        v["samples_ratio"] = v["samples_mean"] / base if base and v["samples_mean"] else None
    out["config"] = {"steps": a.steps, "seeds": a.seeds, "target": a.target, "extra": a.extra, "variants": VARIANTS}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
