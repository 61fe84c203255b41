"""For the benchmarks that run `torchrun` on themselves (weight_sync.py, grad_sync.py): the parent builds a tiny
model and launches the script's `--child` on N ranks; the child takes one `parallel.<key>=<size>` layout and writes
its JSON result to `--out`, which the parent prints."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_on_ranks(script: str, nproc: int, spec: dict, args: list[str]) -> str:
    """`torchrun --nproc-per-node=nproc script --child --model M --out O *args` on a fresh tiny model (`spec`:
    TinySpec fields); returns the result the child wrote, or exits with the end of the log."""
    from moe_rl.models.tiny import TinySpec, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="moe-rl-bench-") as tmp:
        model = build_tiny_model(TinySpec(**spec), Path(tmp) / "model")
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += [script, "--child", "--model", str(model), "--out", str(out), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode or not out.exists():
            sys.exit(f"benchmark failed:\n{(proc.stdout + proc.stderr)[-5000:]}")
        return out.read_text()


def parallel_config(layout: str):
    """The ParallelConfig of one `parallel.<key>=<size>` override ("" for data parallel only)."""
    from moe_rl.actor.config import ParallelConfig

    if not layout:
        return ParallelConfig()
    key, value = layout.split("=")
    return ParallelConfig(**{key.removeprefix("parallel."): int(value)})


def arguments(doc: str, layout: str, repeats: int, layout_help: str) -> argparse.ArgumentParser:
    """The options every such bench takes: --nproc, --layout, --repeats, and the child's hidden ones."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layout", default=layout, help=layout_help)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p
