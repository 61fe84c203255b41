"""Writing a diagnostic report: report.json, plots and the console tables (used by the
offline and live commands)."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(args, data, metas, files, tokenizer=None) -> dict:
    # torch and matplotlib (report, plots): not loaded by importing this module
    from moe_rl.diagnostics.plots import write_plots
    from moe_rl.diagnostics.report import build_report

    report = build_report(data, metas, files, (args.icepop_low, args.icepop_high), args.tis_cap, args.worst, tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    if not args.no_plots:
        write_plots(report, data, out)
    print_report(report)
    print(f"[moe-rl-diagnose] wrote {out / 'report.json'}")
    return report


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def print_report(report: dict) -> None:
    """The report's console tables: the source line, router disagreement, pi_old vs mu, k3 by routing, the worst
    tokens (a table only for the parts the report holds)."""
    # heavy: rich, imported on first use
    from rich.console import Console

    console = Console(width=140)
    src = report["source"]
    console.print(
        f"[bold]{src['model']['model_type']}[/] {src['model_path']}  steps {src['steps']}  "
        f"{src['samples']} samples, {src['response_tokens']} response tokens, "
        f"rollout {src['rollout_dtype']} / actor {src['actor_dtype']}"
    )
    if report["router"] is not None:
        _print_router(console, report["router"])
    _print_mismatch(console, report["mismatch"])
    if report.get("mismatch_by_routing") is not None:
        _print_mismatch_by_routing(console, report["mismatch_by_routing"])
    if report["worst_tokens"]:
        _print_worst_tokens(console, report["worst_tokens"])


def _print_router(console, router: dict) -> None:
    """Engine vs actor routing: disagreement per MoE layer and overall, and the share of tokens with any."""
    # heavy: rich, imported on first use
    from rich.table import Table

    t = Table(title="router: engine vs actor (no replay)")
    t.add_column("MoE layer", justify="right")
    t.add_column("disagreement", justify="right")
    t.add_column("mean |set diff|", justify="right")
    for layer, v in router["disagreement_per_layer"].items():
        t.add_row(layer, f"{100 * v:.2f}%", f"{router['set_difference_mean_per_layer'][layer]:.3f}")
    t.add_row("all", f"{100 * router['disagreement']:.2f}%", "", style="bold")
    console.print(t)
    wr = router["with_replay_disagreement"]
    console.print(
        f"tokens with a disagreement in any layer: {100 * router['token_any_disagreement']:.2f}%   "
        f"with replay: {'not measured' if wr is None else f'{100 * wr:.2f}%'}"
    )


def _print_mismatch(console, m: dict) -> None:
    """pi_old vs mu metrics over the response tokens, without and with replay."""
    # heavy: rich, imported on first use
    from rich.table import Table

    t = Table(title="pi_old vs mu (response tokens)")
    t.add_column("metric")
    t.add_column("without replay", justify="right")
    t.add_column("with replay", justify="right")
    for k, v in m["without_replay"].items():
        t.add_row(k, fmt(v), fmt(None if m["with_replay"] is None else m["with_replay"][k]))
    console.print(t)


def _print_mismatch_by_routing(console, split: dict) -> None:
    """k3 split by whether the token's context saw a routing difference."""
    # heavy: rich, imported on first use
    from rich.table import Table

    t = Table(title="k3 by routing in the token's context (engine vs the actor's own routing, any earlier position)")
    for col in ("tokens", "count", "k3 without replay", "with replay", "share without", "share with"):
        t.add_column(col, justify="left" if col == "tokens" else "right")
    for group, row in split.items():
        t.add_row(
            group.replace("_", " "),
            str(row["tokens"]),
            fmt(row["k3_kl_without_replay"]),
            fmt(row["k3_kl_with_replay"]),
            fmt(row["k3_share_without_replay"]),
            fmt(row["k3_share_with_replay"]),
        )
    console.print(t)


def _print_worst_tokens(console, worst: list[dict]) -> None:
    """The tokens with the largest |log pi_old - log mu| without replay."""
    # heavy: rich, imported on first use
    from rich.table import Table

    t = Table(title="worst tokens (|log pi_old - log mu|, no replay)")
    for col in ("sample", "pos", "token", "log mu", "replay", "no replay", "layers differing"):
        t.add_column(col, justify="left" if col in ("token", "layers differing") else "right")
    for w in worst:
        t.add_row(
            str(w["sample"]),
            str(w["position"]),
            repr(w["text"]) if w["text"] is not None else str(w["token_id"]),
            f"{w['logprob_mu']:.3f}",
            fmt(w["logprob_replay"]),
            f"{w['logprob_live']:.3f}",
            ",".join(map(str, w["layers_differing"])),
        )
    console.print(t)
