"""PNG plots of a mismatch report (matplotlib, headless)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def _pyplot():
    # heavy: matplotlib, imported on first use
    import matplotlib

    matplotlib.use("Agg")
    # after use("Agg"): the backend is chosen before pyplot loads
    import matplotlib.pyplot as plt

    return plt


def write_plots(report: dict, data: dict[str, torch.Tensor], out: str | Path) -> list[Path]:
    """disagreement_per_layer.png, logprob_scatter.png, log_ratio_hist.png (the first only
    when the dumps hold routes). Returns the written paths."""
    plt = _pyplot()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    mask = data["loss_mask"].bool()
    mu = data["rollout_logprobs"][mask].float()
    views = {"no replay": data["logprobs_live"][mask].float()}
    if data.get("logprobs_replay") is not None:
        views["replay"] = data["logprobs_replay"][mask].float()

    router = report.get("router")
    if router is not None:
        layers = list(router["disagreement_per_layer"])
        fig, ax = plt.subplots(figsize=(max(4, 0.35 * len(layers) + 2), 3.5))
        ax.bar(layers, [100 * router["disagreement_per_layer"][k] for k in layers], color="tab:red")
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("token-layers with a different expert set (%)")
        ax.set_title(f"router disagreement, engine vs actor (overall {100 * router['disagreement']:.2f}%)")
        written.append(_save(fig, out / "disagreement_per_layer.png", plt))

    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    lo, hi = float(mu.min()), float(mu.max())
    for (name, lp), color in zip(views.items(), ("tab:red", "tab:blue"), strict=False):
        ax.scatter(mu.numpy(), lp.numpy(), s=4, alpha=0.5, label=name, color=color)
        lo, hi = min(lo, float(lp.min())), max(hi, float(lp.max()))
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.set_xlabel("log mu (rollout engine)")
    ax.set_ylabel("log pi_old (trainer)")
    ax.set_title("per-token log-probs")
    ax.legend()
    written.append(_save(fig, out / "logprob_scatter.png", plt))

    t = report["thresholds"]
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    log_k = {name: (lp - mu) for name, lp in views.items()}
    lo = min(float(x.min()) for x in log_k.values())
    hi = max(float(x.max()) for x in log_k.values())
    bins = torch.linspace(lo, max(hi, lo + 1e-6), 61).numpy()  # shared bins: the two views compare
    for (name, x), color in zip(log_k.items(), ("tab:red", "tab:blue"), strict=False):
        ax.hist(x.numpy(), bins=bins, alpha=0.5, label=name, color=color, log=True)
    for edge in (t["icepop_low"], t["icepop_high"]):
        ax.axvline(math.log(edge), color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("log k = log pi_old - log mu (dashed: IcePop band)")
    ax.set_ylabel("tokens")
    ax.legend()
    written.append(_save(fig, out / "log_ratio_hist.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
