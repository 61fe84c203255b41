#!/usr/bin/env bash
# The checks a CPU machine cannot run, on one GPU with torch + Triton (no vLLM needed): the kernel tests with
# compiled Triton kernels (megatron's batch-invariant kernels too), the kernel benchmarks, and the tests marked
# `gpu` (actor.distributed_optimizer against the CPU-path optimizer; the SFT step against transformers). Each step
# has its own time limit and log ($OUT/<step>.log, whose tail is printed), so one that hangs or fails does not cost
# the others.
#
#   OUT=/tmp/gpu_check bash bench/gpu_check.sh
#   STEPS="kernel_tests gpu_tests" OUT=/tmp/gpu_check bash bench/gpu_check.sh     # some of the steps
#
# megatron-core is taken from .gpu_site/ when it is not installed (copy site-packages/megatron there).
set -u
OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}"
[ -e moe_rl/kernels ] || ln -s ../kernels moe_rl/kernels  # what setup.py's package_dir does for an install

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    [[ -z "${STEPS:-}" || " $STEPS " == *" $name "* ]] || return 0
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s"
    tail -n "${TAIL:-12}" "$OUT/$name.log"
}

step env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, triton; print(torch.__version__, triton.__version__)'"
step kernel_tests 150 env MOE_RL_KERNEL_DEVICE=cuda "$PY" -m pytest tests/kernels -q -p no:cacheprovider -n 8 -rs
step bench_gspo 60 "$PY" bench/kernels.py --only gspo --budget-s 10
step bench_logprob 100 "$PY" bench/kernels.py --only logprob --tokens 4096 --vocab 32768 --budget-s 10
step gpu_tests 150 "$PY" -m pytest tests/gpu -q -p no:cacheprovider -rs -x -s
