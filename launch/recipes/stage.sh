# Sourced by the recipes in this folder: one stage of a recipe, timed, its output kept in a log.

stage() {  # stage NAME LOG command...: run it, say one line, keep its output in LOG
  local name=$1 log=$2 start=$SECONDS
  shift 2
  if ! "$@" >"$log" 2>&1; then
    echo "[recipe] $name failed after $((SECONDS - start)) s; the end of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  echo "[recipe] $name: $((SECONDS - start)) s (log: $log)"
  echo $((SECONDS - start)) >"$log.seconds"
}
