"""A rank's start-up without the garbage collector's full passes.

A rank imports torch, megatron-core, transformers and vLLM and builds its model and engine: about 700,000 objects,
nearly all of them alive until the process ends. CPython's full (oldest-generation) collections traverse all of them
each time the heap has grown by a quarter: 9 full passes in a default run's start-up, 1.3 s of CPU per rank, which
found about 7,000 garbage objects in all (docs/performance.md). From `defer_full_collections()` (the launch script's
first line) to `start_up_done()` (the trainer built) the oldest generation is not collected; the young ones are, as
before. Then the start-up's survivors are frozen (`gc.freeze`: never traversed again, as vLLM's engine core does with
its own heap) and full collections resume over what the steps make.
"""

from __future__ import annotations

import gc
import os

_NEVER = 2**30  # the oldest generation's threshold while deferred: a count of younger collections never reached
_deferred: tuple[int, int, int] | None = None  # the thresholds to put back, while full collections are deferred


def defer_full_collections() -> None:
    """No full collections until `start_up_done()`; a no-op if already deferred."""
    global _deferred
    if _deferred is None:
        _deferred = gc.get_threshold()
        gc.set_threshold(_deferred[0], _deferred[1], _NEVER)


def start_up_done() -> None:
    """Freeze the start-up's objects and collect fully again; a no-op where nothing was deferred (a trainer built in a
    process that did not start through a launch script)."""
    if _deferred is not None:
        gc.freeze()
        _collect_fully_again()


def _collect_fully_again() -> None:
    """The thresholds as they were; also a process forked during start-up (an engine core), which then collects as
    any process does."""
    global _deferred
    if _deferred is not None:
        gc.set_threshold(*_deferred)
        _deferred = None


os.register_at_fork(after_in_child=_collect_fully_again)
