"""Several jobs of one torchrun worker in one launch:

  torchrun --nproc-per-node=N -m tests.distributed.jobs tests.distributed.parity_worker JOBS.json

JOBS.json is a list of argument lists; each goes to the worker's `run(argv)` in turn, on the same ranks. A rank
imports torch, megatron-core and transformers once (about 12 s of CPU on a 2-core machine) instead of once per
job; each job sets up megatron's parallel state for its own layout (`init_distributed`), over the same process
group.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path


def main() -> None:
    sys.path.insert(0, os.getcwd())
    from moe_rl.actor.parallel import destroy_distributed

    worker = importlib.import_module(sys.argv[1])
    for argv in json.loads(Path(sys.argv[2]).read_text()):
        worker.run(argv)
    destroy_distributed()


if __name__ == "__main__":
    main()
