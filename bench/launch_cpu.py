"""CPU seconds of a whole training launch, per process, for start methods side by side, printed as JSON.

A short run's cost is mostly its processes' start (imports, engine start, checkpoint writer), and part of it lands
in processes nobody waits for (`/usr/bin/time` misses those). This samples the job's process tree with psutil every
0.2 s and reports each process's last CPU time (user + system) and the total, for each variant of
`torchrun --nproc-per-node=N launch/train_moe.py trainer.steps=S logging.wandb.mode=disabled`, run one after the
other, and whether their step lines (up to the memory and timing fields) are identical.

  python bench/launch_cpu.py                 # 2 ranks, 3 steps: engines forked (default) vs spawned
  python bench/launch_cpu.py --steps 1 --nproc 1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"fork": [], "spawn": ["rollout.cpu_start_method=spawn"]}


def sample(cmd: list[str], env: dict, log: Path) -> dict:
    """Run `cmd`; CPU seconds per process of its tree (last sample), its wall time and its output."""
    seen: dict[int, tuple[float, str]] = {}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in tree:
                try:
                    with p.oneshot():
                        cpu = p.cpu_times()
                        seen[p.pid] = (cpu.user + cpu.system, p.name())
                except psutil.Error:
                    pass
            time.sleep(0.2)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}); log: {log}")
    by_name: dict[str, float] = {}
    for cpu, name in seen.values():
        by_name[name] = by_name.get(name, 0.0) + cpu
    steps = [line.split(" rss ")[0] for line in log.read_text().splitlines() if line.startswith("step ")]
    return {"cpu_s": sum(by_name.values()), "wall_s": wall, "cpu_s_by_process_name": by_name, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in VARIANTS.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
            cmd += ["launch/train_moe.py", f"trainer.steps={a.steps}", "logging.wandb.mode=disabled"]
            cmd += [f"hydra.run.dir={Path(tmp) / name}", *overrides, *a.extra]
            print(f"[bench] {name}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            runs[name] = sample(cmd, env, Path(tmp) / f"{name}.log")
    steps = {name: r.pop("steps") for name, r in runs.items()}
    out = {
        "cpu_ratio_fork_over_spawn": runs["fork"]["cpu_s"] / runs["spawn"]["cpu_s"],
        "wall_ratio_fork_over_spawn": runs["fork"]["wall_s"] / runs["spawn"]["wall_s"],
        "runs": runs,
        "step_lines_identical": steps["fork"] == steps["spawn"] and len(steps["fork"]) == a.steps,
        "config": {"steps": a.steps, "nproc": a.nproc, "extra": a.extra, "variants": VARIANTS},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
