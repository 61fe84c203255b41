"""The templates' torchrun gives ranks time to checkpoint after a stop signal: torch's own default SIGKILLs
them 30 s after it forwards the signal, which a large model's save outlasts (launch/slurm/common.sh).
No Slurm needed: the signal reaches every process of the step, as `scancel --signal=TERM` delivers it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.distributed, pytest.mark.isolated]

SLOW_SAVER = r"""
import signal, sys, time
asked = []
signal.signal(signal.SIGTERM, lambda *_: asked.append(1))  # Slurm's signal and torchrun's: one request
print("ready", flush=True)
while not asked:
    time.sleep(0.1)
time.sleep(35)  # the checkpoint: longer than torchrun's default 30 s
open(sys.argv[1], "w").write("saved")
"""


def test_a_save_longer_than_torchruns_default_grace_completes(tmp_path):
    script, done = tmp_path / "slow_saver.py", tmp_path / "saved"
    script.write_text(SLOW_SAVER)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # this environment's torchrun
    cmd = f'source launch/slurm/common.sh && exec torchrun --standalone --nproc-per-node=1 "{script}" "{done}"'
    proc = subprocess.Popen(
        ["bash", "-c", cmd], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        lines = []
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            lines.append(line)
        assert line, "".join(lines)
        for p in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            p.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert done.is_file(), f"the rank was killed before its 35 s save finished:\n{''.join(lines)}{out[-3000:]}"
