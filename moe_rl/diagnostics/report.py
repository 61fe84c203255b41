"""The routing-mismatch report: numbers computed from rollout dumps (`moe_rl.rollout.dump`).

report.json schema (version 1; keys are stable, new keys may be added):

  schema_version        1
  source                {dumps: [files], steps: [int], model_path, model: fingerprint,
                         rollout_dtype, actor_dtype, samples, response_tokens, routed_token_layers}
  router                (None when the dumps hold no engine routes)
    moe_layers                   [decoder layer of each MoE layer]
    disagreement_per_layer       {layer: fraction of token-layers whose expert sets differ},
                                 engine routes vs the actor's own routing (no replay)
    set_difference_mean_per_layer {layer: mean |engine set \\ actor set| per token-layer}
    disagreement                 over all token-layers
    token_any_disagreement       fraction of tokens with a differing set in any MoE layer
    with_replay_disagreement     fraction of token-layers that the actor dispatched to other
                                 experts than the replayed ones (expected 0; None if unmeasured)
    with_replay_checked_token_layers
  mismatch
    without_replay / with_replay {each key of moe_rl.objectives.mismatch_metrics (pi_old vs mu),
                                  k_above_tis_cap_fraction}; with_replay is None without routes
  mismatch_by_routing   (None without routes) response tokens split by whether any position of their context
                        (the positions before them, the one that scores them included) was routed differently
                        by the engine and the actor's own routing in some MoE layer: {routed_differently,
                        routed_alike}, each {tokens, k3_kl_without_replay, k3_kl_with_replay,
                        k3_share_without_replay, k3_share_with_replay}; a share is that group's part of the
                        batch's k3 sum, a mean is None for a group without tokens. Replay can only change the
                        first group's log-probs: the second's routes are the same either way
  thresholds            {icepop_low, icepop_high, tis_cap}
  worst_tokens          N response tokens with the largest |log pi_old(no replay) - log mu|:
                        {sample, position, token_id, text, logprob_mu, logprob_replay,
                         logprob_live, log_k_live, layers_differing (MoE layers whose expert
                         sets differ at position - 1, the position whose output scores it)}

Token-layers: every routed position (prompt and response, all but each sequence's last token,
which the engine never routes) times every MoE layer. Log-prob metrics: response tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from moe_rl.objectives import mismatch_metrics
from moe_rl.objectives.metrics import mismatch_sums
from moe_rl.rollout import dump
from moe_rl.routing.compare import route_sets_differ, routed_positions

SCHEMA_VERSION = 1


def load_dumps(folder: str | Path, step: int | None = None, model_fingerprint: dict | None = None):
    """Concatenate the rank files of the chosen step(s) (all steps by default), each data-parallel rank's samples
    once: the tensor-, pipeline- and context-parallel peers of a rank dump the same samples (files written before
    `dp_rank` was recorded count as one data-parallel rank each). Every file's metadata is kept.

    Returns (tensors, metas, files); tensors are right-padded to one length. Raises DumpError
    for missing folders, malformed files, or files from different models (or not `model_fingerprint`).
    """
    steps = dump.step_folders(folder)
    if step is not None:
        steps = [p for p in steps if p.name == f"step_{step:06d}"]
        if not steps:
            raise dump.DumpError(f"{folder} has no dump for step {step}")
    files = [f for s in steps for f in sorted(s.glob("rank_*.safetensors"))]
    if not files:
        raise dump.DumpError(f"{folder}: the step folders hold no rank_*.safetensors files")
    parts, metas, pooled, seen = [], [], [], set()
    for f in files:
        tensors, meta = dump.read(f)
        expected = model_fingerprint or (metas[0]["model"] if metas else meta["model"])
        if meta["model"] != expected:
            raise dump.DumpError(f"{f} is from another model: {meta['model']} (expected {expected})")
        metas.append(meta)
        samples = (meta["step"], meta.get("dp_rank", meta["rank"]))
        if samples not in seen:
            seen.add(samples)
            parts.append(tensors)
            pooled.append(f)
    keys = set(parts[0])
    for f, p in zip(pooled, parts, strict=True):
        if set(p) != keys:
            raise dump.DumpError(f"{f} holds {sorted(p)}, {files[0]} holds {sorted(keys)}")
    return _concat(parts), metas, files


def _concat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    t = max(p["input_ids"].shape[1] for p in parts)
    out = {}
    for k in parts[0]:
        if parts[0][k].dim() >= 2:
            padded = []
            for p in parts:
                x = p[k]
                pad = torch.zeros((x.shape[0], t - x.shape[1], *x.shape[2:]), dtype=x.dtype)
                padded.append(torch.cat([x, pad], dim=1))
            out[k] = torch.cat(padded)
        else:
            out[k] = torch.cat([p[k] for p in parts])
    return out


def router_block(routes: torch.Tensor, routes_live: torch.Tensor, valid: torch.Tensor, moe_layers, metas) -> dict:
    differ, missing = route_sets_differ(routes[valid], routes_live[valid])  # [N, L]
    checked = sum(m.get("replay_check", {}).get("token_layers", 0) for m in metas)
    mismatched = sum(m.get("replay_check", {}).get("mismatched", 0) for m in metas)
    measured = all("replay_check" in m for m in metas) and checked > 0
    return {
        "moe_layers": list(moe_layers),
        "disagreement_per_layer": {
            str(layer): float(differ[:, i].double().mean()) for i, layer in enumerate(moe_layers)
        },
        "set_difference_mean_per_layer": {
            str(layer): float(missing[:, i].double().mean()) for i, layer in enumerate(moe_layers)
        },
        "disagreement": float(differ.double().mean()),
        "token_any_disagreement": float(differ.any(-1).double().mean()),
        "with_replay_disagreement": mismatched / checked if measured else None,
        "with_replay_checked_token_layers": checked if measured else 0,
    }


def mismatch_block(logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, low: float, high: float, cap: float):
    out = {k: float(v) for k, v in mismatch_metrics(logp, mu, mask, low, high).items()}
    m = mask.bool()
    log_k = (logp - mu).float()[m]
    out["k_above_tis_cap_fraction"] = float((log_k > math.log(cap)).double().mean())
    return out


def by_routing_block(data: dict[str, torch.Tensor]) -> dict:
    """How much of the k3 mismatch sits on tokens whose context the two routers disagreed on somewhere, and how much
    of it replay removes there; the rest is beyond replay's reach (the same experts, other arithmetic)."""
    mask = data["loss_mask"].bool()
    differ, _ = route_sets_differ(data["routes"], data["routes_live"])  # [B, T, L]
    at = differ.any(-1) & routed_positions(data["attention_mask"])
    flipped = torch.zeros_like(mask)
    flipped[:, 1:] = at.cummax(dim=1).values[:, :-1]  # token t: positions 0 .. t - 1 (attention reaches them all)
    passes = {"without_replay": data["logprobs_live"], "with_replay": data.get("logprobs_replay")}

    def k3_sum(lp: torch.Tensor, where: torch.Tensor) -> float:  # mismatch/k3_kl's own sum
        return float(mismatch_sums(lp, data["rollout_logprobs"], where)[0]["k3_kl"])

    totals = {name: None if lp is None else k3_sum(lp, mask) for name, lp in passes.items()}
    out = {}
    for group, where in (("routed_differently", mask & flipped), ("routed_alike", mask & ~flipped)):
        n = int(where.sum())
        row: dict = {"tokens": n}
        for name, lp in passes.items():
            part = None if lp is None else k3_sum(lp, where)
            row[f"k3_kl_{name}"] = None if part is None or n == 0 else part / n
            row[f"k3_share_{name}"] = None if part is None or not totals[name] else part / totals[name]
        out[group] = row
    return out


def worst_tokens(data: dict[str, torch.Tensor], n: int, moe_layers, tokenizer=None) -> list[dict]:
    mask = data["loss_mask"].bool()
    gap = (data["logprobs_live"] - data["rollout_logprobs"]).abs().masked_fill(~mask, -1.0)
    n = min(n, int(mask.sum()))
    flat = torch.topk(gap.flatten(), n).indices
    out = []
    for idx in flat.tolist():
        b, t = divmod(idx, gap.shape[1])
        tok = int(data["input_ids"][b, t])
        layers = []
        if "routes" in data and "routes_live" in data and t >= 1:  # position t-1's output scores token t
            differ, _ = route_sets_differ(data["routes"][b, t - 1], data["routes_live"][b, t - 1])
            layers = [int(moe_layers[i]) for i in differ.nonzero().flatten().tolist()]
        replay = data.get("logprobs_replay")
        out.append(
            {
                "sample": b,
                "position": t,
                "token_id": tok,
                "text": tokenizer.decode([tok]) if tokenizer is not None else None,
                "logprob_mu": float(data["rollout_logprobs"][b, t]),
                "logprob_replay": None if replay is None else float(replay[b, t]),
                "logprob_live": float(data["logprobs_live"][b, t]),
                "log_k_live": float(data["logprobs_live"][b, t] - data["rollout_logprobs"][b, t]),
                "layers_differing": layers,
            }
        )
    return out


def build_report(
    data: dict[str, torch.Tensor],
    metas: list[dict],
    files: list[Path],
    icepop: tuple[float, float] = (0.5, 5.0),
    tis_cap: float = 2.0,
    worst: int = 10,
    tokenizer=None,
) -> dict:
    if "logprobs_live" not in data:
        raise dump.DumpError(
            f"{files[0]} has no logprobs_live: write dumps with trainer.dump_every or moe-rl-diagnose live"
        )
    moe_layers = metas[0]["model"]["moe_layers"]
    mask = data["loss_mask"]
    valid = routed_positions(data["attention_mask"])
    has_routes = "routes" in data and "routes_live" in data
    low, high = icepop
    with_replay = None
    if data.get("logprobs_replay") is not None:
        with_replay = mismatch_block(data["logprobs_replay"], data["rollout_logprobs"], mask, low, high, tis_cap)
    return {
        "schema_version": SCHEMA_VERSION,
        "source": {
            "dumps": [str(f) for f in files],
            "steps": sorted({m["step"] for m in metas}),
            "model_path": metas[0].get("model_path"),
            "model": metas[0]["model"],
            "rollout_dtype": metas[0].get("rollout_dtype"),
            "actor_dtype": metas[0].get("actor_dtype"),
            "samples": int(mask.shape[0]),
            "response_tokens": int(mask.sum()),
            "routed_token_layers": int(valid.sum()) * len(moe_layers),
        },
        "router": router_block(data["routes"], data["routes_live"], valid, moe_layers, metas) if has_routes else None,
        "mismatch": {
            "without_replay": mismatch_block(data["logprobs_live"], data["rollout_logprobs"], mask, low, high, tis_cap),
            "with_replay": with_replay,
        },
        "mismatch_by_routing": by_routing_block(data) if has_routes else None,
        "thresholds": {"icepop_low": low, "icepop_high": high, "tis_cap": tis_cap},
        "worst_tokens": worst_tokens(data, worst, moe_layers, tokenizer),
    }
