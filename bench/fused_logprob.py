"""Peak memory and time: fused linear -> log-prob (torch backend, token chunks) vs full logits +
log_softmax, at V = 151,936 (Qwen3 vocabulary), H = 1024, on CPU. Prints JSON.

Each (variant, T, pass) runs in its own subprocess so peak RSS (ru_maxrss) is its own; the
reported `peak_extra_gib` is peak RSS minus RSS after the inputs were allocated. A variant
that the machine cannot hold is reported as {"oom": true}. Max |delta| compares the two
variants' log-probs at each T where both ran.

  python bench/fused_logprob.py                       # T in 1024 4096 16384, forward only
  python bench/fused_logprob.py --tokens 1024 4096 --backward
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

V, H = 151_936, 1024


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def child(variant: str, t: int, backward: bool, out: str) -> None:
    import torch
    from moe_rl.kernels.linear_logprob import fused_linear_logprob

    torch.manual_seed(0)
    h = torch.randn(t, H) * 0.5
    w = torch.randn(V, H) * 0.02
    y = torch.randint(0, V, (t,))
    if backward:
        h.requires_grad_(True)
        w.requires_grad_(True)
    base = _rss_gib()
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        if variant == "fused":
            logp, ent = fused_linear_logprob(h, w, y, backend="torch")
            loss = logp.sum() + ent.sum()
        else:
            logits = h @ w.t()
            logp_all = torch.log_softmax(logits, dim=-1)
            logp = logp_all.gather(-1, y[:, None])[:, 0]
            loss = logp.sum()
        if backward:
            loss.backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    torch.save(logp.detach(), out + ".pt")
    Path(out).write_text(json.dumps({"seconds": seconds, "peak_extra_gib": peak - base, "peak_gib": peak}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--backward", action="store_true", help="time forward + backward instead of forward")
    p.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        variant, t, bwd, out = a.child
        return child(variant, int(t), bwd == "1", out)
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="moe-rl-bench-"))
    res = {"V": V, "H": H, "backward": a.backward, "threads": torch.get_num_threads(), "runs": {}}
    for t in a.tokens:
        row = {}
        for variant in ("fused", "full"):
            out = tmp / f"{variant}-{t}.json"
            proc = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(t), str(int(a.backward)), str(out)],
                capture_output=True,
                text=True,
            )
            row[variant] = (
                json.loads(out.read_text())
                if proc.returncode == 0
                else {"oom": True, "returncode": proc.returncode, "stderr": proc.stderr[-300:]}
            )
        if "seconds" in row["fused"] and "seconds" in row["full"]:
            d = (torch.load(tmp / f"fused-{t}.json.pt") - torch.load(tmp / f"full-{t}.json.pt")).abs().max().item()
            row["max_abs_delta_logp"] = d
            row["memory_ratio"] = row["fused"]["peak_extra_gib"] / row["full"]["peak_extra_gib"]
            row["time_ratio"] = row["fused"]["seconds"] / row["full"]["seconds"]
        res["runs"][str(t)] = row
        print(json.dumps({t: row}), file=sys.stderr)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
