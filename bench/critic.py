"""PPO with a critic vs GRPO: what the critic costs per step, printed as JSON.

Runs `torchrun --nproc-per-node=2 launch/train_moe.py` twice with the same seed and data: the default GRPO
advantages (algorithm.advantage=grpo, GSPO + IcePop) and PPO with a critic (algorithm.advantage=gae
algorithm/loss=ppo: one more MoE model with its optimizer per rank, a values pass and a critic update
per step). Reports each run's mean seconds per phase (time/<phase>, steps after the first), the step-time
ratio gae / grpo, and the peak resident memory of a trainer rank (memory/peak_rss_gib, largest step).

  python bench/critic.py                 # 2 ranks, 8 steps per run
  python bench/critic.py --steps 12
"""

from __future__ import annotations

import json

from step_time import phases, run_variants

VARIANTS = {
    "grpo": [],
    "gae": ["algorithm.advantage=gae", "algorithm/loss=ppo"],
}


def main() -> None:
    a, runs = run_variants(__doc__, VARIANTS, steps=8)
    times = {v: phases(h) for v, h in runs.items()}
    memory = {v: max(x["memory/peak_rss_gib"] for x in h) for v, h in runs.items()}
    out = {
        "step_time_ratio_gae_over_grpo": times["gae"]["step"] / times["grpo"]["step"],
        "peak_rss_gib": memory,
        "peak_rss_ratio_gae_over_grpo": memory["gae"] / memory["grpo"],
        "seconds_per_step": times,
        "config": {"steps": a.steps, "nproc": a.nproc, "extra": a.extra, "variants": VARIANTS},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
