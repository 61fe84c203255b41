"""RL step time breakdown of `torchrun launch/train_moe.py`, printed as JSON.

Runs the trainer twice with the same seed and data, side by side:
  r3   routes captured by the engine, moved into the padded batch and replayed (the default);
  off  no capture (rollout.capture=none), no replay.
Reports each run's mean seconds per phase (time/<phase>, steps after the first: warm-up) and
the R3 overhead: route handling (padding + route tensors, a phase of its own) and the whole
step-time difference r3 - off (capture in the engine, route transport, replay in the
old-log-prob and update passes) as fractions of the R3 step.

  python bench/step_time.py                       # 2 ranks, 8 steps per run
  python bench/step_time.py --steps 12 --nproc 2 --extra sampling.max_tokens=48
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "r3": ["actor.router_replay=r3"],
    "off": ["actor.router_replay=off", "rollout.capture=none"],
}


def run(variant: str, steps: int, nproc: int, extra: list[str], root: Path, overrides: list[str] | None = None):
    """metrics.jsonl of one trainer run (`overrides`: the variant's; default VARIANTS[variant])."""
    run_dir = root / variant
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(REPO / "launch" / "train_moe.py"),
        f"hydra.run.dir={run_dir}",
        f"trainer.steps={steps}",
        "trainer.checkpoint_every=0",
        "logging.wandb.mode=disabled",
        "logging.router_agreement_every=0",
        *(VARIANTS[variant] if overrides is None else overrides),
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{variant} run failed:\n{(proc.stdout + proc.stderr)[-5000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run_variants(doc: str, variants: dict[str, list[str]], steps: int = 8) -> tuple[argparse.Namespace, dict]:
    """The A/B benches' shared command line (--steps, --nproc, --extra) and each variant's metrics history, run
    one after the other with the same seed and data."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return a, {v: run(v, a.steps, a.nproc, a.extra, Path(tmp), o) for v, o in variants.items()}


def phases(history: list[dict]) -> dict[str, float]:
    steady = history[1:]  # the first step pays one-off costs (first engine batch, allocations)
    totals = ("time/step", "time/trainer_idle", "time/rollout_idle")  # not phases: wall and idle times
    keys = sorted({k for h in steady for k in h if k.startswith("time/") and k not in totals})
    out = {k[5:]: statistics.mean(h.get(k, 0.0) for h in steady) for k in keys}
    out["step"] = sum(out.values())
    return out


def main() -> None:
    a, runs = run_variants(__doc__, VARIANTS)
    results = {v: phases(h) for v, h in runs.items()}
    r3, off = results["r3"], results["off"]
    print(
        json.dumps(
            {
                "config": {"steps": a.steps, "nproc": a.nproc, "extra": a.extra, "measured_steps": a.steps - 1},
                "seconds_per_step": results,
                "r3_over_off_step_ratio": r3["step"] / off["step"],
                "r3_overhead_fraction_of_step": (r3["step"] - off["step"]) / r3["step"],
                "phase_ratios_r3_over_off": {k: r3[k] / off[k] for k in r3 if k in off and off[k] > 0},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
