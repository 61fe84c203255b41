"""True on-policy mode vs the default: what bitwise-equal log-probs cost per step, printed as JSON.

Runs `torchrun --nproc-per-node=2 launch/train_moe.py` twice with the same seed and data: the default (megatron's
forward for log pi_old) and trainer.true_on_policy=true (log pi_old through the engine's own ops on weights
gathered after every update; pi_theta's first-mini-batch values from that pass). Reports each run's mean
seconds per phase (time/<phase>, steps after the first), the step-time ratio on / off, and each run's largest
mismatch/logprob_abs_diff_max and smallest mismatch/exact_fraction (0.0 and 1.0 when the mode holds).

  python bench/true_on_policy.py              # 2 ranks, 5 steps per run
  python bench/true_on_policy.py --steps 8 --extra model.dtype=bfloat16 rollout.dtype=bfloat16
"""

from __future__ import annotations

import json

from step_time import phases, run_variants

VARIANTS = {"off": [], "on": ["trainer.true_on_policy=true"]}


def main() -> None:
    a, runs = run_variants(__doc__, VARIANTS, steps=5)
    times = {v: phases(h) for v, h in runs.items()}
    out = {
        "step_time_ratio": times["on"]["step"] / times["off"]["step"],
        "seconds_per_step": times,
        "logprob_abs_diff_max": {v: max(x["mismatch/logprob_abs_diff_max"] for x in h) for v, h in runs.items()},
        "exact_fraction_min": {v: min(x["mismatch/exact_fraction"] for x in h) for v, h in runs.items()},
        "config": {"steps": a.steps, "nproc": a.nproc, "extra": a.extra, "variants": VARIANTS},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
