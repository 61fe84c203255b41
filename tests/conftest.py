"""Shared fixtures: tiny HF models built once per session, markers, distributed launch helper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Tiny models used across the suite: name -> tiny_model CLI arguments.
TINY = {
    "qwen3_moe": ["--arch", "qwen3_moe", "--dense-layers", "1"],
    "mixtral": ["--arch", "mixtral"],
    "olmoe": ["--arch", "olmoe"],
    "qwen3_moe_320e": [
        "--arch",
        "qwen3_moe",
        "--num-experts",
        "320",
        "--topk",
        "4",
        "--layers",
        "2",
        "--moe-intermediate",
        "16",
    ],
}


def pytest_configure(config):
    for name, doc in {
        "distributed": "multi-process torchrun/gloo runs",
        "engine": "starts a vLLM engine",
        "e2e": "end-to-end training runs",
        "kernels": "Triton kernels under the interpreter",
        "slow": "takes more than ~30 s",
    }.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    # megatron-core and vLLM deprecation chatter is not ours to fix.
    config.addinivalue_line("filterwarnings", "ignore::DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore::FutureWarning")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """Build every tiny model once per session (seconds)."""
    from moe_rl.tools.tiny_model import main

    root = tmp_path_factory.mktemp("tiny_models")
    out = {}
    for name, args in TINY.items():
        main([*args, "--out", str(root / name), "--seed", "7"])
        out[name] = root / name
    return out


@pytest.fixture(scope="session")
def world1():
    """A gloo world of 1 with megatron-core parallel state (re-initialised by each build)."""
    from moe_rl.actor.parallel import ParallelConfig, init_distributed

    init_distributed(ParallelConfig())
    yield


def torchrun(module: str, nproc: int, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node=nproc -m module args` from the repo root; fail with its log."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--standalone",
        "-m",
        module,
        *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def read_json_results(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]
