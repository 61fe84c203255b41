"""moe-rl against TRL's GRPOTrainer on the same machine: step time, whole-command time and reward per step,
printed as one JSON line.

Both sides train the same model (moe-rl's built-in tiny Qwen3-MoE, or a 107M-parameter one built the same way)
on moe-rl's toy task and reward (moe_rl.data.rewards.toy_low_token_reward, called by both), with the same batch
(8 prompts x 8 samples a step, 2 mini-batches), learning rate, Adam settings, gradient clip, GSPO clip (TRL:
importance_sampling_level="sequence", loss_type="grpo") and generation length, synchronously (no sampling ahead)
and in the same precision. moe-rl runs its defaults (`torchrun --nproc-per-node=2 launch/train_moe.py`, one
thread per rank) plus MOE_RL_OVERRIDES; TRL runs in one process with 2 threads, transformers' generation, from
an environment of its own that this bench creates once (TRL is not a dependency of moe-rl).

A step is one RL step: the generation of its 64 samples and the 2 mini-batch updates on them (TRL: optimizer
steps 2k-1 and 2k). The mean step leaves the first out (start-up work both sides do there). Each round also gives
each side's time outside its steps (the whole command less every step: start-up, checkpoints, exit), and the bench
times once what each side's process imports before it can start (`import_seconds`), a floor under that time.

  python bench/vs_trl.py                         # both sizes (about 10 minutes on 2 cores)
  python bench/vs_trl.py --sizes toy             # the built-in model, 30 steps
  python bench/vs_trl.py --sizes 107m --steps 4  # fewer steps at the 107M size
  python bench/vs_trl.py --sizes toy --repeats 3 # 3 rounds, which side goes first alternating: the ratios' medians
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Settings the moe-rl side runs with beyond its defaults, at both sizes (empty: the defaults). Each must keep the
# comparison fair: the same algorithm, batch, precision and synchronous sampling as the TRL side, which follows
# model.dtype (bfloat16: TRL's bf16=True, accelerate's autocast over fp32 weights; moe-rl: bf16 weights with fp32
# masters, and the engine in bf16, as transformers' generation runs under that autocast). The other three give moe-rl
# the TRL side's bookkeeping (bench/trl_side.py: report_to="none", save_strategy="no", no routing diagnostic): no
# wandb run, no checkpoint, no router-agreement forward (a diagnostic TRL has no counterpart of).
MOE_RL_OVERRIDES: list[str] = [
    "model.dtype=bfloat16",
    "rollout.dtype=bfloat16",
    "logging.wandb.mode=disabled",
    "trainer.checkpoint_every=-1",
    "logging.router_agreement_every=0",
]

TRL_VERSION = "1.16.0"
TRL_ENV = Path(os.environ.get("MOE_RL_TRL_ENV", Path.home() / ".cache" / "moe-rl-bench" / f"trl-{TRL_VERSION}"))

# The sizes compared: the model (TinySpec fields; {} = the built-in tiny one), tokens per response, default steps.
SIZES = {
    "toy": {"model": {}, "max_tokens": 24, "steps": 30},
    "107m": {
        "model": {
            "hidden": 512,
            "heads": 8,
            "kv_heads": 4,
            "head_dim": 64,
            "layers": 8,
            "num_experts": 16,
            "topk": 4,
            "moe_intermediate": 512,
        },
        "max_tokens": 128,
        "steps": 6,
    },
}


def trl_python() -> Path:
    """The Python of TRL's environment, created on first use (torch and transformers at moe-rl's versions)."""
    import torch
    import transformers

    python = TRL_ENV / "bin" / "python"
    if python.is_file():
        return python
    print(f"[vs_trl] creating TRL's environment in {TRL_ENV} (once; a few minutes)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(TRL_ENV)], check=True)
    torch_version = torch.__version__.split("+")[0]
    pins = [f"torch=={torch_version}", f"transformers=={transformers.__version__}", f"trl=={TRL_VERSION}"]
    subprocess.run([str(python), "-m", "pip", "install", "-q", *pins], check=True)
    return python


def build_model(size: str, out: Path, seed: int) -> Path:
    """The size's model as an HF folder: the trainer's own built-in model for "toy" (same arch, seed and sizes)."""
    from moe_rl.models.tiny import TinySpec, build_tiny_model

    return build_tiny_model(TinySpec(seed=seed, **SIZES[size]["model"]), out)


def moe_rl_run(size: str, model: Path, steps: int, run_dir: Path) -> dict:
    """`torchrun --nproc-per-node=2 launch/train_moe.py` with the size's model and length and MOE_RL_OVERRIDES."""
    sized = [] if size == "toy" else [f"model.path={model}", f"sampling.max_tokens={SIZES[size]['max_tokens']}"]
    cmd = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"),
        f"hydra.run.dir={run_dir}",
        f"trainer.steps={steps}",
        *sized,
        *MOE_RL_OVERRIDES,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    began = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    whole = time.perf_counter() - began
    if proc.returncode:
        said = "\n".join(line for line in proc.stdout.splitlines() if line.startswith("[moe-rl]"))  # its own lines
        sys.exit(
            f"[vs_trl] moe-rl run failed ({' '.join(cmd)}); its folder is kept: {run_dir} (every rank's log: "
            f"{run_dir / 'train_moe.log'}). Its [moe-rl] lines:\n{said}\nThe end of its output:\n"
            f"{(proc.stdout + proc.stderr)[-5000:]}"
        )
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = {h["step"]: h for h in history}  # the last record of each step
    records = [last[s] for s in sorted(last)]
    return {
        "command": " ".join(cmd),
        "step_seconds": [r["time/step"] for r in records],
        "rewards": [r["reward/mean"] for r in records],
        "whole_seconds": whole,
        "phases": {
            k[5:]: statistics.mean(r.get(k, 0.0) for r in records[1:])
            for k in sorted({k for r in records for k in r if k.startswith("time/")})
        },
    }


def moe_rl_settings() -> dict:
    """What the TRL side must match: moe-rl's defaults (with MOE_RL_OVERRIDES) for the batch and the update; Adam's
    betas and epsilon are megatron's OptimizerConfig defaults, which moe-rl's optimizer takes."""
    from hydra import compose, initialize_config_dir
    from megatron.core.optimizer import OptimizerConfig
    from omegaconf import OmegaConf

    from moe_rl.config.store import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train_moe", overrides=MOE_RL_OVERRIDES))
    adam = OptimizerConfig()
    return {
        "prompts_per_step": cfg.data.prompts_per_step * 2,  # 2 data-parallel ranks
        "samples_per_prompt": cfg.sampling.n,
        "temperature": cfg.sampling.temperature,
        "mini_batches": cfg.actor.mini_batches,
        "lr": cfg.actor.lr,
        "adam_betas": [adam.adam_beta1, adam.adam_beta2],
        "adam_eps": adam.adam_eps,
        "grad_clip": cfg.actor.grad_clip,
        "clip_low": cfg.algorithm.loss.clip_low,
        "clip_high": cfg.algorithm.loss.clip_high,
        "dtype": str(cfg.model.dtype),
        "seed": cfg.trainer.seed,
        "task": str(cfg.data.task),
    }


def toy_prompts(seed: int) -> list[str]:
    from moe_rl.data.prompts import PromptSource

    return [p.text for p in PromptSource("toy", seed=seed).items]


def trl_run(python: Path, spec: dict, work: Path) -> dict:
    path = work / "trl_spec.json"
    path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), TOKENIZERS_PARALLELISM="false")
    began = time.perf_counter()
    proc = subprocess.run(
        [str(python), str(REPO / "bench" / "trl_side.py"), str(path)], env=env, capture_output=True, text=True
    )
    whole = time.perf_counter() - began
    if proc.returncode:
        sys.exit(
            f"[vs_trl] TRL run failed (its folder is kept: {spec['out_dir']}):\n{(proc.stdout + proc.stderr)[-5000:]}"
        )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["whole_seconds"] = whole  # the process's wall time, as for moe-rl's command
    return out


def _summary(ours: dict, theirs: dict) -> dict:
    """One round's comparison: the mean step leaves the first out (start-up work both sides do there). Outside the
    steps: the whole command's time less every step's (start-up, checkpoints, exit)."""
    mean_ours = statistics.mean(ours["step_seconds"][1:])
    mean_theirs = statistics.mean(theirs["step_seconds"][1:])
    return {
        "moe_rl_mean_step_seconds": mean_ours,
        "trl_mean_step_seconds": mean_theirs,
        "step_ratio": mean_ours / mean_theirs,
        "moe_rl_whole_seconds": ours["whole_seconds"],
        "trl_whole_seconds": theirs["whole_seconds"],
        "whole_ratio": ours["whole_seconds"] / theirs["whole_seconds"],
        "moe_rl_outside_steps_seconds": ours["whole_seconds"] - sum(ours["step_seconds"]),
        "trl_outside_steps_seconds": theirs["whole_seconds"] - sum(theirs["step_seconds"]),
        "reward_difference": statistics.mean(ours["rewards"]) - statistics.mean(theirs["rewards"]),
    }


# The round figures reported as their median over rounds.
MEDIANS = (
    "step_ratio",
    "whole_ratio",
    "moe_rl_outside_steps_seconds",
    "trl_outside_steps_seconds",
    "reward_difference",
)

# What each side's process imports before its first step (a moe-rl rank: its trainer, megatron-core, transformers,
# vLLM's client and wandb, after torchrun's launcher has imported torch; TRL: bench/trl_side.py's imports), timed in
# a process of its own: a floor under each side's time outside its steps.
IMPORTS = {
    "moe_rl": "import torch, megatron.core.models.gpt, transformers, wandb, moe_rl.trainer.loop; from vllm import LLM",
    "trl": "import torch, datasets, transformers, trl; from trl import GRPOConfig, GRPOTrainer",
}


def import_seconds(python: Path | str, imports: str) -> float:
    """Seconds a fresh `python -c` takes to make these imports (without the interpreter's start and teardown)."""
    timed = f"t = time.perf_counter()\n{imports}\nprint(time.perf_counter() - t, flush=True)"
    code = f"import os, time\n{timed}\nos._exit(0)"
    proc = subprocess.run([str(python), "-c", code], cwd=REPO, check=True, capture_output=True, text=True)
    return float(proc.stdout.strip().splitlines()[-1])


def compare(size: str, steps: int, python: Path, work: Path, settings: dict, repeats: int = 1) -> dict:
    """`repeats` rounds of both runs, which side goes first alternating; the ratios are the rounds' medians and
    `moe_rl` / `trl` the first round's runs in full."""
    model = build_model(size, work / f"model_{size}", settings["seed"])
    spec = {
        **settings,
        "repo": str(REPO),
        "model": str(model),
        "prompts": toy_prompts(settings["seed"]),
        "max_tokens": SIZES[size]["max_tokens"],
        "steps": steps,
        "threads": 2,
    }
    runs = []
    for r in range(repeats):
        got = {}
        for side in ("moe_rl", "trl") if r % 2 == 0 else ("trl", "moe_rl"):
            what = "moe-rl" if side == "moe_rl" else f"TRL {TRL_VERSION}"
            print(f"[vs_trl] {size}: round {r + 1}/{repeats}: {what}, {steps} steps", file=sys.stderr, flush=True)
            if side == "moe_rl":  # a run folder per round: the same one would resume the last round's checkpoint
                got[side] = moe_rl_run(size, model, steps, work / f"moe_rl_{size}_{r}")
            else:
                got[side] = trl_run(python, {**spec, "out_dir": str(work / f"trl_{size}_{r}")}, work)
        runs.append(got)
    rounds = [_summary(g["moe_rl"], g["trl"]) for g in runs]
    ours, theirs = runs[0]["moe_rl"], runs[0]["trl"]
    out = {
        "parameters": theirs["parameters"],
        "max_tokens": SIZES[size]["max_tokens"],
        "steps": steps,
        "moe_rl": {
            **ours,
            "mean_step_seconds": rounds[0]["moe_rl_mean_step_seconds"],
            "mean_reward": statistics.mean(ours["rewards"]),
        },
        "trl": {
            **theirs,
            "mean_step_seconds": rounds[0]["trl_mean_step_seconds"],
            "mean_reward": statistics.mean(theirs["rewards"]),
        },
        **{k: statistics.median(r[k] for r in rounds) for k in MEDIANS},
    }
    if repeats > 1:
        out["rounds"] = rounds
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=list(SIZES))
    p.add_argument("--steps", type=int, help="RL steps per run (default: the size's; at least 2)")
    p.add_argument("--work", help="keep the runs here (default: a temporary folder, removed unless a run fails)")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of both runs per size, which goes first alternating; the ratios printed are the rounds' medians "
        "(on a shared 2-core machine one run's times move by 10-20%% from run to run)",
    )
    a = p.parse_args()
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats}: at least 1")
    python = trl_python()
    settings = moe_rl_settings()
    work = Path(a.work or tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)
    print("[vs_trl] timing each side's imports", file=sys.stderr, flush=True)
    imports = {side: import_seconds(sys.executable if side == "moe_rl" else python, IMPORTS[side]) for side in IMPORTS}
    results = {
        size: compare(size, a.steps or SIZES[size]["steps"], python, work, settings, a.repeats) for size in a.sizes
    }
    if not a.work:  # a failed run exits above and leaves the folder for its logs
        shutil.rmtree(work)
    print(
        json.dumps(
            {
                "trl_version": TRL_VERSION,
                "settings": settings,
                "moe_rl_overrides": MOE_RL_OVERRIDES,
                "import_seconds": imports,
                "sizes": results,
            }
        )
    )


if __name__ == "__main__":
    main()
