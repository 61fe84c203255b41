"""In-flight rollouts (rollout.inflight=true): the engine never stops generating, and its weights change under
running requests.

The engine leader keeps `1 + trainer.max_staleness` steps' worth of prompt groups in the engine. A background thread
steps the engine (`InflightEngine`, rollout/inflight.py) and collects each group when its last sample finishes. A
training step takes, for every data-parallel rank, the first `data.prompts_per_step` of its groups to finish, and
each rank draws as many new prompts, which join the engine at once. The weight sync after the update pauses the
engine with its requests kept, loads the weights and resumes it: a request running across the update samples its
later tokens with the new weights (its KV is re-prefilled under them), so one sample's tokens may come from
several versions. With rollout.partial the sync aborts the running samples instead, and each continues after it as
a new request from its prefix (slime's and verl's partial rollouts). Each token keeps the version that sampled it
(`Rollout.versions`), its mu log-prob and the routes the engine computed at it; the objective is the decoupled one
(pi_prox is the actor's recompute before the update, the correction weighs pi_prox / mu per token).

Staleness is counted per token: a finished group with a token older than `max_staleness` versions at the step
that would train it is dropped (counted in `rollout/dropped_fraction`) and its prompt sampled again with the weights
of now. Seeds: prompt j of data-parallel rank d's stream index i = s * prompts_per_step + j gets the seed the
synchronous run gives it at step s, so with unchanged weights the samples are the synchronous run's.

Checkpoints: prompts in flight are not saved. The data position a checkpoint keeps is that of the oldest prompt
not yet trained on any data-parallel rank, so a resumed run samples every untrained prompt again with the resumed
weights (and the prompts after it that had already trained, once more); a resumed run logs how many.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from moe_rl.common.batch import RolloutBatch
from moe_rl.rollout import placement
from moe_rl.rollout.inflight import InflightEngine
from moe_rl.rollout.source import EngineSource, Rollout, share_of


@dataclass
class _Group:
    """One prompt's finished group on the leader."""

    key: tuple[int, int]  # (data-parallel rank, index in its prompt stream)
    batch: RolloutBatch  # its sampling.n samples, prompt_index 0


class _Driver:
    """The leader's engine thread: steps the InflightEngine, runs the main thread's commands between engine steps
    (submits, weight updates), and hands finished groups over."""

    def __init__(self, engine: InflightEngine, engine_cores: list[int] | None):
        self.engine = engine
        self.commands: queue.Queue = queue.Queue()
        self.finished: list[_Group] = []
        self.ready = threading.Condition()
        self.error: BaseException | None = None
        self.idle_s = 0.0  # seconds with nothing to generate
        self._thread = threading.Thread(target=self._run, args=(engine_cores,), name="moe-rl-inflight", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], object], wait: bool = True):
        """Run `fn` on the engine thread between two engine steps (`wait`: block for its result; without, an error
        of `fn` ends the engine thread and is raised by the main thread's next `wait` or `call`)."""
        done: queue.Queue | None = queue.Queue(1) if wait else None
        self.commands.put((fn, done))
        while wait:
            try:
                ok, value = done.get(timeout=1.0)
            except queue.Empty:
                if self.error is not None or not self._thread.is_alive():
                    raise self.error or RuntimeError("the in-flight engine thread is gone") from None
                continue
            if not ok:
                raise value
            return value
        return None

    def wait(self, enough: Callable[[list[_Group]], bool], may_stop) -> bool:
        """Block until `enough(the groups finished since its last call)` says so (False: the engine stopped with
        a signal)."""
        with may_stop():
            with self.ready:
                while True:
                    if self.error is not None:
                        raise self.error
                    new, self.finished = self.finished, []
                    if enough(new):
                        return True
                    self.ready.wait()
        return False

    def _run(self, engine_cores: list[int] | None) -> None:
        if engine_cores is not None:
            placement.pin_this_thread(engine_cores)
        try:
            while True:
                try:
                    fn, done = self.commands.get(block=self.engine.running == 0)
                except queue.Empty:
                    self._step()
                    continue
                if fn is None:
                    return
                self._command(fn, done)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread, which raises it)
            with self.ready:
                self.error = e
                self.ready.notify_all()

    def _command(self, fn, done: queue.Queue | None) -> None:
        idle = self.engine.running == 0
        t0 = time.perf_counter()
        if done is None:  # nobody waits: an error ends this thread (_run hands it to the main thread)
            fn()
        else:
            try:
                done.put((True, fn()))
            except Exception as e:  # the caller raises it
                done.put((False, e))
        if idle:
            self.idle_s += time.perf_counter() - t0

    def _step(self) -> None:
        keys, batch = self.engine.poll(max_steps=1)
        if not keys:
            return
        groups = []
        for i, key in enumerate(keys):
            part = batch.select(np.nonzero(batch.prompt_index == i)[0].tolist())
            groups.append(_Group(key, replace(part, prompt_index=np.zeros(len(part), dtype=np.int64))))
        with self.ready:
            self.finished.extend(groups)
            self.ready.notify_all()

    def close(self) -> None:
        self.commands.put((None, None))
        self._thread.join(timeout=60)


def _least(value: int) -> int:
    """The least of `value` over every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def oldest_version(batch: RolloutBatch) -> int:
    """The oldest weight version that sampled a token of `batch`."""
    return min(int(v.min()) for v in batch.versions if len(v))


class InflightSource:
    """An EngineSource whose engine keeps generating across training steps and weight syncs."""

    phase = "rollout"
    live = True
    buffer = None

    def __init__(
        self, inner: EngineSource, max_staleness: int, engine_cores: list[int] | None = None, partial: bool = False
    ):
        """`partial` (rollout.partial): a weight sync aborts the running samples, which continue after it from their
        prefix (InflightEngine.update_weights), instead of keeping them in the engine."""
        if max_staleness < 1:
            raise ValueError(f"trainer.max_staleness={max_staleness}: in-flight rollouts need a bound >= 1")
        self.inner, self.max_staleness, self.engine_cores = inner, max_staleness, engine_cores
        self.partial = partial
        self.driver: _Driver | None = None
        self.waiting: dict[tuple[int, int], object] = {}  # leader: key -> Prompt of every group in the engine
        self.kept: list[_Group] = []  # leader: finished groups not yet trained
        self.untrained: set[int] = set()  # this rank: stream indices of its prompts drawn and not yet trained
        self.dropped: dict[int, int] = {}  # leader: samples dropped as too stale, per data-parallel rank
        self.oldest: int | None = None  # every rank: the least data position of an untrained prompt over the ranks

    @property
    def groups(self):
        return self.inner.groups

    @property
    def position(self) -> int:
        """The data position of the oldest untrained prompt of any data-parallel rank after the last `next` (what a
        checkpoint saves, from rank 0: every rank resumes there, so none skips a prompt it has not trained)."""
        return self.oldest if self.oldest is not None else self.inner.data.position

    def next(self, step: int) -> Rollout:
        """Step `step`'s samples: the first data.prompts_per_step groups of each data-parallel rank to finish, every
        token within trainer.max_staleness versions of `step`. Collective over the engine group."""
        n = self.inner.prompts_per_step
        if self.driver is None and self.groups.is_leader:
            self.driver = _Driver(InflightEngine(self.inner.engine, version=step), self.engine_cores)
        depth = 1 if self.untrained else 1 + self.max_staleness  # the first step fills the engine
        drawn = self._draw(depth * n)
        shares = None
        if self.groups.is_leader:
            shares = self._serve(step, drawn)
        mine = self._exchange(shares)
        if mine is None:
            return self.inner.finish(step, [], None, step)  # raises StepAbandoned on every rank
        keys, prompts, batch, dropped = mine
        self.untrained -= {index for _, index in keys}
        rollout = self.inner.finish(step, prompts, batch, step)  # first: every rank leaves an abandoned step there
        self.oldest = _least(min(self.untrained) if self.untrained else self.inner.data.position)
        rollout.dropped = dropped
        return rollout

    def _draw(self, count: int) -> list:
        """This rank's next `count` prompts with their stream indices, and where they go (gathered to the leader)."""
        data, base = self.inner.data, self.inner.data.position
        out = list(enumerate(data.next(count), start=base))
        self.untrained |= {index for index, _ in out}
        g = self.groups
        request = (g.dp_rank, out, self.inner.route_layers, self.inner.holds_routes)
        if g.group is None:
            return [request]
        asked = [None] * len(g.group_ranks) if g.is_leader else None
        dist.gather_object(request, asked, dst=g.leader, group=g.group)
        return asked

    def _serve(self, step: int, asked: list) -> list:
        """Leader: submit the new prompts, wait for every served rank's first finished groups, and cut each rank its
        share: (its groups' keys, their prompts, their samples) or None when the engine stopped with a signal."""
        n = self.inner.prompts_per_step
        by_dp = {d: drawn for d, drawn, _, _ in asked}  # a data-parallel rank's peers drew the same prompts
        self._submit([((d, index), prompt) for d, drawn in by_dp.items() for index, prompt in drawn])
        served = self.groups.served
        oldest = step - self.max_staleness  # the oldest version a token trained at `step` may have
        took: dict[int, list[_Group]] = {d: [] for d in served}

        def enough(new: list[_Group]) -> bool:
            pool, self.kept = self.kept + new, []
            for group in pool:
                d = group.key[0]
                if oldest_version(group.batch) < oldest:  # too stale to train: sampled again with today's weights
                    self.dropped[d] = self.dropped.get(d, 0) + len(group.batch)
                    self._submit([(group.key, self.waiting[group.key])])
                elif len(took[d]) < n:
                    took[d].append(group)
                else:
                    self.kept.append(group)
            return all(len(took[d]) == n for d in served)

        if not self.driver.wait(enough, self.inner.may_stop):
            return [None] * len(asked)
        return [self._cut(d, took[d], layers, holds) for d, _, layers, holds in asked]

    def _submit(self, groups: list[tuple[tuple[int, int], object]]) -> None:
        """Add prompts' groups ((key, prompt) each) to the engine in one command between two engine steps, not
        waited for (an error of it is raised by the next wait), each seeded as the synchronous run seeds it."""
        s = self.inner.sampling
        n, dp = self.inner.prompts_per_step, self.groups.dp_size
        requests = []
        for (d, index), prompt in groups:
            seed = None if s.seed is None else s.seed + ((index // n) * dp + d) * n + index % n
            self.waiting[(d, index)] = prompt
            requests.append(((d, index), prompt.ids, seed))
        engine = self.driver.engine

        def submit() -> None:
            for key, ids, seed in requests:
                engine.submit(key, ids, s, seed)

        self.driver.call(submit, wait=False)

    def _cut(self, d: int, groups: list[_Group], layers, holds: bool):
        """Data-parallel rank `d`'s share: (its groups' keys, their prompts, their samples as one batch, the samples
        of its prompts dropped since its last share)."""
        keys = [g.key for g in groups]
        prompts = [self.waiting.pop(k) for k in keys]
        parts = [replace(g.batch, prompt_index=np.full(len(g.batch), i, dtype=np.int64)) for i, g in enumerate(groups)]
        return keys, prompts, share_of(RolloutBatch.cat(parts), layers, holds), self.dropped.pop(d, 0)

    def _exchange(self, shares):
        g = self.groups
        if g.group is None:
            return shares[0]
        mine = [None]
        dist.scatter_object_list(mine, shares, src=g.leader, group=g.group)
        return mine[0]

    def update_weights(self, sync: Callable[[], dict], version: int) -> dict:
        """The weight sync with the engine paused, its requests kept; what it samples from now on is `version`."""
        if self.driver is None:
            return sync()
        out: dict = {}

        def load():
            out.update(sync())

        self.driver.call(functools.partial(self.driver.engine.update_weights, load, version, abort=self.partial))
        return out

    def idle_times(self, rollout_s: float, step_s: float) -> dict[str, float]:
        """The trainer waits in next(); the engine idles only when nothing is in it."""
        idle = 0.0
        if self.driver is not None:
            idle, self.driver.idle_s = self.driver.idle_s, 0.0
        return {"time/trainer_idle": rollout_s, "time/rollout_idle": idle}

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        self.inner.close()
