"""What the launch/ scripts (train_moe.py, sft_moe.py) share: a refused setting said in one line, and `--keys`."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from typing import NoReturn

from moe_rl.config import TrainConfig
from moe_rl.config.describe import describe_keys


def refuse(error: Exception) -> NoReturn:
    """A setting that cannot run: one line, said once (by rank 0), not a traceback from every rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[moe-rl] {error}", file=sys.stderr, flush=True)
    else:  # torchrun stops the job at the first rank's exit: let rank 0 say it first
        time.sleep(10)
    raise SystemExit(2) from None


def print_keys(prefix: str, schema: type | None = None) -> None:
    """`--keys [prefix]`: every key under prefix with its default and its comment (the docstring under the field);
    `schema`: the config class (default TrainConfig)."""
    rows = describe_keys(prefix, schema or TrainConfig)
    if not rows:
        raise SystemExit(f"--keys {prefix}: no key starts with {prefix!r} (try --keys without a prefix)")
    for key, default, comment in rows:
        print(f"{key} = {default!r}")
        print(textwrap.fill(comment, width=110, initial_indent="    ", subsequent_indent="    "))
