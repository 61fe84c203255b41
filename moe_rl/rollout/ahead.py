"""Off-policy rollouts (trainer.max_staleness >= 1): the engine samples the next step's prompts while
the actor trains on this step's samples.

With a synchronous loop the trainer idles while the engine generates and the engine idles while the
trainer updates. Here, as soon as step s's samples are handed to the trainer, the engine starts on
step s+1's prompts with the weights it has (actor version s); the actor trains step s meanwhile, and
the weight sync after the update waits for that generation to end (weights never change under a
running generation: no partial rollouts). Step s+1 then trains on samples of version s with the
actor at version s+1: staleness 1. The engine runs one batch ahead whatever the bound, so every
sample's staleness is at most 1 <= trainer.max_staleness; a deeper pipeline is not built.

Every sample carries the version that generated it (`Rollout.policy_version`), and its routes and
log-probs come from that one generation call. The proximal policy is the actor's recompute before the
update (the old-log-prob pass, with the sample's routes replayed under R3), the behaviour policy the
engine's mu: the configured correction weighs pi_prox / mu and the policy loss clips pi_theta /
pi_prox (the decoupled objective). Samples in flight are not checkpointed: a resumed run samples them
again, with the resumed weights, from the same prompts (the data position counts trained steps).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from moe_rl.rollout import placement
from moe_rl.rollout.source import EngineSource, Rollout


@dataclass
class _Pending:
    step: int
    version: int  # the actor step whose weights the engine has while sampling
    prompts: list
    position: int  # the data position after these prompts
    future: Future


class AheadSource:
    """An EngineSource whose next batch is sampled on a background thread while the trainer trains."""

    phase = "rollout"
    live = True
    buffer = None

    def __init__(self, inner: EngineSource, max_staleness: int, steps: int, engine_cores: list[int] | None = None):
        """`steps`: the run's last step (trainer.steps): nothing is sampled beyond it. `engine_cores`
        (rollout.placement=separate): the cores of the thread that drives generation."""
        if max_staleness < 1:
            raise ValueError(f"trainer.max_staleness={max_staleness}: AheadSource is for >= 1")
        self.inner, self.max_staleness, self.steps = inner, max_staleness, steps
        self.pending: _Pending | None = None
        self._position: int | None = None  # the data position after the last step handed out
        initializer = None if engine_cores is None else functools.partial(placement.pin_this_thread, engine_cores)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moe-rl-rollout-ahead", initializer=initializer)
        self._engine_free_since = time.perf_counter()
        self._idle = {"time/trainer_idle": 0.0, "time/rollout_idle": 0.0}

    @property
    def position(self) -> int:
        """Prompts of the steps handed out so far (what a checkpoint saves; prompts sampled ahead excluded)."""
        return self.inner.data.position if self._position is None else self._position

    @property
    def groups(self):
        return self.inner.groups

    def next(self, step: int) -> Rollout:
        """Step `step`'s samples (sampled ahead, or now at the first step and after a resume), then the
        next step's sampling starts with the engine's current weights (actor version `step`)."""
        if self.pending is None or self.pending.step != step:
            self.wait_idle()
            self.pending = None
            self._launch(step, version=step)
        p, self.pending = self.pending, None
        batch = self._result(p)
        staleness = step - p.version
        if staleness > self.max_staleness:  # cannot happen with one batch ahead; never train on it
            raise RuntimeError(f"step {step + 1}: samples of version {p.version} exceed trainer.max_staleness")
        rollout = self.inner.finish(step, p.prompts, batch, p.version)
        self._position = p.position
        if step + 1 < self.steps:
            self._launch(step + 1, version=step)
        return rollout

    def update_weights(self, sync: Callable[[], dict], version: int) -> dict:
        """The weight sync once the engine is not sampling; the batch sampled ahead stays pending."""
        self.wait_idle()
        return sync()

    def wait_idle(self) -> None:
        """Block until the engine is not sampling; the batch stays pending."""
        if self.pending is not None and not self.pending.future.done():
            t0 = time.perf_counter()
            self.pending.future.exception()  # waits; an error is raised by next()
            self._idle["time/trainer_idle"] += time.perf_counter() - t0

    def idle_times(self, rollout_s: float, step_s: float) -> dict[str, float]:
        """Seconds the trainer waited for samples and the engine had nothing to sample, since the last call (both
        measured here: sampling overlaps the step)."""
        out, self._idle = self._idle, {"time/trainer_idle": 0.0, "time/rollout_idle": 0.0}
        return out

    def _launch(self, step: int, version: int) -> None:
        prompts = self.inner.data.next(self.inner.prompts_per_step)
        now = time.perf_counter()
        self._idle["time/rollout_idle"] += now - self._engine_free_since
        future = self._pool.submit(self._sample, step, prompts)
        self.pending = _Pending(step, version, prompts, self.inner.data.position, future)

    def _sample(self, step: int, prompts: list):
        try:
            return self.inner.sample(step, prompts)
        finally:
            self._engine_free_since = time.perf_counter()

    def _result(self, p: _Pending):
        t0 = time.perf_counter()
        batch = p.future.result()
        self._idle["time/trainer_idle"] += time.perf_counter() - t0
        return batch

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.inner.close()
