"""Peak memory and time of an RL step with the fused kernels on vs off, printed as JSON.

The fused linear -> log-prob kernel (actor.fused_logprob) never holds the [tokens, vocab]
logits whole; the fused loss (algorithm.fused_loss) keeps no [tokens] temporaries for autograd.
Both matter at a real vocabulary: this builds the tiny qwen3_moe with Qwen3's 151,936-token
vocabulary (hidden 64, 2 layers) and runs `torchrun launch/train_moe.py` twice with the same
seed and data, kernels on and off. Per run: the largest `memory/peak_rss_gib` of any step (max
over ranks of the trainer process's peak RSS during the step; engines excluded) and the mean
step time after the first step.

  python bench/step_memory.py        # 2 ranks, 4 prompts x 8 samples x 48 tokens per rank, 3 steps
  python bench/step_memory.py --steps 4 --extra actor.micro_batch_size=8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from step_time import REPO, phases, run

VARIANTS = {
    "fused": ["actor.fused_logprob=true", "algorithm.fused_loss=true"],
    "unfused": ["actor.fused_logprob=false", "algorithm.fused_loss=false"],
}
# one micro-batch of 32 samples per rank: 4 prompts x 8 samples, 48 new tokens
WORKLOAD = [
    "data.prompts_per_step=4",
    "sampling.n=8",
    "sampling.max_tokens=48",
    "actor.mini_batches=1",
    "actor.micro_batch_size=32",
]
MODEL = ["--arch", "qwen3_moe", "--vocab-size", "151936", "--hidden", "64", "--layers", "2"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for both runs")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "tiny_151936"
        cmd = [sys.executable, "-m", "moe_rl.tools.tiny_model", *MODEL, "--out", str(model)]
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
        overrides = [f"model.path={model}", *WORKLOAD, *a.extra]
        results = {}
        for name, switches in VARIANTS.items():
            history = run(name, a.steps, a.nproc, overrides, Path(tmp), switches)
            results[name] = {
                "peak_rss_gib": max(h["memory/peak_rss_gib"] for h in history),
                "peak_rss_gib_per_step": [round(h["memory/peak_rss_gib"], 3) for h in history],
                "seconds_per_step": phases(history)["step"],
                "update_seconds": statistics.mean(h["time/update"] for h in history[1:]),
                "reward_mean": [h["reward/mean"] for h in history],
            }
    fused, unfused = results["fused"], results["unfused"]
    print(
        json.dumps(
            {
                "config": {"steps": a.steps, "nproc": a.nproc, "model": MODEL, "workload": WORKLOAD, "extra": a.extra},
                "runs": results,
                "peak_rss_ratio_fused_over_unfused": fused["peak_rss_gib"] / unfused["peak_rss_gib"],
                "step_time_ratio_fused_over_unfused": fused["seconds_per_step"] / unfused["seconds_per_step"],
                "update_time_ratio_fused_over_unfused": fused["update_seconds"] / unfused["update_seconds"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
