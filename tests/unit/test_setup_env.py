"""launch/setup_env.sh, which quickstart.sh and test.sh run first: a venv that already holds this setup.py's
dependencies and the editable install of this checkout is reused without running pip; one installed from another
checkout gets its editable install pointed here; one set up from another setup.py is installed again, and the line
before says which case it is. Run against a stand-in venv whose `python` records its arguments, runs pip as a no-op
and hands everything else to this interpreter, so no package is installed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >> "{venv}/calls"\n'
        'if [[ "$1" == "-m" && "$2" == "pip" ]]; then exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return venv


def _run(venv: Path) -> tuple[str, list[str]]:
    calls = venv / "calls"
    calls.unlink(missing_ok=True)
    out = subprocess.run(
        ["bash", str(REPO / "launch" / "setup_env.sh")],
        env={**os.environ, "MOE_RL_VENV": str(venv), "MOE_RL_EXTRAS": "cpu,dev"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    pip = [c for c in calls.read_text().splitlines() if c.startswith("-m pip")]
    return out.stdout, pip


def test_setup_env_runs_pip_only_when_the_venv_lacks_this_checkout(tmp_path):
    venv = _venv(tmp_path)
    versions = (
        f"[setup_env] torch {version('torch')} | megatron-core {version('megatron-core')} | "
        f"transformers {version('transformers')}\n"
    )

    out, pip = _run(venv)  # a new venv: the dependencies, then the stamp naming this checkout
    assert f"-m pip install -q -e {REPO}[cpu,dev]" in pip
    (stamp,) = venv.glob(".moe-rl-deps-*")
    assert stamp.read_text().strip() == str(REPO)
    assert "(first time: a few minutes)" in out and out.endswith(versions)

    out, pip = _run(venv)  # the same checkout again: no pip at all
    assert pip == [] and out == versions

    stamp.write_text("/another/checkout\n")  # the venv was last installed from another checkout
    out, pip = _run(venv)
    assert pip == [f"-m pip install -q --no-deps --no-build-isolation -e {REPO}"]
    assert stamp.read_text().strip() == str(REPO) and out == versions

    stamp.rename(venv / ".moe-rl-deps-0000000000000000-cpu_dev")  # set up from an older setup.py: all again
    out, pip = _run(venv)
    assert f"-m pip install -q -e {REPO}[cpu,dev]" in pip
    assert "set up from another setup.py" in out and "first time" not in out
    assert [p.name for p in venv.glob(".moe-rl-deps-*")] == [stamp.name]


def test_setup_env_says_the_sandbox_needs_bubblewrap_where_it_cannot_install_it(tmp_path):
    """Without bwrap on PATH and not root, one line names the Debian package; with it, not a word (above)."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for tool in ("bash", "cat", "sha256sum", "cut", "dirname", "rm"):
        (tools / tool).symlink_to(shutil.which(tool))
    (tools / "id").write_text("#!/bin/sh\necho 1000\n")  # not root: nothing is installed
    (tools / "id").chmod(0o755)
    venv = _venv(tmp_path)
    out = subprocess.run(
        [str(tools / "bash"), str(REPO / "launch" / "setup_env.sh")],
        env={"PATH": str(tools), "HOME": str(tmp_path), "MOE_RL_VENV": str(venv), "MOE_RL_EXTRAS": "cpu,dev"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == (
        "[setup_env] the code sandbox needs the Debian package bubblewrap (apt-get install bubblewrap, as root)"
    )
