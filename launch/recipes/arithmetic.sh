#!/usr/bin/env bash
# A small MoE that learns arithmetic on a CPU: build the model, SFT on worked solutions, RL (GSPO + IcePop + R3,
# conf/arithmetic_rl.yaml) on the integer answers, and score both models on the test split (pass@1 greedy, pass@8 at
# temperature 1).
#
#   bash launch/recipes/arithmetic.sh OUT_DIR [SFT_STEPS] [RL_STEPS]
#
# Leaves OUT_DIR/sft/hf and OUT_DIR/rl/hf (HF folders vLLM and transformers load), each stage's run folder and log,
# and OUT_DIR/summary.json: {"sft": {"pass@1", "pass@8", "pass@1_other_draw", "minutes"}, "rl": {..., "ppo_kl_mean",
# "gain_pass@1", "gain_pass@1_other_draw"}, "test_problems": N} (the other draw: 1,000 test problems of seed 11, greedy).
# One line per stage on the console. Numbers measured with it: docs/guides/sft.md.
set -euo pipefail
OUT=${1:?usage: bash launch/recipes/arithmetic.sh OUT_DIR [SFT_STEPS] [RL_STEPS]}
SFT_STEPS=${2:-900}
RL_STEPS=${3:-320}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$(bash "$HERE/launch/setup_env.sh" --print-venv)/bin/python}  # the environment launch/setup_env.sh made
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node=2)
TEST_N=500
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$HERE"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore VLLM_CONFIGURE_LOGGING=0

source "$HERE/launch/recipes/stage.sh"  # stage NAME LOG command...

evaluate() {  # evaluate NAME MODEL: moe-rl-eval (python -m moe_rl.tools.evaluate) on the test split
  stage "$1 test split ($TEST_N problems)" "$OUT/$1_eval.log" \
    "$PY" -m moe_rl.tools.evaluate --model "$2" --task arithmetic --split test --n "$TEST_N" --k 8 --temperature 1.0 --out "$OUT/$1_eval.json"
  echo "[recipe] $1: $(cat "$OUT/$1_eval.json")"
  # the yardstick's second half: 1,000 test problems of another draw (seed 11), greedy, at most 64 tokens
  stage "$1 test split, another draw (1000 problems)" "$OUT/$1_other.log" \
    "$PY" -m moe_rl.tools.evaluate --model "$2" --task arithmetic --split test --n 1000 --seed 11 --k 1 \
    --temperature 0 --max-tokens 64 --out "$OUT/$1_other.json"
}

stage "model (10.9M qwen3_moe)" "$OUT/model.log" "$PY" -m moe_rl.tools.tiny_model --size small --out "$OUT/model"
stage "SFT ($SFT_STEPS steps)" "$OUT/sft.log" "${TORCHRUN[@]}" launch/sft_moe.py hydra.run.dir="$OUT/sft" \
  model.path="$OUT/model" trainer.steps="$SFT_STEPS" trainer.val_every=100 trainer.checkpoint_every=0 \
  logging.wandb.mode=disabled
evaluate sft "$OUT/sft/hf"
stage "RL ($RL_STEPS steps)" "$OUT/rl.log" "${TORCHRUN[@]}" launch/train_moe.py --config-name=arithmetic_rl \
  hydra.run.dir="$OUT/rl" model.path="$OUT/sft/hf" trainer.steps="$RL_STEPS" logging.wandb.mode=disabled
stage "RL export" "$OUT/rl_export.log" "$PY" -m moe_rl.tools.export_hf "$OUT/rl/checkpoints" --out "$OUT/rl/hf"
evaluate rl "$OUT/rl/hf"

"$PY" - "$OUT" "$TEST_N" <<'PYEOF'
import json, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
def stage(name, train_log):
    result = json.loads((out / f"{name}_eval.json").read_text())
    seconds = int((out / f"{train_log}.seconds").read_text())
    other = json.loads((out / f"{name}_other.json").read_text())["pass@1"]
    return {"pass@1": result["pass@1"], "pass@8": result["pass@8"], "pass@1_other_draw": other,
            "minutes": round(seconds / 60, 1)}
summary = {"sft": stage("sft", "sft.log"), "rl": stage("rl", "rl.log"), "test_problems": n}
steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
kl = [r["actor/ppo_kl"] for r in steps if "actor/ppo_kl" in r]
summary["rl"]["ppo_kl_mean"] = sum(kl) / len(kl)  # the policy's pace: mean over the RL steps
summary["rl"]["gain_pass@1"] = round(summary["rl"]["pass@1"] - summary["sft"]["pass@1"], 3)
summary["rl"]["gain_pass@1_other_draw"] = round(
    summary["rl"]["pass@1_other_draw"] - summary["sft"]["pass@1_other_draw"], 3)
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print("[recipe] summary:", json.dumps(summary))
PYEOF
