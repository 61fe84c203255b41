"""moe-rl-plan: will this model and layout fit, before any GPU is spent.

Examples:
  moe-rl-plan --model qwen3-30b-a3b --gpus 64 --gpu-memory-gib 80
  moe-rl-plan --model qwen3-30b-a3b --gpu-memory-gib 80 --search actor.distributed_optimizer=true \\
      data.max_prompt_tokens=1024 sampling.max_tokens=4096
  moe-rl-plan --model qwen3-30b-a3b --gpus 8 --gpu-memory-gib 80 --config conf/recipes/qwen3_30b_a3b_gspo_8gpu.yaml
  moe-rl-plan --model deepseek-v3 --gpus 8 --gpu-memory-gib 80 parallel.ep=8 --json
  moe-rl-plan --model /models/GLM-4.5-Air --gpus 16 --gpu-memory-gib 80 --search parallel.tp=4
  moe-rl-plan --model deepseek-v3 --gpu-memory-gib 80 --search --assume engine-across-nodes \\
      actor.distributed_optimizer=true actor.optimizer_offload.fraction=1

--model: a preset (published configurations, no weights), an HF folder or a config.json. The overrides are the
trainer's (launch/train_moe.py's keys, `python launch/train_moe.py --keys` lists them), checked as the trainer checks
them on GPUs, on top of --config (a conf/ yaml, e.g. a recipe) where given. The `auto` settings resolve as on a CUDA
machine with Transformer Engine (model.transformer_engine=true, model.dtype=bfloat16, rollout.dtype=bfloat16), as a
CUDA run's header prints them. Exact rows: parameters, gradients, optimizer states, KV bytes per token, route records;
estimates: activations and the engine's workspace (docs/guides/planning.md gives every formula and its source).

--assume NAME plans as if moe-rl had a feature that peers' published layouts for the largest models rely on (the
trainer refuses such a layout or does not do it; the plan says so):
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter

from moe_rl.common.errors import ConfigError
from moe_rl.plan.assume import ASSUMPTIONS, BUILT, describe
from moe_rl.plan.memory import GIB
from moe_rl.plan.planner import make_plan, render
from moe_rl.plan.search import KEYS, engine_never_fits, search, smallest, stderr
from moe_rl.plan.spec import load_spec, preset_names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-rl-plan",
        description=__doc__ + "\n".join(describe(ASSUMPTIONS)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help=f"preset ({', '.join(preset_names())}), HF folder or config.json")
    p.add_argument("--gpus", type=int, help="GPUs of the run (world size); may be left out with --search")
    p.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of one GPU in GiB, e.g. 80")
    p.add_argument(
        "--search",
        action="store_true",
        help="list the layouts that fit, best first (without --gpus: "
        "the smallest multiple of 8 GPUs on which one does)",
    )
    p.add_argument(
        "--assume",
        action="append",
        choices=[*ASSUMPTIONS, *BUILT],
        default=[],
        metavar="NAME",
        help=f"plan as if moe-rl had this feature ({', '.join(ASSUMPTIONS)}); may be repeated",
    )
    p.add_argument(
        "--config",
        help="a training config yaml of conf/ (e.g. conf/recipes/qwen3_30b_a3b_gspo.yaml), composed as "
        "`launch/train_moe.py --config-name` composes it; the overrides apply on top",
    )
    p.add_argument("--top", type=int, default=5, help="--search: layouts shown (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("overrides", nargs="*", help="training config overrides, key=value (parallel.tp=2 model.dtype=...)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    a = p.parse_intermixed_args(argv)  # overrides may sit between the options
    if a.gpus is None and not a.search:
        p.error("--gpus is required without --search")
    if a.gpus is not None and a.gpus < 1:
        p.error(f"--gpus {a.gpus}: must be >= 1")
    if a.gpu_memory_gib <= 0:
        p.error(f"--gpu-memory-gib {a.gpu_memory_gib:g}: must be > 0 (an 80 GB H100 has 79.6 GiB)")
    for name in a.assume:
        if name in BUILT:
            p.error(f"--assume {name}: {BUILT[name]}")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"overrides are key=value; not {bad[0]!r}")
    try:
        sys.exit(_run(a))
    except ConfigError as e:
        print(f"moe-rl-plan: {e}", file=sys.stderr)
        sys.exit(2)


def _run(a: argparse.Namespace) -> int:
    # heavy: the training config (torch) for the overrides; imported after argparse so --help is instant
    from moe_rl.plan.layout import build_config

    spec = load_spec(a.model)
    cfg = build_config(a.overrides, config=a.config)
    gpu_bytes = int(a.gpu_memory_gib * GIB)
    assumed = frozenset(a.assume)  # argparse's choices refused any other name
    if not a.search:
        plan = make_plan(spec, cfg, a.gpus, gpu_bytes, assumed=assumed)
        print(json.dumps(plan.as_dict(), indent=1) if a.json else render(plan, cfg))
        return 0 if plan.fits else 1
    fixed = {k: _int(o.split("=", 1)[1]) for o in a.overrides for k in KEYS if o.startswith(k + "=")}
    progress = None if a.json else stderr
    if why := engine_never_fits(spec, cfg, gpu_bytes, fixed, assumed):
        if a.json:
            out = {"fits": False, "min_gpus": None, "layout": None, "reason": why, "assumed": sorted(assumed)}
            print(json.dumps(out, indent=1))
        else:
            print(f"no layout fits: {why}")
        return 1
    refused: list[str] = []
    if a.gpus is not None:
        plans = search(spec, cfg, a.gpus, gpu_bytes, fixed, progress, refused, assumed)
    else:
        plans = smallest(spec, cfg, gpu_bytes, fixed, progress=progress, refused=refused, assumed=assumed)
    if a.json:
        out = {"fits": bool(plans), "assumed": sorted(assumed), "layouts": [pl.as_dict() for pl in plans[: a.top]]}
        if not a.gpus:
            out["min_gpus"] = plans[0].layout.gpus if plans else None
        out["layout"] = plans[0].layout.as_dict() if plans else None
        print(json.dumps(out, indent=1))
        return 0 if plans else 1
    if not plans:
        where = f"{a.gpus} GPUs" if a.gpus else "any multiple of 8 GPUs up to 1024"
        given = f" with --assume {' '.join(sorted(assumed))}" if assumed else ""
        print(f"no layout the trainer accepts{given} fits on {where} of {a.gpu_memory_gib:g} GiB")
        if refused:  # e.g. a key given on the command line that no layout can satisfy
            reason, n = Counter(refused).most_common(1)[0]
            print(f"the trainer refused {len(refused)} of the layouts tried; the most common reason ({n}): {reason}")
        return 1
    if not a.gpus:
        given = f" with --assume {' '.join(sorted(assumed))}" if assumed else ""
        print(f"smallest GPU count that fits{given}: {plans[0].layout.gpus}")
    print("best first: fewest tp*pp*cp, then ep*etp, then engine TP, then largest margin")
    for pl in plans[: a.top]:
        print(f"  {pl.layout.describe()}: fullest GPU {pl.peak / GIB:.1f} GiB, margin {pl.margin / GIB:+.1f} GiB")
    print()
    print(render(plans[0], cfg))
    return 0


def _int(value: str) -> int | None:
    """A searched key's value from the command line (null: unset, as Hydra reads it)."""
    return None if value in ("null", "None", "~") else int(value)


if __name__ == "__main__":
    raise SystemExit(main())
