"""`torchrun ... -m tests.distributed.late_rank SCRIPT ARGS`: run SCRIPT as `__main__` after 1.5 s per rank, so that
the ranks of one launch start on different seconds for certain."""

from __future__ import annotations

import os
import runpy
import sys
import time

if __name__ == "__main__":
    time.sleep(1.5 * int(os.environ["RANK"]))
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
