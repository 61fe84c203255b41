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

run_and_requeue() {
  "$@" &
  local step=$! status=0
  trap 'if [[ "${STOPPING:-0}" != 1 ]]; then echo "[moe-rl] stop signal: checkpoint, then requeue"; STOPPING=1; signal_steps; fi' TERM USR1
  wait "$step" || status=$?
  while kill -0 "$step" 2>/dev/null; do wait "$step" || status=$?; done  # `wait` returns early on a trap
  if [[ "${STOPPING:-0}" == 1 && "${MOE_RL_NO_REQUEUE:-0}" != 1 ]]; then
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
