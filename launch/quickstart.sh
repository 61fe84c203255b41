#!/usr/bin/env bash
# Fresh machine to a running job: set up the environment, build a tiny MoE and score prompts
# with the Megatron actor on 2 processes (tensor parallel 2 + sequence parallel, gloo).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
VENV="$(bash "$ROOT/launch/setup_env.sh" --print-venv)"
MODEL="${MOE_RL_TINY_MODEL:-/tmp/moe-rl-tiny-qwen3}"
cd "$ROOT"
export PYTHONWARNINGS=ignore
"$VENV/bin/python" -m moe_rl.tools.tiny_model --arch qwen3_moe --dense-layers 1 --out "$MODEL"
"$VENV/bin/torchrun" --standalone --nproc-per-node=2 -m moe_rl.tools.logprobs --model "$MODEL" --tp 2
