"""One run directory for every rank of a job.

Hydra resolves `hydra.run.dir` in each process. With its `${now:...}`, two ranks that start on either side of a
second boundary got two directories: rank 0 wrote the tiny model into its own, and rank 1 failed with "config.json
not found" in the other (the quickstart failed that way whenever its ranks started a second apart).
`${run_stamp:...}` is `now` agreed through torchrun's store; `check_same_run_dir` stops a job whose ranks still
disagree (a launcher without torchrun's store, a `${now:}` of the user's own) before anything is written.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path


def agreed_now(pattern: str) -> str:
    """The time formatted with `pattern` (strftime), the same on every rank of a torchrun job: the first rank
    to ask stores its stamp in the launcher's store and every rank reads that one. Elsewhere (one process, a
    launcher without torchrun's store) it is this process's time."""
    # torch (actor.parallel): not loaded by importing this module
    from moe_rl.actor.parallel import torchrun_store

    stamp = datetime.now().strftime(pattern)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or (store := torchrun_store(timedelta(seconds=120))) is None:
        return stamp
    # Not keyed by the attempt: a restarted attempt (torchrun --max-restarts) runs in the first one's directory
    # and resumes its newest checkpoint (trainer.resume=auto); the agent's store outlives its workers.
    key = f"moe_rl/run_stamp/{pattern}"
    return store.compare_set(key, "", stamp).decode()


def register_run_stamp() -> None:
    """Make `${run_stamp:<strftime pattern>}` available to Hydra's config (conf/train_moe.yaml's run dir)."""
    # heavy: omegaconf, imported on first use
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", agreed_now, use_cache=True)


def check_same_run_dir(run_dir: Path) -> None:
    """Fail on every rank, naming the directories, when the ranks of a job were given different run directories
    (call after torch.distributed is up)."""
    # torch (common.distributed): not loaded by importing this module
    from moe_rl.common.distributed import all_gather_objects

    dirs = all_gather_objects(str(Path(run_dir).absolute()))
    if len(set(dirs)) > 1:
        listing = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dirs))
        raise ValueError(
            f"the ranks of this job run in different directories ({listing}); give every rank the same "
            "hydra.run.dir (a `${now:...}` in it is resolved by each process: use `${run_stamp:...}`, which "
            "torchrun's ranks agree on)"
        )
