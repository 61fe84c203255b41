"""In-flight weight updates against synchronous and one-step-ahead rollouts on the long-tail arithmetic task, printed
as JSON.

Builds what it needs under --out (reused when there): the small built-in model, an SFT model of the long-tail task
(2 to 8 one-digit operands: worked solutions of 5 to 65 tokens; `launch/sft_moe.py` on both cores), then trains
each mode from it with `--config-name=arithmetic_longtail_rl` on one trainer rank with the engine on the other core
(rollout.placement=separate), the same seeds, steps and samples a step, and scores each trained model on the test
split (greedy pass@1 on --test-n problems of seed 11, `moe-rl-eval`):

- sync: trainer.max_staleness=0, the engine idles while the actor trains and the actor while the engine samples;
- ahead: trainer.max_staleness=1, the next step's batch is sampled during the update (it waits for its longest);
- inflight: rollout.inflight=true, trainer.max_staleness=1, the engine never waits for a step's longest sample.

Per mode (seed means, each seed under `seeds`): tokens_per_second (response tokens trained over the steps' wall
time, the first step left out: it starts the engine's batch), engine_busy (1 - time/rollout_idle over time/step),
version_lag_mean / version_lag_max (rollout/version_lag_*), dropped_fraction, reward_per_sample (mean reward of the
trained samples) and test_pass@1. The last stdout line is one JSON object {"settings": {...}, "modes": {...}}.

  python bench/inflight.py --out /tmp/inflight            # 2 seeds, the full measure (docs/performance.md)
  python bench/inflight.py --out /tmp/inflight --quick    # 1 seed, fewer steps and problems
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TASK = ["--operands", "2", "--max_operands", "8", "--digits", "1"]  # conf/arithmetic_longtail_rl.yaml's task
SFT_TASK = ["data.arithmetic.operands=2", "data.arithmetic.max_operands=8", "data.arithmetic.digits=1"]
MODES = {
    "sync": ["trainer.max_staleness=0"],
    "ahead": ["trainer.max_staleness=1"],
    "inflight": ["rollout.inflight=true", "trainer.max_staleness=1"],
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")


def step(name: str, log: Path, cmd: list[str]) -> None:
    """Run one stage, its output in `log`; a line on stderr when it is done (or its log's tail when it failed)."""
    t0 = time.time()
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=ENV, stdout=f, stderr=subprocess.STDOUT).returncode
    if code:
        sys.exit(f"[bench] {name} failed ({log}):\n" + "".join(log.read_text().splitlines(True)[-40:]))
    print(f"[bench] {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


def sft_model(out: Path, steps: int) -> Path:
    """The long-tail task's SFT model (built once per --out)."""
    hf = out / "sft" / "hf"
    if (hf / "config.json").is_file():
        return hf
    out.mkdir(parents=True, exist_ok=True)
    step(
        "model",
        out / "model.log",
        [sys.executable, "-m", "moe_rl.tools.tiny_model", "--size", "small", "--out", str(out / "model")],
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*torchrun, "launch/sft_moe.py", f"hydra.run.dir={out / 'sft'}", f"model.path={out / 'model'}", *SFT_TASK]
    cmd += [
        f"trainer.steps={steps}",
        "trainer.val_every=0",
        "trainer.checkpoint_every=0",
        "logging.wandb.mode=disabled",
    ]
    step(f"SFT ({steps} steps)", out / "sft.log", cmd)
    return hf


def rl_run(out: Path, model: Path, mode: str, seed: int, steps: int, test_n: int) -> dict:
    """Train one mode from the SFT model and score it: its measures."""
    run = out / f"{mode}_seed{seed}"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd = [*torchrun, "launch/train_moe.py", "--config-name=arithmetic_longtail_rl", f"hydra.run.dir={run}"]
    cmd += [f"model.path={model}", f"trainer.seed={seed}", f"trainer.steps={steps}", "rollout.placement=separate"]
    cmd += ["logging.wandb.mode=disabled", *MODES[mode]]
    step(f"RL {mode} seed {seed} ({steps} steps)", out / f"{run.name}.log", cmd)
    step(
        f"export {mode} seed {seed}",
        out / f"{run.name}_export.log",
        [sys.executable, "-m", "moe_rl.tools.export_hf", str(run / "checkpoints"), "--out", str(run / "hf")],
    )
    score = test_pass(f"{mode} seed {seed}", run / "hf", test_n, out / f"{run.name}_test.log", run / "test.json")
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    samples = cfg["data"]["prompts_per_step"] * cfg["sampling"]["n"]  # one rank
    return {**measures(history, samples), "test_pass@1": score}


def test_pass(name: str, model: Path, test_n: int, log: Path, out: Path, reuse: bool = False) -> float:
    """Greedy pass@1 of `model` on `test_n` test problems of seed 11 (`moe-rl-eval`, its JSON in `out`; `reuse`: an
    `out` already there is read instead)."""
    if not (reuse and out.is_file()):
        evaluate = [sys.executable, "-m", "moe_rl.tools.evaluate", "--model", str(model), "--task", "arithmetic"]
        evaluate += [*TASK, "--split", "test", "--n", str(test_n), "--seed", "11", "--k", "1", "--temperature", "0"]
        step(f"test {name}", log, [*evaluate, "--max-tokens", "96", "--out", str(out)])
    return json.loads(out.read_text())["pass@1"]


def measures(history: list[dict], samples: int) -> dict:
    """A run's throughput, staleness and reward from its metrics.jsonl (`samples` trained a step; the first step
    left out of the times)."""
    steady = history[1:]
    seconds = sum(h["time/step"] for h in steady)
    return {
        "tokens_per_second": sum(h["response/length_mean"] * samples for h in steady) / seconds,
        "engine_busy": 1 - sum(h["time/rollout_idle"] for h in steady) / seconds,
        "seconds_per_step": seconds / len(steady),
        "version_lag_mean": statistics.mean(h["rollout/version_lag_mean"] for h in history),
        "version_lag_max": max(h["rollout/version_lag_max"] for h in history),
        "dropped_fraction": statistics.mean(h["rollout/dropped_fraction"] for h in history),
        "reward_per_sample": statistics.mean(h["reward/mean"] for h in history),
        "response_length_mean": statistics.mean(h["response/length_mean"] for h in history),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for the models, runs and logs (reused)")
    p.add_argument("--quick", action="store_true", help="one seed, 24 RL steps, 500 test problems")
    p.add_argument(
        "--sft-steps", type=int, default=300, help="SFT steps of the long-tail model (greedy val pass@1 0.52 at 300)"
    )
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 40, --quick 24)")
    p.add_argument("--test-n", type=int, default=None, help="test problems (default 1000, --quick 500)")
    a = p.parse_args()
    seeds = [7] if a.quick else [7, 8]
    steps = a.steps or (24 if a.quick else 40)
    test_n = a.test_n or (500 if a.quick else 1000)
    t0 = time.time()
    model = sft_model(a.out.resolve(), a.sft_steps)
    sft_pass = test_pass("SFT", model, test_n, a.out / "sft_test.log", a.out / "sft_test.json", reuse=True)
    modes = {}
    for mode in MODES:
        runs = {str(s): rl_run(a.out.resolve(), model, mode, s, steps, test_n) for s in seeds}
        modes[mode] = {k: statistics.mean(r[k] for r in runs.values()) for k in next(iter(runs.values()))}
        modes[mode]["version_lag_max"] = max(r["version_lag_max"] for r in runs.values())
        modes[mode]["seeds"] = runs
    settings = {
        "config": "arithmetic_longtail_rl",
        "max_staleness": 1,
        "steps": steps,
        "seeds": seeds,
        "test_problems": test_n,
        "sft_steps": a.sft_steps,
        "sft_test_pass@1": sft_pass,
        "placement": "separate (1 trainer rank, the engine on the other core)",
        "minutes": round((time.time() - t0) / 60, 1),
    }
    ratios = {
        "inflight_over_sync": modes["inflight"]["tokens_per_second"] / modes["sync"]["tokens_per_second"],
        "inflight_over_ahead": modes["inflight"]["tokens_per_second"] / modes["ahead"]["tokens_per_second"],
    }
    print(json.dumps({"settings": settings, "ratios": ratios, "modes": modes}))


if __name__ == "__main__":
    main()
