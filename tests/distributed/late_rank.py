"""`torchrun ... -m tests.distributed.late_rank SCRIPT ARGS`: run SCRIPT as `__main__` after 1.5 s per rank, so that
the ranks of one launch start on different seconds for certain. With MOE_RL_TEST_FAIL_FIRST_ATTEMPT=1, rank 1 of
torchrun's first attempt exits with status 1 once the script is done (torchrun --max-restarts then starts another)."""

from __future__ import annotations

import atexit
import os
import runpy
import sys
import time

if __name__ == "__main__":
    time.sleep(1.5 * int(os.environ["RANK"]))
    if os.environ.get("MOE_RL_TEST_FAIL_FIRST_ATTEMPT") == "1" and os.environ["RANK"] == "1":
        if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            atexit.register(os._exit, 1)  # the script ends through its atexit handlers (trainer.signals.run_then_exit)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
