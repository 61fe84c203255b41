# Shared by the sbatch templates (sourced).

# torchrun kills its ranks 30 s after it forwards a stop signal to them (its --shutdown-timeout), and a large
# model's checkpoint takes longer: give the save as long as the templates' --signal=B:TERM@<seconds> lead (300 s
# at most), after which Slurm ends the job anyway. Not more: the same wait applies when a rank has crashed and
# the others are stuck in a collective with it.
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}"

# Ranks per node: the GPUs Slurm gave us, else the fallback (CPU ranks).
gpus_on_node() {
  local n
  n=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  if [[ "${n:-0}" -gt 0 ]]; then echo "$n"; else echo "$1"; fi
}

# Run the job step in the background so the batch shell can take the signal Slurm sends before
# the time limit (--signal=B:TERM@...): forward it to the step's tasks (torchrun -> trainer
# checkpoints at the next step boundary), wait for the step to finish, then requeue the job. The
# requeued job keeps its id and run directory and resumes (trainer.resume=auto).
# The signal goes through `scancel --signal` to the step: a SIGTERM to srun itself makes srun
# kill the tasks without giving them time to checkpoint.
signal_steps() {
  local s
  for s in $(squeue -h -s -j "$SLURM_JOB_ID" -o %i | grep -v -e batch -e extern); do
    scancel --signal=TERM "$s" || true
  done
}

#
# A job that hung (the trainer's hang watchdog wrote $RUN_DIR/hang_report.txt during this attempt, and every rank
# exited) is requeued too, while it has been requeued fewer than MOE_RL_HANG_REQUEUES (default 3) times: the next
# attempt resumes from the newest checkpoint, most likely on other nodes.
run_and_requeue() {
  local started
  started=$(mktemp)
  "$@" &
  local step=$! status=0
  trap 'if [[ "${STOPPING:-0}" != 1 ]]; then echo "[moe-rl] stop signal: checkpoint, then requeue"; STOPPING=1; signal_steps; fi' TERM USR1
  wait "$step" || status=$?
  while kill -0 "$step" 2>/dev/null; do wait "$step" || status=$?; done  # `wait` returns early on a trap
  local report="${RUN_DIR:-}/hang_report.txt" restarts="${SLURM_RESTART_COUNT:-0}"
  if [[ "${MOE_RL_NO_REQUEUE:-0}" == 1 ]]; then
    :
  elif [[ "${STOPPING:-0}" == 1 ]]; then
    scontrol requeue "$SLURM_JOB_ID"
  elif [[ "$status" != 0 && -n "${RUN_DIR:-}" && "$report" -nt "$started" ]]; then
    if ((restarts < ${MOE_RL_HANG_REQUEUES:-3})); then
      echo "[moe-rl] the job hung ($report): requeue, restart $((restarts + 1)) of at most ${MOE_RL_HANG_REQUEUES:-3}"
      scontrol requeue "$SLURM_JOB_ID"
    else
      echo "[moe-rl] the job hung ($report) after $restarts restarts (MOE_RL_HANG_REQUEUES=${MOE_RL_HANG_REQUEUES:-3}): not requeued"
    fi
  fi
  rm -f "$started"
  return "$status"
}
