"""CPU seconds of a whole training launch, per process, for start methods side by side, printed as JSON.

A short run's cost is mostly its processes' start (imports, engine start, checkpoint writer), and part of it lands
in processes nobody waits for (`/usr/bin/time` misses those). This samples the job's process tree with psutil every
0.2 s and reports each process's last CPU time (user + system), the total and each process's peak resident memory
for each variant of `torchrun --nproc-per-node=N launch/train_moe.py trainer.steps=S logging.wandb.mode=disabled`,
run one after the other, and whether their step lines (up to the memory and timing fields) are identical.

`--warm` compares a fresh torchrun with the test suite's warm launch instead (tests/warm_torchrun.py: the same
torchrun with its agent and ranks forked from a process that imported torch, megatron-core and vLLM once; that
process's own start is reported apart, since the suite pays it once per pytest process). `--kv` compares the engines'
KV cache as the trainer sizes it (rollout.kv_cache_gib null, the default) with 1 GiB per engine.

  python bench/launch_cpu.py                 # 2 ranks, 3 steps: engines forked (default) vs spawned
  python bench/launch_cpu.py --steps 1 --nproc 1
  python bench/launch_cpu.py --warm          # fresh torchrun vs the tests' warm launch
  python bench/launch_cpu.py --kv            # KV cache sized by the trainer vs vLLM-CPU's 1 GiB per engine
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"fork": [], "spawn": ["rollout.cpu_start_method=spawn"]}
KV_VARIANTS = {"sized": [], "one_gib": ["rollout.kv_cache_gib=1"]}  # rollout.kv_cache_gib null: sized by the trainer


def _watch(root: psutil.Process, running, with_root: bool = True) -> dict[int, tuple[float, str, int]]:
    """CPU seconds, name and peak resident bytes (of the samples) of every process under `root` (and root itself),
    sampled every 0.2 s while running()."""
    seen: dict[int, tuple[float, str, int]] = {}
    while running():
        try:
            tree = [*([root] if with_root else []), *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                with p.oneshot():
                    cpu, rss = p.cpu_times(), p.memory_info().rss
                    seen[p.pid] = (cpu.user + cpu.system, p.name(), max(rss, seen.get(p.pid, (0, "", 0))[2]))
            except psutil.Error:
                pass
        time.sleep(0.2)
    return seen


def sample(cmd: list[str], env: dict, log: Path, warm=None) -> dict:
    """Run `cmd` (or, given a warm server, its torchrun arguments through it); CPU seconds per process of its tree
    (last sample), its wall time and its output."""
    start = time.perf_counter()
    if warm is None:
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            seen = _watch(psutil.Process(proc.pid), lambda: proc.poll() is None)
        code = proc.returncode
    else:  # the server's children only: the launch and what it starts, not the server's own imports
        result: dict = {}
        launch = threading.Thread(target=lambda: result.update(code=warm.run(cmd[3:], REPO, env, str(log), 900)))
        launch.start()
        seen = _watch(psutil.Process(warm.proc.pid), launch.is_alive, with_root=False)
        launch.join()
        code = result.get("code")
    wall = time.perf_counter() - start
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed ({code}); log: {log}")
    by_name: dict[str, float] = {}
    peak_rss: dict[str, list[float]] = {}  # each process's peak, GiB
    for cpu, name, rss in seen.values():
        by_name[name] = by_name.get(name, 0.0) + cpu
        peak_rss.setdefault(name, []).append(round(rss / 2**30, 3))
    steps = [line.split(" rss ")[0] for line in log.read_text().splitlines() if line.startswith("step ")]
    return {
        "cpu_s": sum(by_name.values()),
        "wall_s": wall,
        "cpu_s_by_process_name": by_name,
        "peak_rss_gib_by_process_name": {name: sorted(v, reverse=True) for name, v in peak_rss.items()},
        "steps": steps,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    p.add_argument("--warm", action="store_true", help="fresh torchrun vs the test suite's warm launch")
    p.add_argument("--kv", action="store_true", help="KV cache sized by the trainer vs 1 GiB per engine")
    a = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
    variants = {"warm": [], "fresh": []} if a.warm else KV_VARIANTS if a.kv else VARIANTS
    first, second = variants
    runs, extra = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in variants.items():
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}"]
            cmd += ["launch/train_moe.py", f"trainer.steps={a.steps}", "logging.wandb.mode=disabled"]
            cmd += [f"hydra.run.dir={Path(tmp) / name}", *overrides, *a.extra]
            print(f"[bench] {name}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
            warm = None
            if name == "warm":
                sys.path.insert(0, str(REPO))
                from tests.warm_torchrun import Server

                t0 = time.perf_counter()
                warm = Server(env, Path(tmp))
                cpu = psutil.Process(warm.proc.pid).cpu_times()
                extra = {"warm_server_start": {"wall_s": time.perf_counter() - t0, "cpu_s": cpu.user + cpu.system}}
            try:
                runs[name] = sample(cmd, env, Path(tmp) / f"{name}.log", warm)
            finally:
                if warm is not None:
                    warm.close()
    steps = {name: r.pop("steps") for name, r in runs.items()}
    out = {
        f"cpu_ratio_{first}_over_{second}": runs[first]["cpu_s"] / runs[second]["cpu_s"],
        f"wall_ratio_{first}_over_{second}": runs[first]["wall_s"] / runs[second]["wall_s"],
        "runs": runs,
        **extra,
        "step_lines_identical": steps[first] == steps[second] and len(steps[first]) == a.steps,
        "config": {"steps": a.steps, "nproc": a.nproc, "extra": a.extra, "variants": variants},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
