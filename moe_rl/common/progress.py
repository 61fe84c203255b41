"""Where this process is and when it last moved: what the hang watchdog (moe_rl/trainer/watchdog.py) reads.

`mark(phase)` where a phase starts (the loop's phases, a checkpoint), `mark()` wherever long work advances: an
engine step (one decode step of the batch), a forward of a micro-batch, a reward sample, a weight-sync bucket.
A mark is a few attribute writes; any thread may make one (the engine samples ahead on a thread of its own).
"""

from __future__ import annotations

import time


class _Progress:
    def __init__(self) -> None:
        self.step_number = 0  # the RL step under way (1-based; 0: before the first)
        self.phase = "start-up"
        self.moves = 0  # marks so far: a change is progress
        self.at = time.monotonic()  # when the latest mark was made


STATE = _Progress()


def mark(phase: str | None = None) -> None:
    """Progress: this process moved on (into `phase`, when given)."""
    if phase is not None:
        STATE.phase = phase
    STATE.moves += 1
    STATE.at = time.monotonic()


def current_step() -> int:
    """The RL step under way (1-based; 0: before the first)."""
    return STATE.step_number


def begin_step(step: int) -> None:
    """RL step `step` (1-based) starts."""
    STATE.step_number = step
    mark("step start")
