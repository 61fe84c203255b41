"""rollout.cpu_busy_loop_s: vLLM's 1 s spin after each engine message vs moe-rl's 0.05 s, printed as JSON.

Runs `torchrun --nproc-per-node=2 launch/train_moe.py` twice with the same seed and data: `vllm_default`
(rollout.cpu_busy_loop_s=null: the engine core and workers spin on sched_yield for 1 s after each message, on
the cores the trainer's ranks use) and `short` (0.05 s, the default). Reports each run's mean seconds per phase
(steps after the first), the step-time ratio short / vllm_default, and how many non-timing metric values differ
between the runs (0: the spin changes no result).

  python bench/engine_spin.py               # 2 ranks, 8 steps per run
"""

from __future__ import annotations

import json

from step_time import phases, run_variants

VARIANTS = {"vllm_default": ["rollout.cpu_busy_loop_s=null"], "short": []}


def main() -> None:
    a, runs = run_variants(__doc__, VARIANTS, steps=8)
    times = {v: phases(h) for v, h in runs.items()}
    compared = [
        (x[k], y.get(k))
        for x, y in zip(runs["vllm_default"], runs["short"], strict=True)
        for k in x
        if not k.startswith(("time/", "perf/", "memory/"))
    ]
    out = {
        "step_time_ratio": times["short"]["step"] / times["vllm_default"]["step"],
        "seconds_per_step": times,
        "metric_values_compared": len(compared),
        "metric_values_differing": sum(x != y for x, y in compared),
        "config": {"steps": a.steps, "nproc": a.nproc, "extra": a.extra, "variants": VARIANTS},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
