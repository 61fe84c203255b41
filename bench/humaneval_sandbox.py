"""The code reward's throughput in the sandbox: HumanEval's 164 canonical solutions and 164 `pass` bodies scored
by moe_rl.reward.code:code_reward (one bubblewrap run per sample) with sandbox pools of each --workers size, side by
side. Prints one JSON line: per pool size, runs_per_s and seconds of each batch, and whether all 164 canonical
solutions passed and all 164 `pass` bodies failed.

  python bench/humaneval_sandbox.py                 # pools of 1, 2 and 4 workers
  python bench/humaneval_sandbox.py --workers 2 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_rl import sandbox  # noqa: E402 -- after the repo is on the path
from moe_rl.data import humaneval  # noqa: E402
from moe_rl.reward.code import code_reward  # noqa: E402


def score(responses: list[str], rows: list[dict]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    out = code_reward(responses, [None] * len(rows), [[]] * len(rows), samples=[SimpleNamespace(row=r) for r in rows])
    return out, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4], help="sandbox pool sizes to compare")
    a = p.parse_args()
    rows = humaneval.problems()
    result = {"problems": len(rows), "cores": len(os.sched_getaffinity(0)), "pools": {}}
    for workers in a.workers:
        sandbox.configure(sandbox.SandboxConfig(workers=workers))
        good, good_s = score([r["canonical_solution"] for r in rows], rows)
        bad, bad_s = score(["    pass\n"] * len(rows), rows)
        result["pools"][str(workers)] = {
            "canonical_runs_per_s": round(len(rows) / good_s, 1),
            "pass_body_runs_per_s": round(len(rows) / bad_s, 1),
            "canonical_seconds": round(good_s, 2),
            "pass_body_seconds": round(bad_s, 2),
            "canonical_all_passed": all(g["score"] == 1.0 for g in good),
            "pass_bodies_all_failed": all(b["score"] == 0.0 for b in bad),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
