"""Off-policy rollouts: step time with the engine sampling one batch ahead vs synchronous, printed as JSON.

Runs `torchrun --nproc-per-node=1 launch/train_moe.py` twice with the same seed, data and placement
(rollout.placement=separate: the trainer pinned to half of the cores, the engine's threads to the
other half), trainer.max_staleness=0 (synchronous) and 1 (the next step's samples are generated while
the actor trains). Responses of up to 96 tokens (WORKLOAD; the untrained toy model rarely stops early),
so generation is about a third of a synchronous step. Reports the mean wall time per step (time/step,
after the first steps: warm-up), `step_time_ratio` = async / sync, and each run's idle fractions
(time/trainer_idle and time/rollout_idle over time/step).

  python bench/async.py                  # 20 steps per run, the first 2 not measured
  python bench/async.py --steps 12 --extra sampling.max_tokens=48
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from step_time import run

WORKLOAD = ["sampling.max_tokens=96"]
VARIANTS = {
    "sync": ["trainer.max_staleness=0", "rollout.placement=separate"],
    "async": ["trainer.max_staleness=1", "rollout.placement=separate"],
}


def summary(history: list[dict], warmup: int) -> dict:
    steady = history[warmup:]
    step = statistics.mean(h["time/step"] for h in steady)
    return {
        "seconds_per_step": step,
        "seconds_per_step_all": [round(h["time/step"], 3) for h in history],
        "trainer_idle_fraction": statistics.mean(h["time/trainer_idle"] for h in steady) / step,
        "rollout_idle_fraction": statistics.mean(h["time/rollout_idle"] for h in steady) / step,
        "update_seconds": statistics.mean(h["time/update"] for h in steady),
        "staleness_max": max(h["staleness/max"] for h in history),
        "reward_mean_last": history[-1]["reward/mean"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2, help="first steps not measured")
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for both runs")
    a = p.parse_args()
    if a.steps <= a.warmup:
        p.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    extra = [*WORKLOAD, *a.extra]
    with tempfile.TemporaryDirectory() as tmp:
        results = {v: summary(run(v, a.steps, 1, extra, Path(tmp), o), a.warmup) for v, o in VARIANTS.items()}
    out = {
        "step_time_ratio": results["async"]["seconds_per_step"] / results["sync"]["seconds_per_step"],
        "sync": results["sync"],
        "async": results["async"],
        "config": {"steps": a.steps, "warmup": a.warmup, "nproc": 1, "extra": extra, "variants": VARIANTS},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
