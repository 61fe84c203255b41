#!/usr/bin/env bash
# Set up (or reuse) the environment, then run the test suite.
#
#   bash launch/test.sh                                            # everything (CI)
#   bash launch/test.sh -m "not distributed and not engine and not e2e"   # fast subset: pytest with these arguments
#
# Without arguments the suite runs as two concurrent lanes and a tail, so that it fits CI's budget on 2 cores
# (a multi-process run keeps about one core busy, the other waits on it):
#   lane A  tests/e2e but the critic's, packing's, buffer's and bad inputs'  full training runs (torchrun with engines)
#   lane B  tests/engine tests/kernels tests/unit tests/distributed tests/gpu   in-process engines, kernels, unit
#           tests, the multi-process actor checks (no engines), the GPU tests (skipped without CUDA), then the critic's, packing's, replay
#           buffer's and bad inputs' training runs (moved here so that the lanes take about as long)
#   tail    tests marked `isolated` (tests/faults, tests/slurm and the engine-shutdown check): they count the
#           processes, /dev/shm files and temp-folder sockets they see. Where namespaces can be made (root, as in
#           CI) the tail runs beside the lanes in its own: a pid namespace, a private /dev/shm and its own temp
#           folder, so that all it sees is its own. Elsewhere it runs alone after the lanes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
VENV="$(bash "$ROOT/launch/setup_env.sh" --print-venv)"
cd "$ROOT"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::DeprecationWarning}"
PYTEST=("$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=30)
if (($#)); then
  exec "${PYTEST[@]}" "$@"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/moe-rl-tests.XXXXXX")"
start=$SECONDS
MOVED=(tests/e2e/test_critic.py tests/e2e/test_packing_runs.py tests/e2e/test_buffer.py tests/e2e/test_bad_inputs.py)  # e2e files that run in lane B
LANE_B=(tests/engine tests/kernels tests/unit tests/distributed tests/gpu "${MOVED[@]}")
"${PYTEST[@]}" -m "not isolated" --basetemp="$WORK/lane_b" "${LANE_B[@]}" >"$WORK/lane_b.log" 2>&1 &
lane_b=$!
TAIL=("${PYTEST[@]}" -m isolated tests/engine tests/faults tests/slurm)
ISOLATE=(unshare --mount --pid --fork --mount-proc)
PRIVATE_SHM='mount -t tmpfs -o mode=1777 tmpfs /dev/shm && TMPDIR="$1" exec "${@:2}"'
tail_pid=""
if "${ISOLATE[@]}" bash -c "${PRIVATE_SHM/exec/true}" _ /tmp 2>/dev/null; then
  mkdir "$WORK/tail_tmp"
  echo "[test] tail: isolated tests beside the lanes, in their own pid namespace, /dev/shm and temp folder"
  "${ISOLATE[@]}" bash -c "$PRIVATE_SHM" _ "$WORK/tail_tmp" "${TAIL[@]}" >"$WORK/tail.log" 2>&1 &
  tail_pid=$!
fi
echo "[test] lane A: tests/e2e but ${MOVED[*]} (lane B, ${LANE_B[*]}, runs beside it)"
rc_a=0
"${PYTEST[@]}" -m "not isolated" "${MOVED[@]/#/--ignore=}" tests/e2e || rc_a=$?
rc_b=0
wait "$lane_b" || rc_b=$?
echo "[test] lane B output:"
cat "$WORK/lane_b.log"
rc_c=0
if [[ -n "$tail_pid" ]]; then
  wait "$tail_pid" || rc_c=$?
  echo "[test] tail output (isolated tests, in their own namespaces):"
  cat "$WORK/tail.log"
else
  echo "[test] tail (isolated tests, alone: no namespaces here):"
  "${TAIL[@]}" || rc_c=$?
fi
echo "[test] lanes A/B/tail exit codes $rc_a/$rc_b/$rc_c, $((SECONDS - start)) s"
rm -rf "$WORK"
exit $((rc_a || rc_b || rc_c))
