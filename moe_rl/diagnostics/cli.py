"""moe-rl-diagnose: how often the rollout engine and the trainer route tokens to different
experts, in which layers, and what that does to the log-probs, with and without replay.

Subcommands:
  live     generate with vLLM (routes captured), score with the Megatron actor twice (own
           routing, engine routes replayed), write the dump and the report
  offline  the same report from rollout dumps a training run wrote (trainer.dump_every=N)
  compare  two report.json side by side with deltas

Output under --out: report.json (schema in moe_rl/diagnostics/report.py), the PNG plots, and
for `live` the dump it analysed (dump/step_000000/rank_*.safetensors).

Examples:
  moe-rl-diagnose live --model /data/Qwen3-30B-A3B --prompts prompts.jsonl --dtype bfloat16 --out diag/
  moe-rl-diagnose live --model /tmp/sft --prompts p.jsonl --dtype bfloat16 --actor-dtype float32 --out diag/
  torchrun --nproc-per-node=2 -m moe_rl.diagnostics live --model /tmp/tiny --prompts p.txt --ep 2 --out diag/
  moe-rl-diagnose offline --dump runs/2026-11-22_08-00-00/dumps --out diag-run/
  moe-rl-diagnose offline --dump runs/my-run/dumps --step 20 --worst 20 --out diag-step20/
  moe-rl-diagnose compare diag-bf16/report.json diag-fp32/report.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moe_rl.actor.model import load_hf_config
from moe_rl.diagnostics.live import live
from moe_rl.diagnostics.output import fmt, write_report
from moe_rl.diagnostics.report import load_dumps
from moe_rl.rollout.dump import DumpError, model_fingerprint
from moe_rl.routing.model_layout import moe_layout


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text}: must be > 0")
    return value


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="moe-rl-diagnose", description=__doc__, formatter_class=fmt)
    sub = p.add_subparsers(dest="command", required=True)

    def report_args(sp):
        sp.add_argument("--out", default="diagnose", help="output folder (report.json, plots); default ./diagnose")
        sp.add_argument("--worst", type=int, default=10, help="how many worst tokens to list (default 10)")
        sp.add_argument("--icepop-low", type=float, default=0.5, help="IcePop band low (default 0.5)")
        sp.add_argument("--icepop-high", type=float, default=5.0, help="IcePop band high (default 5)")
        sp.add_argument("--tis-cap", type=float, default=2.0, help="TIS cap (default 2)")
        sp.add_argument("--no-plots", action="store_true", help="skip the PNG plots")

    live = sub.add_parser(
        "live",
        help="generate with vLLM and score with the actor",
        formatter_class=fmt,
        description="Generate with vLLM capturing routes, then score with the Megatron actor with its own "
        "routing and with the engine's routes replayed.\n\nExamples:\n"
        "  moe-rl-diagnose live --model /tmp/tiny --prompts prompts.txt --dtype bfloat16 --out diag/\n"
        "  torchrun --nproc-per-node=2 -m moe_rl.diagnostics live --model /tmp/tiny --prompts p.jsonl --ep 2",
    )
    live.add_argument("--model", required=True, help="HF MoE model folder")
    live.add_argument("--prompts", required=True, help="jsonl with a `prompt` field, or text with one prompt a line")
    live.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"), help="engine (and actor) dtype")
    live.add_argument(
        "--actor-dtype",
        choices=("float32", "bfloat16"),
        help="the actor's dtype when it differs from the engine's (a bf16 engine and an fp32 trainer: --dtype "
        "bfloat16 --actor-dtype float32); default: --dtype",
    )
    live.add_argument(
        "--head-dtype",
        default="model",
        choices=("model", "float32"),
        help="the engine's lm_head (rollout.head_dtype): model (in --dtype, vLLM's default) | float32",
    )
    live.add_argument("--samples", type=int, default=16, help="prompts to use, one response each (default 16)")
    live.add_argument("--max-tokens", type=int, default=32, help="response length limit (default 32)")
    live.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1)")
    live.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    live.add_argument("--ep", type=int, default=1, help="actor expert parallel size (torchrun world)")
    live.add_argument("--kv-cache-gib", type=_positive, default=1.0, help="CPU engine KV cache in GiB (default 1)")
    report_args(live)

    off = sub.add_parser(
        "offline",
        help="report from rollout dumps",
        formatter_class=fmt,
        description="Report from rollout dumps (trainer.dump_every=N, trainer.mode=rollout_only, or a live run).\n\n"
        "Examples:\n  moe-rl-diagnose offline --dump runs/my-run/dumps --out diag/\n"
        "  moe-rl-diagnose offline --dump runs/my-run/dumps --step 20 --model /data/Qwen3-30B-A3B",
    )
    off.add_argument("--dump", required=True, help="dump folder (holding step_*/) or one step_* folder")
    off.add_argument("--step", type=int, help="only this step (default: every dumped step)")
    off.add_argument("--model", help="HF folder the dumps must come from (checked) and the tokenizer for text")
    report_args(off)

    cmp_ = sub.add_parser(
        "compare",
        help="two reports side by side",
        formatter_class=fmt,
        description="Two report.json side by side with deltas (B - A).\n\nExample:\n"
        "  moe-rl-diagnose compare diag-bf16/report.json diag-fp32/report.json --out compare.json",
    )
    cmp_.add_argument("a", help="report A (report.json)")
    cmp_.add_argument("b", help="report B (report.json)")
    cmp_.add_argument("--out", help="also write the comparison as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        if args.command == "compare":
            compare(args.a, args.b, args.out)
        elif args.command == "offline":
            offline(args)
        else:
            live(args)
    except (DumpError, FileNotFoundError, ValueError) as e:
        raise SystemExit(f"moe-rl-diagnose {args.command}: error: {e}") from None


def _tokenizer(path: str | None):
    if not path or not Path(path, "tokenizer_config.json").is_file():
        return None
    # heavy: transformers, imported on first use
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def offline(args) -> dict:
    fingerprint = None
    if args.model:
        cfg = load_hf_config(args.model)
        fingerprint = model_fingerprint(cfg, moe_layout(cfg))
    data, metas, files = load_dumps(args.dump, args.step, fingerprint)
    return write_report(args, data, metas, files, _tokenizer(args.model or metas[0].get("model_path")))


def _scalars(tree, prefix="") -> dict[str, float]:
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_scalars(v, f"{prefix}{k}."))
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        out[prefix[:-1]] = float(tree)
    return out


def compare(a: str, b: str, out: str | None = None) -> dict:
    # heavy: rich, imported on first use
    from rich.console import Console
    from rich.table import Table

    reports = []
    for path in (a, b):
        if not Path(path).is_file():
            raise FileNotFoundError(f"{path} does not exist")
        try:
            r = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from None
        if not isinstance(r, dict) or r.get("schema_version") != 1:
            raise ValueError(f"{path} is not a moe-rl-diagnose report (schema_version 1)")
        reports.append({k: v for k, v in r.items() if k in ("router", "mismatch", "mismatch_by_routing")})
    sa, sb = (_scalars(r) for r in reports)
    rows = {k: {"a": sa.get(k), "b": sb.get(k)} for k in sorted(set(sa) | set(sb))}
    for row in rows.values():
        row["delta"] = None if None in (row["a"], row["b"]) else row["b"] - row["a"]
    t = Table(title=f"A = {a}\nB = {b}")
    for col in ("metric", "A", "B", "B - A"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for k, row in rows.items():
        t.add_row(k, fmt(row["a"]), fmt(row["b"]), fmt(row["delta"]))
    Console(width=140).print(t)
    result = {"a": a, "b": b, "metrics": rows}
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
