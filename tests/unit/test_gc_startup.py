"""A rank's start-up without full garbage collections (moe_rl/common/gc_startup.py)."""

from __future__ import annotations

import gc
import json
import os

from moe_rl.common import gc_startup


def _full_collections_while_allocating(n: int) -> int:
    """Full (generation-2) collections while `n` long-lived containers are made, as a start-up's imports make them."""
    full = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    gc.callbacks.append(count)
    try:
        kept = [[i] for i in range(n)]
    finally:
        gc.callbacks.remove(count)
    del kept
    return len(full)


def test_start_up_makes_no_full_collection_a_fork_collects_as_usual_and_the_survivors_are_frozen():
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    # A full collection waits for the heap to grow by a quarter: enough objects for one whatever this process holds
    n = max(300_000, len(gc.get_objects()))
    assert _full_collections_while_allocating(n) > 0  # what the deferral removes

    read, write = os.pipe()
    gc_startup.defer_full_collections()
    try:
        assert gc.get_threshold()[:2] == before[:2]  # the young generations are collected as before
        assert _full_collections_while_allocating(n) == 0
        pid = os.fork()
        if pid == 0:  # an engine core forked from a rank during its start-up
            os.write(write, json.dumps(gc.get_threshold()).encode())
            os._exit(0)
        os.waitpid(pid, 0)
        assert tuple(json.loads(os.read(read, 100))) == before
    finally:
        gc_startup.start_up_done()
        os.close(read)
        os.close(write)
    try:
        assert gc.get_threshold() == before
        assert gc.get_freeze_count() > frozen
        gc_startup.start_up_done()  # a second call (a trainer built in a process that deferred nothing) changes nothing
        assert gc.get_threshold() == before
    finally:
        gc.unfreeze()  # this test process's heap as it was
