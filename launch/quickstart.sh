#!/usr/bin/env bash
# Fresh machine to a running RL job: set up the environment, then train the built-in tiny MoE
# on the toy task with R3 + GSPO + IcePop on 2 processes (gloo). Extra arguments are Hydra
# overrides, e.g. `bash launch/quickstart.sh trainer.steps=5 parallel.ep=2`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
VENV="$(bash "$ROOT/launch/setup_env.sh" --print-venv)"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # torchrun's default for its ranks; set, torchrun prints no notice
export PYTHONWARNINGS=ignore  # the launcher sends vLLM's INFO records to the run's train_moe.log
exec "$VENV/bin/torchrun" --standalone --nproc-per-node=2 launch/train_moe.py "$@"
