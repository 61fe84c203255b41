#!/usr/bin/env bash
# Set up (or reuse) the environment, then run the test suite. Extra arguments go to pytest.
#
#   bash launch/test.sh                                            # everything (CI)
#   bash launch/test.sh -m "not distributed and not engine and not e2e"   # fast subset
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/launch/setup_env.sh"
VENV="$(bash "$ROOT/launch/setup_env.sh" --print-venv)"
cd "$ROOT"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::DeprecationWarning}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=30 "${@:-tests}"
