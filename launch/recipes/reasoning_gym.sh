#!/usr/bin/env bash
# SFT then RL on reasoning-gym datasets (the reasoning-gym package's own generators and verifiers) on a CPU, through
# the path a user's own data takes: the problems are written to verl-format parquet files
# (`python -m moe_rl.data.tasks reasoning_gym`), read back with data.task=file, and both models are scored by
# `moe-rl-eval` with each dataset's own score_answer on held-out problems (a test draw from seeds no training draw
# uses, without any question of the train draw).
#
#   bash launch/recipes/reasoning_gym.sh OUT_DIR [SFT_STEPS] [RL_STEPS]
#
# Leaves OUT_DIR/data (train, SFT, val and test parquet), OUT_DIR/sft/hf and OUT_DIR/rl/hf, each stage's log, and
# OUT_DIR/summary.json: {"sft": {"pass@1", "pass@8", "minutes"}, "rl": {..., "ppo_kl_mean", "gain_pass@1"},
# "test_problems", "datasets" (with their settings and weights), "test_seeds" (the seed range the test entries come
# from)}. Measured with it: docs/guides/reasoning-gym.md.
set -euo pipefail
OUT=${1:?usage: bash launch/recipes/reasoning_gym.sh OUT_DIR [SFT_STEPS] [RL_STEPS]}
SFT_STEPS=${2:-600}
RL_STEPS=${3:-200}
HERE=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-$(bash "$HERE/launch/setup_env.sh" --print-venv)/bin/python}  # the environment launch/setup_env.sh made
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node=2)
TEST_N=500
# Two-term sums and differences of numbers up to 99, "Calculate 64 + 20." (basic_arithmetic), the response the bare
# answer. RG_DATASETS (name[:weight],...) and RG_SETTINGS (JSON {name: {config key: value}}) choose others; prompts
# cost: chain_sum's longer template ("State the final answer to the following arithmetic problem: 74 + 30 =", 65
# tokens with the chat template against 38) made an SFT step 2.0 s instead of ~1 s on 2 shared cores.
DATASETS=${RG_DATASETS:-basic_arithmetic}
SETTINGS=${RG_SETTINGS:-'{"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2,
  "operators": ["+", "-"], "allow_parentheses": false, "allow_negation": false}}'}
mkdir -p "$OUT/data"
OUT=$(cd "$OUT" && pwd)
D=$OUT/data
cd "$HERE"
export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore VLLM_CONFIGURE_LOGGING=0

source "$HERE/launch/recipes/stage.sh"  # stage NAME LOG command...

write() {  # write SPLIT N SEED OUT_FILE [options]: a draw of the datasets as parquet
  "$PY" -m moe_rl.data.tasks reasoning_gym --datasets "$DATASETS" --settings "$SETTINGS" --split "$1" --n "$2" \
    --seed "$3" --out "$4" "${@:5}"
}

evaluate() {  # evaluate NAME MODEL
  stage "$1 test ($TEST_N problems)" "$OUT/$1_eval.log" "$PY" -m moe_rl.tools.evaluate --model "$2" \
    --data "$D/test.parquet" --k 8 --temperature 1.0 --max-tokens 16 --stop $'\n' \
    --out "$OUT/$1_eval.json"
  echo "[recipe] $1: $(cat "$OUT/$1_eval.json")"
}

# SFT's examples and RL's prompts are different problems (RL on SFT's own problems mostly polishes memorized
# answers); validation and test problems are in neither.
write train 8000 0 "$D/sft.parquet" --format sft --response worked 2>"$OUT/data.log"
write train 8000 1 "$D/train.parquet" --exclude "$D/sft.parquet" 2>>"$OUT/data.log"
write val 200 0 "$D/val.parquet" --exclude "$D/sft.parquet" --exclude "$D/train.parquet" 2>>"$OUT/data.log"
write test "$TEST_N" 0 "$D/test.parquet" --exclude "$D/sft.parquet" --exclude "$D/train.parquet" \
  --exclude "$D/val.parquet" 2>>"$OUT/data.log"
echo "[recipe] data: $(wc -l <"$OUT/data.log") files in $D"
stage "model (10.9M qwen3_moe)" "$OUT/model.log" "$PY" -m moe_rl.tools.tiny_model --size small --out "$OUT/model"
stage "SFT ($SFT_STEPS steps)" "$OUT/sft.log" "${TORCHRUN[@]}" launch/sft_moe.py hydra.run.dir="$OUT/sft" \
  model.path="$OUT/model" data.task=file data.path="$D/sft.parquet" trainer.steps="$SFT_STEPS" \
  trainer.checkpoint_every=0 logging.wandb.mode=disabled
evaluate sft "$OUT/sft/hf"
stage "RL ($RL_STEPS steps)" "$OUT/rl.log" "${TORCHRUN[@]}" launch/train_moe.py --config-name=reasoning_gym_rl \
  hydra.run.dir="$OUT/rl" model.path="$OUT/sft/hf" data.path="$D/train.parquet" data.val_path="$D/val.parquet" \
  trainer.steps="$RL_STEPS" logging.wandb.mode=disabled
stage "RL export" "$OUT/rl_export.log" "$PY" -m moe_rl.tools.export_hf "$OUT/rl/checkpoints" --out "$OUT/rl/hf"
evaluate rl "$OUT/rl/hf"

"$PY" - "$OUT" "$TEST_N" "$DATASETS" "$SETTINGS" <<'PYEOF'
import json, sys
from pathlib import Path
from moe_rl.data.reasoning_gym import seed_range
out, n, names, settings = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(","), json.loads(sys.argv[4])
def stage(name, train_log):
    result = json.loads((out / f"{name}_eval.json").read_text())
    seconds = int((out / f"{train_log}.seconds").read_text())
    return {"pass@1": result["pass@1"], "pass@8": result["pass@8"], "minutes": round(seconds / 60, 1),
            "by_source": result["by_source"]}
summary = {"sft": stage("sft", "sft.log"), "rl": stage("rl", "rl.log"), "test_problems": n}
steps = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
kl = [r["actor/ppo_kl"] for r in steps if "actor/ppo_kl" in r]
summary["rl"]["ppo_kl_mean"] = sum(kl) / len(kl)  # the policy's pace: mean over the RL steps
summary["rl"]["gain_pass@1"] = round(summary["rl"]["pass@1"] - summary["sft"]["pass@1"], 3)
weights = {m.partition(":")[0]: float(m.partition(":")[2] or 1) for m in names}
summary["datasets"] = {m: {"weight": w, "settings": settings.get(m, {})} for m, w in weights.items()}
summary["test_seeds"] = list(seed_range("test", 0))  # the test entries' seed + index range [start, end)
summary["train_seeds"] = list(seed_range("train", 0))
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print("[recipe] summary:", json.dumps(summary))
PYEOF
