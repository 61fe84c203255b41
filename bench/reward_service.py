"""The reward service's throughput and latency against the same reward in process: a step's batch of --batch
samples scored --repeats times through `moe-rl-reward-server` on 127.0.0.1 (data.reward=http://..., requests of
--request-size samples sent concurrently) and by the same RewardSet in this process. Prints one JSON line: the
service's samples_per_s, p50_ms and p99_ms (per batch), the same under "in_process", and the settings.

  python bench/reward_service.py                                   # the toy batched reward, 512 samples x 50
  python bench/reward_service.py --reward moe_rl.reward.builtin:compute_score --batch 256 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_rl.config.schema import DataConfig  # noqa: E402 -- after the repo is on the path
from moe_rl.reward import RewardSet, Sample  # noqa: E402


def samples(n: int, seed: int) -> list[Sample]:
    """gsm8k-like samples: a response ending in a number, its answer, a row with a data_source."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = str(rng.randint(0, 999))
        response = "Let me think. " * rng.randint(1, 20) + f"#### {rng.choice([answer, str(rng.randint(0, 999))])}"
        ids = [rng.randint(0, 31999) for _ in range(rng.randint(16, 256))]
        row = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": answer}, "extra_info": {"index": i}}
        out.append(Sample(f"question {i}", None, response, ids, answer, "openai/gsm8k", row, f"bench:{i}"))
    return out


def timed(rewards: RewardSet, batches: list[list[Sample]]) -> dict:
    seconds = []
    for step, batch in enumerate(batches, 1):
        start = time.perf_counter()
        rewards.score(batch, step)
        seconds.append(time.perf_counter() - start)
    ms = sorted(s * 1000 for s in seconds[1:])  # the first batch starts the worker pool / connections
    total = sum(len(b) for b in batches[1:])
    return {
        "samples_per_s": round(total / sum(seconds[1:]), 1),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
    }


def start_server(reward: str, token: Path, workers: int) -> tuple[subprocess.Popen, str]:
    log = token.with_name("server.log")
    cmd = [sys.executable, "-m", "moe_rl.tools.reward_server", "--reward", reward, "--port", "0"]
    cmd += ["--token-file", str(token), "--set", f"reward_workers={workers}"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=os.environ)
    deadline = time.monotonic() + 120
    while "listening on" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.05)
    line = next(x for x in log.read_text().splitlines() if "listening on" in x)
    return proc, line.rsplit(" ", 1)[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reward", default="moe_rl.data.rewards:toy_low_token_reward", help="a spec as data.reward")
    p.add_argument("--batch", type=int, default=512, help="samples per step")
    p.add_argument("--request-size", type=int, default=64, help="data.reward_batch_size")
    p.add_argument("--repeats", type=int, default=50, help="batches scored each way")
    p.add_argument("--workers", type=int, default=2, help="data.reward_workers (both sides)")
    a = p.parse_args()
    batches = [samples(a.batch, seed) for seed in range(a.repeats + 1)]
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_text("bench-token\n")
        local = RewardSet.from_config(DataConfig(reward=a.reward, reward_workers=a.workers))
        with local:
            in_process = timed(local, batches)
        proc, url = start_server(a.reward, token, a.workers)
        try:
            keys = {"reward_token_file": str(token), "reward_batch_size": a.request_size, "reward_workers": a.workers}
            with RewardSet.from_config(DataConfig(reward=url, **keys)) as remote:
                service = timed(remote, batches)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    settings = {"reward": a.reward, "batch": a.batch, "request_size": a.request_size, "repeats": a.repeats}
    print(json.dumps(service | {"in_process": in_process} | settings | {"cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
