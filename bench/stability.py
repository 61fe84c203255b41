"""Stability lab: what routing replay, IcePop and true on-policy do to a small MoE's RL on the arithmetic task.

Every cell is the arithmetic recipe's RL stage (conf/arithmetic_rl.yaml: GSPO, 512 samples a step, actor.lr=2e-4)
started from one SFT model, with one setting changed: the replay (R3, R2, none), the correction (IcePop, TIS,
none), the engine and actor dtypes, the engine's lm_head dtype, true on-policy, or off-policy updates (4
mini-batches and one step of staleness, so pi_theta drifts from pi_old and mu). Per run: validation pass@1 (greedy,
200 val problems) every --val-every steps with a checkpoint there, test pass@1 (greedy, 500 test problems) of the
last step and of the step that validation picks, the reward curve, mismatch/k3_kl (mean, median, largest step),
icepop/masked_fraction, router/agreement, grad-norm spikes
(a step above 10x the median of the steps before it) and a collapse flag (validation pass@1 ends >= 0.10 below its
best, or a 5-step mean reward falls below half of the best one before it). Once per lab, on the SFT model itself,
`moe-rl-diagnose live` with the matrix's default dtypes (bf16 engine, fp32 actor) on 400 train problems: how many
tokens see a routing difference in their context, and how much of the k3 mismatch sits on them with and without
replay (`routing_split`: what replay can reach at all).

  python bench/stability.py --quick --sft OUT/sft/hf            # 3 cells, one seed (bf16 engine + fp32 actor)
  python bench/stability.py --sft OUT/sft/hf --out /tmp/lab      # the whole matrix, 2 seeds
  python bench/stability.py --quick                              # builds the SFT model first (the recipe's stage)
  python bench/stability.py --quick --size deep --out /tmp/deep  # the same stages on the 12-layer model (~35 min)
  python bench/stability.py --report --out /tmp/lab              # the table and curves again from its JSON

Prints one JSON line {"cells": [...], "routing_split": {...}, "settings": {...}}; OUT holds it (stability.json), each
run's folder and log, the curves (reward.png, k3_kl.png, val_pass1.png) and the table (table.md) that
docs/stability.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT_STEPS = 900  # the recipe's SFT stage (launch/recipes/arithmetic.sh)
TEST_PROBLEMS = 500
SPLIT_PROBLEMS = 400  # routing_split: train problems sampled once each from the SFT model


@dataclass(frozen=True)
class Cell:
    replay: str  # actor.router_replay: r3 | r2 | off
    correction: str  # algorithm/correction: icepop | tis | none
    engine_dtype: str = "bfloat16"
    actor_dtype: str = "float32"
    true_on_policy: bool = False
    off_policy: bool = False
    head_dtype: str = "model"  # rollout.head_dtype: model | float32

    @property
    def name(self) -> str:
        parts = [f"{self.replay}+{self.correction}", f"engine-{self.engine_dtype}", f"actor-{self.actor_dtype}"]
        parts += ["true-on-policy"] * self.true_on_policy + ["off-policy"] * self.off_policy
        parts += [f"head-{self.head_dtype}"] * (self.head_dtype != "model")
        return "_".join(parts)

    def overrides(self) -> list[str]:
        out = [
            f"actor.router_replay={self.replay}",
            f"algorithm/correction={self.correction}",
            f"rollout.dtype={self.engine_dtype}",
            f"model.dtype={self.actor_dtype}",
            f"rollout.head_dtype={self.head_dtype}",
        ]
        if self.true_on_policy:
            out.append("trainer.true_on_policy=true")
        if self.off_policy:
            out += ["actor.mini_batches=4", "trainer.max_staleness=1"]
        return out


BF16 = {"engine_dtype": "bfloat16", "actor_dtype": "bfloat16"}
MATRIX = [
    Cell("off", "none"),
    Cell("r2", "icepop"),
    Cell("r3", "none"),
    Cell("off", "icepop"),
    Cell("r3", "icepop"),  # the defaults
    Cell("r3", "tis"),
    Cell("r3", "icepop", head_dtype="float32"),
    Cell("off", "none", **BF16),
    Cell("r3", "icepop", **BF16),
    Cell("off", "none", **BF16, true_on_policy=True),
    Cell("off", "none", off_policy=True),
    Cell("r3", "icepop", off_policy=True),
]
QUICK = [Cell("off", "none"), Cell("off", "icepop"), Cell("r3", "icepop")]


def run(cmd: list[str], log: Path, timeout: float) -> None:
    """Run a command with its output in `log`; a failure raises with the log's end."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
    with log.open("w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode:
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}); the end of {log}:\n{tail}")


def torchrun(script: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, *args]


def build_sft(out: Path, size: str = "small") -> Path:
    """The recipe's model and SFT stages, with the built-in model of `size` (the recipe's: small): OUT/sft/hf."""
    if (out / "sft" / "hf" / "config.json").is_file():
        return out / "sft" / "hf"
    run([sys.executable, "-m", "moe_rl.tools.tiny_model", "--size", size, "--out", str(out / "model")],
        out / "model.log", 300)  # fmt: skip
    sft_args = [f"hydra.run.dir={out / 'sft'}", f"model.path={out / 'model'}", f"trainer.steps={SFT_STEPS}"]
    sft_args += ["trainer.val_every=100", "trainer.checkpoint_every=0", "logging.wandb.mode=disabled"]
    run(torchrun("launch/sft_moe.py", *sft_args), out / "sft.log", 3600)
    return out / "sft" / "hf"


def test_pass1(checkpoint: Path, work: Path, name: str) -> float:
    """Greedy pass@1 on the test split of the model at `checkpoint` (exported to an HF folder first)."""
    hf = work / f"{name}_hf"
    run([sys.executable, "-m", "moe_rl.tools.export_hf", str(checkpoint), "--out", str(hf)], work / f"{name}.log", 600)
    result = work / f"{name}_eval.json"
    evaluate = [sys.executable, "-m", "moe_rl.tools.evaluate", "--model", str(hf), "--split", "test"]
    evaluate += ["--n", str(TEST_PROBLEMS), "--k", "1", "--out", str(result)]
    run(evaluate, work / f"{name}_eval.log", 900)
    shutil.rmtree(hf)
    return json.loads(result.read_text())["pass@1"]


def routing_split(sft: Path, out: Path) -> dict:
    """`moe-rl-diagnose live` on the SFT model (bf16 engine, fp32 actor, the matrix's defaults): its report's router
    disagreement, k3 with and without replay, and `mismatch_by_routing`."""
    work = out / "routing_split"
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    tasks = [sys.executable, "-m", "moe_rl.data.tasks", "arithmetic", "--split", "train"]
    run([*tasks, "--n", str(SPLIT_PROBLEMS), "--seed", "5", "--out", str(prompts)], work / "prompts.log", 300)
    diagnose = [sys.executable, "-m", "moe_rl.diagnostics", "live", "--model", str(sft), "--prompts", str(prompts)]
    diagnose += ["--dtype", "bfloat16", "--actor-dtype", "float32", "--samples", str(SPLIT_PROBLEMS)]
    diagnose += ["--max-tokens", "24", "--out", str(work), "--no-plots"]
    run(diagnose, work / "diagnose.log", 900)
    return split_summary(json.loads((work / "report.json").read_text()))


def split_summary(report: dict) -> dict:
    """The part of a moe-rl-diagnose report the lab keeps."""
    m = report["mismatch"]
    return {
        "samples": report["source"]["samples"],
        "response_tokens": report["source"]["response_tokens"],
        "token_layer_disagreement": report["router"]["disagreement"],
        "token_any_disagreement": report["router"]["token_any_disagreement"],
        "k3_kl_without_replay": m["without_replay"]["k3_kl"],
        "k3_kl_with_replay": m["with_replay"]["k3_kl"],
        **report["mismatch_by_routing"],
    }


def split_lines(split: dict) -> str:
    """routing_split as Markdown for table.md."""
    d, a = split["routed_differently"], split["routed_alike"]
    total = d["tokens"] + a["tokens"]

    def g(v: float | None, spec: str) -> str:  # a group without tokens (or without k3) has no mean or share
        return "–" if v is None else format(v, spec)

    return (
        f"\nRouting on the SFT model (bf16 engine, fp32 actor, {split['samples']} samples): "
        f"{100 * split['token_layer_disagreement']:.2f} % of token-layers and "
        f"{100 * split['token_any_disagreement']:.1f} % of tokens routed differently; "
        f"k3 {split['k3_kl_without_replay']:.3g} without replay, "
        f"{split['k3_kl_with_replay']:.3g} with.\n\n"
        "| response tokens | share | k3 without replay | k3 with replay | share of k3 without | share of k3 with |\n"
        "|---|---|---|---|---|---|\n"
        + "".join(
            f"| {label} | {r['tokens'] / total:.2f} | {g(r['k3_kl_without_replay'], '.3g')} | "
            f"{g(r['k3_kl_with_replay'], '.3g')} | {g(r['k3_share_without_replay'], '.2f')} | "
            f"{g(r['k3_share_with_replay'], '.2f')} |\n"
            for label, r in (("a routing difference in their context", d), ("none", a))
        )
    )


def spikes(grad_norms: list[float], factor: float = 10.0, warmup: int = 5) -> int:
    """Steps whose grad norm is above `factor` times the median of the steps before it (after `warmup` steps)."""
    return sum(g > factor * statistics.median(grad_norms[:i]) for i, g in enumerate(grad_norms) if i >= warmup)


def collapsed(val: dict[int, float], rewards: list[float], window: int = 5) -> bool:
    """Validation pass@1 ends >= 0.10 below its best (and did not come back), or a `window`-step mean reward falls
    below half of the best window mean before it."""
    if val and max(val.values()) - val[max(val)] >= 0.10:
        return True
    means = [statistics.fmean(rewards[i : i + window]) for i in range(len(rewards) - window + 1)]
    best = 0.0
    for m in means:
        if m < best / 2:
            return True
        best = max(best, m)
    return False


def refusal(cell: Cell) -> str | None:
    """Why the trainer would refuse this cell on this machine (its config check, e.g. true on-policy with a bf16
    engine on a CPU with AMX), or None."""
    # heavy: hydra and moe-rl's config (torch), imported on first use
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from moe_rl.config import ConfigError
    from moe_rl.config.store import register_configs
    from moe_rl.config.validate import validate

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="arithmetic_rl", overrides=cell.overrides()))
    try:
        validate(cfg, world_size=2)
    except ConfigError as e:
        return str(e)
    return None


def run_cell(cell: Cell, seed: int, sft: Path, out: Path, steps: int, val_every: int) -> dict:
    name = f"{cell.name}_seed{seed}"
    work = out / name
    if work.exists():
        shutil.rmtree(work)
    args = ["--config-name=arithmetic_rl", f"hydra.run.dir={work}", f"model.path={sft}", f"trainer.steps={steps}"]
    args += [f"trainer.val_every={val_every}", f"trainer.checkpoint_every={val_every}", "trainer.checkpoint_keep=0"]
    args += [f"trainer.seed={seed}", f"sampling.seed={seed}", f"logging.router_agreement_every={val_every}"]
    args += ["logging.wandb.mode=disabled", *cell.overrides()]
    start = time.perf_counter()
    run(torchrun("launch/train_moe.py", *args), out / f"{name}.log", 3600)
    minutes = (time.perf_counter() - start) / 60
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if "reward/mean" in r]
    val = {r["step"]: r["val/pass@1"] for r in records if "val/pass@1" in r}
    best_step = max((s for s in val if s > 0), key=lambda s: (val[s], -s), default=steps)
    checkpoints = work / "checkpoints"
    final = test_pass1(checkpoints / f"step_{steps:06d}", work, "final")
    best = final if best_step == steps else test_pass1(checkpoints / f"step_{best_step:06d}", work, "best")
    shutil.rmtree(checkpoints)

    def series(key: str) -> list[float]:
        return [r[key] for r in steps_ if key in r]

    rewards, k3 = series("reward/mean"), series("mismatch/k3_kl")
    masked, agreement, ppo_kl = series("icepop/masked_fraction"), series("router/agreement"), series("actor/ppo_kl")
    return {
        "name": cell.name,
        **asdict(cell),
        "seed": seed,
        "steps": steps,
        "minutes": round(minutes, 1),
        **k3_stats(k3),
        "icepop_masked_fraction_mean": statistics.fmean(masked) if masked else None,
        "router_agreement_mean": statistics.fmean(agreement) if agreement else None,
        "ppo_kl_mean": statistics.fmean(ppo_kl) if ppo_kl else None,
        "val_pass@1": {str(s): v for s, v in sorted(val.items())},
        "best_step": best_step,
        "test_pass@1": final,
        "best_test_pass@1": best,
        "reward_first5": statistics.fmean(rewards[:5]),
        "reward_last5": statistics.fmean(rewards[-5:]),
        "collapsed": collapsed(val, rewards),
        "grad_norm_spikes": spikes(series("actor/grad_norm")),
        "curves": {"reward": rewards, "k3_kl": k3},
    }


def k3_stats(k3: list[float]) -> dict[str, float | None]:
    """Mean, median and largest per-step mismatch/k3_kl of a run: the mean follows the rare steps where a sample's
    log-probs part far (a flipped expert), the median the typical step."""
    if not k3:
        return {"k3_kl_mean": None, "k3_kl_median": None, "k3_kl_max": None}
    return {"k3_kl_mean": statistics.fmean(k3), "k3_kl_median": statistics.median(k3), "k3_kl_max": max(k3)}


def table(cells: list[dict]) -> str:
    """The Markdown table: one row per setting, the seeds' values side by side."""
    rows = [
        "| replay | correction | engine / actor | mode | test pass@1 (last) | test pass@1 (best val step) | "
        "k3 KL mean | k3 KL median | k3 KL max | IcePop masked | router agreement | reward first 5 → last 5 | "
        "spikes | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_name: dict[str, list[dict]] = {}
    for c in cells:
        by_name.setdefault(c["name"], []).append(c)

    def joined(runs: list[dict], key: str, fmt: str) -> str:
        return " / ".join("–" if r[key] is None else format(r[key], fmt) for r in runs)

    for runs in by_name.values():
        c = runs[0]
        mode = "true on-policy" if c["true_on_policy"] else "off-policy" if c["off_policy"] else "on-policy"
        dtypes = c["engine_dtype"].replace("bfloat16", "bf16").replace("float32", "fp32")
        dtypes += " (fp32 head) / " if c.get("head_dtype") == "float32" else " / "
        dtypes += c["actor_dtype"].replace("bfloat16", "bf16").replace("float32", "fp32")
        reward = " / ".join(f"{r['reward_first5']:.2f} → {r['reward_last5']:.2f}" for r in runs)
        rows.append(
            f"| {c['replay']} | {c['correction']} | {dtypes} | {mode} | {joined(runs, 'test_pass@1', '.3f')} | "
            f"{joined(runs, 'best_test_pass@1', '.3f')} | {joined(runs, 'k3_kl_mean', '.2e')} | "
            f"{joined(runs, 'k3_kl_median', '.2e')} | {joined(runs, 'k3_kl_max', '.2e')} | "
            f"{joined(runs, 'icepop_masked_fraction_mean', '.1e')} | {joined(runs, 'router_agreement_mean', '.4f')} | "
            f"{reward} | {joined(runs, 'grad_norm_spikes', 'd')} | {' / '.join(str(r['collapsed']) for r in runs)} |"
        )
    return "\n".join(rows) + "\n"


def plots(cells: list[dict], out: Path) -> None:
    """reward.png, k3_kl.png, val_pass1.png: one line per setting, the mean over its seeds (per step)."""
    # heavy: matplotlib, imported on first use
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name: dict[str, list[dict]] = {}
    for c in cells:
        by_name.setdefault(c["name"], []).append(c)

    def mean(series: list[list[float]]) -> list[float]:
        return [statistics.fmean(values) for values in zip(*series, strict=False)]

    def figure(name: str, ylabel: str, lines: dict[str, tuple[list[int], list[float]]], log: bool = False) -> None:
        fig, ax = plt.subplots(figsize=(11, 4.5))
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # a colour per setting (12 > the default cycle's 10)
        for label, (x, y) in lines.items():
            ax.plot(x, y, label=label, lw=1, marker="o" if len(x) < 8 else None)
        ax.set(xlabel="step", ylabel=ylabel, yscale="log" if log else "linear")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)

    for key, ylabel, log in (("reward", "reward/mean", False), ("k3_kl", "mismatch/k3_kl", True)):
        lines = {}
        for name, runs in by_name.items():
            y = mean([r["curves"][key] for r in runs])
            if not (log and max(y, default=0) <= 0):  # true on-policy's k3 is 0: nothing to draw on a log scale
                lines[name] = (list(range(1, len(y) + 1)), y)
        figure(f"{key}.png", f"{ylabel} (mean of {len(next(iter(by_name.values())))} seeds)", lines, log)
    lines = {}
    for name, runs in by_name.items():
        steps = sorted({int(s) for r in runs for s in r["val_pass@1"]})
        lines[name] = (steps, [statistics.fmean(r["val_pass@1"][str(s)] for r in runs) for s in steps])
    figure("val_pass1.png", "val/pass@1 (greedy, 200 problems)", lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 cells (no replay + no correction, IcePop alone, "
                        "R3 + IcePop; bf16 engine, fp32 actor), one seed")  # fmt: skip
    parser.add_argument("--sft", type=Path, help="the SFT model (an HF folder); default: build it (the recipe's SFT)")
    parser.add_argument("--size", choices=("small", "deep"), default="small", help="without --sft: the built-in "
                        "model the SFT stage starts from (small: the recipe's 6 layers; deep: 12 layers)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("/tmp/stability"), help="where runs, plots and JSON go")
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run (30: the full matrix fits 90 min)")
    parser.add_argument("--val-every", type=int, default=10, help="validation (and checkpoint) interval")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: 1 (--quick) or 1 2")
    parser.add_argument("--report", action="store_true", help="run nothing: the table and curves again from "
                        "--out's stability.json")  # fmt: skip
    a = parser.parse_args(argv)
    if a.report:
        report = json.loads((a.out / "stability.json").read_text())
        for cell in report["cells"]:
            cell.update(k3_stats(cell["curves"]["k3_kl"]))
        return write_report(report, a.out)
    if a.steps % a.val_every:
        parser.error(f"--steps {a.steps} must be a multiple of --val-every {a.val_every} (the last step is scored)")
    if a.sft is not None and not (a.sft / "config.json").is_file():
        parser.error(f"--sft {a.sft}: no config.json there (an HF folder, e.g. the recipe's OUT_DIR/sft/hf)")
    a.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    cells, seeds = (QUICK, a.seeds or [1]) if a.quick else (MATRIX, a.seeds or [1, 2])
    # cells this machine's trainer refuses: said before any work (the SFT build included), left out, listed in the JSON
    not_run = [{"name": c.name, "why": why} for c in cells if (why := refusal(c))]
    for skipped in not_run:
        print(f"[stability] {skipped['name']}: not run on this machine: {skipped['why']}", file=sys.stderr, flush=True)
    cells = [c for c in cells if c.name not in {n["name"] for n in not_run}]
    if a.sft is None and (built := a.out / "model" / "config.json").is_file():  # an earlier lab's, reused
        # heavy: moe-rl (torch), imported on first use
        from moe_rl.models.tiny import SIZES

        layers = json.loads(built.read_text())["num_hidden_layers"]
        if layers != SIZES[a.size]["layers"]:
            parser.error(f"--out {a.out} holds a {layers}-layer model, not --size {a.size}'s: use another --out")
    sft = a.sft.resolve() if a.sft else build_sft(a.out.resolve(), a.size)
    split = routing_split(sft, a.out.resolve())
    results = []
    for i, (cell, seed) in enumerate((c, s) for c in cells for s in seeds):
        r = run_cell(cell, seed, sft, a.out.resolve(), a.steps, a.val_every)
        results.append(r)
        print(f"[stability] {i + 1}/{len(cells) * len(seeds)} {r['name']} seed {seed}: test pass@1 "
              f"{r['test_pass@1']:.3f} (best-val step {r['best_step']}: {r['best_test_pass@1']:.3f}), k3 "
              f"{r['k3_kl_mean']}, {r['minutes']} min", file=sys.stderr, flush=True)  # fmt: skip
    settings = {
        "sft": str(sft),
        "size": None if a.sft else a.size,
        "steps": a.steps,
        "val_every": a.val_every,
        "seeds": seeds,
        "quick": a.quick,
        "not_run": not_run,
        "minutes": round((time.perf_counter() - start) / 60, 1),
    }
    return write_report({"cells": results, "routing_split": split, "settings": settings}, a.out)


def write_report(report: dict, out: Path) -> int:
    """stability.json, table.md and the curves in `out`; the JSON line (without the curves) on stdout."""
    (out / "stability.json").write_text(json.dumps(report, indent=1) + "\n")
    split = report.get("routing_split")  # absent in a stability.json written before it was measured
    (out / "table.md").write_text(table(report["cells"]) + (split_lines(split) if split else ""))
    plots(report["cells"], out)
    cells = [{k: v for k, v in r.items() if k != "curves"} for r in report["cells"]]
    print(json.dumps({"cells": cells, "routing_split": split, "settings": report["settings"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
