"""In-flight weight updates, the engine side (rollout/inflight_source.py drives it for the trainer): one engine
driven step by step, so that the trainer can update its weights while requests are still generating, and hand each
prompt's group to training when its last sample finishes.

`InflightEngine` wraps a `RolloutEngine` (rollout/engine.py): `submit` adds a prompt's group of `sampling.n`
samples (one engine request each, seeded as vLLM seeds a group's samples), `poll` runs the engine until at least one
group finished (or none is left) and returns the finished groups as a RolloutBatch, `update_weights` loads new
weights while requests are in flight, in one of two ways:

- keep (rollout.inflight): the engine pauses with its requests kept, loads the weights and resumes;
- abort (rollout.partial, slime's and verl's partial rollouts, for engines that cannot keep a request across an
  update): every running sample is aborted, its output so far kept, and after the load it continues as a new request
  whose prompt is the original prompt and the tokens sampled so far, re-prefilled under the new weights, for the
  tokens it has left. Its later tokens are sampled with a seed derived from the sample's seed and its prefix length
  (`continuation_seed`), so they are not those a run without the abort samples even where the weights are equal.

Per-token provenance. At a keep update every running request is preempted: its KV cache is dropped and the engine
prefills its prompt and the tokens sampled so far again under the new weights before it samples the next token
(`compat.vllm.paused_in_flight`). So every token is sampled from logits the new weights computed, and its log-prob
mu is exactly that version's given the prefix; `RolloutBatch.versions` holds the version that sampled each response
token (vLLM's weight-version spans of the output). The route capture keeps the first route it recorded for each
position (`RouteAssembler`): a prefix position keeps the routes of the version that first computed it, and the
prefill after an update adds no new rows for it. Row p of a sample's routes (p < T - 1) was computed by the
version of response token max(0, p - len(prompt) + 1) (`route_versions`). After an abort the prefix keeps its
tokens, their mu, versions and route rows; the continuation's prefill computes the prefix positions again under the
new weights, and those rows are dropped: only the continuation's own positions (from the last prefix token on, the
input of its first sampled token) add rows, so the same contract holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from moe_rl.common.batch import RolloutBatch
from moe_rl.rollout.config import SamplingConfig
from moe_rl.rollout.engine import RolloutEngine, RolloutEngineError, refuse_cut_short, sampling_params, to_batch
from moe_rl.rollout.route_capture import HookRouteCapture


def token_versions(completion, where: str) -> np.ndarray:
    """The weight version (int) that sampled each token of a finished vLLM CompletionOutput, from its spans."""
    n = len(completion.token_ids)
    spans = completion.weight_versions
    if spans is None:
        raise RolloutEngineError(f"{where}: the engine labelled no weight version on its {n} tokens")
    out = np.full(n, -1, dtype=np.int64)
    for s in spans:
        out[s.start : s.end] = int(s.version)
    if (out < 0).any():
        raise RolloutEngineError(f"{where}: token {int(np.argmax(out < 0))} has no weight version")
    return out


def continuation_seed(seed: int | None, prefix_len: int) -> int | None:
    """The seed of a sample's continuation after `prefix_len` tokens (None: unseeded)."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, prefix_len]).generate_state(1)[0])


def route_versions(prompt_len: int, versions: np.ndarray) -> np.ndarray:
    """[prompt_len + len(versions) - 1] the version that computed each routed position: the prompt's positions
    (but the last) that of the first response token, position p >= prompt_len - 1 that of response token
    p - prompt_len + 1."""
    first = np.full(prompt_len - 1, versions[0] if len(versions) else 0, dtype=np.int64)
    return np.concatenate([first, versions])[: prompt_len + len(versions) - 1]


@dataclass
class _Sample:
    """One sample's output so far, with what `to_batch` reads of a vLLM CompletionOutput."""

    index: int
    token_ids: list[int]
    logprobs: list  # vLLM's per token {token id: Logprob}
    finish_reason: str | None
    versions: np.ndarray  # the version that sampled each token
    routes: np.ndarray | None  # [prompt + tokens - 1, L_moe, K]

    @staticmethod
    def of(completion, index: int, routes: np.ndarray | None, where: str) -> _Sample:
        tokens, logprobs = list(completion.token_ids), list(completion.logprobs or [])
        versions = token_versions(completion, where) if tokens else np.zeros(0, dtype=np.int64)
        return _Sample(index, tokens, logprobs, completion.finish_reason, versions, routes)

    def then(self, later: _Sample) -> _Sample:
        """This prefix continued by `later` (its continuation request's sample): the prefix keeps its tokens, mu,
        versions and route rows; of the continuation's rows only those after the prefix's are new."""
        routes = None
        if self.routes is not None:
            routes = np.concatenate([self.routes, later.routes[len(self.routes) :]])
        return _Sample(
            self.index,
            self.token_ids + later.token_ids,
            self.logprobs + later.logprobs,
            later.finish_reason,
            np.concatenate([self.versions, later.versions]),
            routes,
        )


@dataclass
class _Group:
    """One prompt's group in the engine, with what `to_batch` reads of a vLLM RequestOutput."""

    key: Hashable
    prompt_token_ids: list[int]
    sampling: SamplingConfig
    seed: int | None
    ended: list[tuple[int, object]] = field(default_factory=list)  # (sample index, vLLM RequestOutput), finished
    done: dict[int, _Sample] = field(default_factory=dict)  # finished samples by index, once the group completed
    prefix: dict[int, _Sample] = field(default_factory=dict)  # aborted samples continuing, by index

    @property
    def outputs(self) -> list[_Sample]:
        return [self.done[j] for j in sorted(self.done)]

    def seed_of(self, j: int) -> int | None:
        """Sample j's seed: vLLM seeds a group's children `seed + j`."""
        return None if self.seed is None else self.seed + j


class InflightEngine:
    """A RolloutEngine driven one engine step at a time, its weights updated while requests are in flight."""

    def __init__(self, engine: RolloutEngine, version: int = 0):
        if engine.capture is not None and not isinstance(engine.capture, HookRouteCapture):
            raise ValueError("in-flight updates need the hook route capture (rollout.capture=hook)")
        self.engine, self.version = engine, version
        self._groups: dict[int, _Group] = {}  # group id -> group
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (group id, sample index)
        self._complete: list[int] = []  # groups that finished while an abort drained the engine
        self._next, self._next_group = 0, 0
        engine.llm.llm_engine.set_weight_version(str(version))

    @property
    def running(self) -> int:
        """Groups submitted and not yet returned by `poll`."""
        return len(self._groups)

    def submit(self, key: Hashable, prompt_ids: list[int], sampling: SamplingConfig, seed: int | None) -> None:
        """Add one prompt's group: `sampling.n` samples of at most `sampling.max_tokens`, seeded by `seed` as
        RolloutEngine.generate seeds prompt i by `sampling.seed + i`. `key` comes back with the group."""
        limit = self.engine.llm.llm_engine.model_config.max_model_len
        if not prompt_ids or len(prompt_ids) + sampling.max_tokens > limit:
            raise ValueError(f"submit {key!r}: {len(prompt_ids)} prompt tokens + {sampling.max_tokens} (limit {limit})")
        gid, self._next_group = self._next_group, self._next_group + 1
        self._groups[gid] = group = _Group(key, list(prompt_ids), sampling, seed)
        for j in range(sampling.n):
            self._add(gid, j, group.prompt_token_ids, sampling.max_tokens, group.seed_of(j))

    def _add(self, gid: int, j: int, prompt_ids: list[int], max_tokens: int, seed: int | None) -> None:
        """One engine request: sample j of group `gid`."""
        # heavy: vLLM, imported on first use
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(self._groups[gid].sampling, 1, max_tokens, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # a sample comes back once, when it finished
        request_id = f"inflight-{self._next}"
        self._next += 1
        e = self.engine
        e.guard(
            "add_request", e.llm.llm_engine.add_request, request_id, TokensPrompt(prompt_token_ids=prompt_ids), params
        )
        self._requests[request_id] = (gid, j)

    def poll(self, max_steps: int | None = None) -> tuple[list[Hashable], RolloutBatch | None]:
        """Step the engine until at least one group finished, nothing runs, or `max_steps` engine steps passed:
        (the finished groups' keys, their samples as one RolloutBatch with `versions`; its prompt_index i is
        keys[i]'s group), or ([], None)."""
        e = self.engine
        complete, steps, self._complete = self._complete, 0, []
        while not complete and self._groups and (max_steps is None or steps < max_steps):
            finished = [o for o in e.guard("step", e.llm.llm_engine.step) if o.finished]
            steps += 1
            if finished:
                complete = self._finished(finished)
        if not complete:
            return [], None
        groups = [self._groups.pop(gid) for gid in complete]
        routes = None
        if e.capture is not None:
            routes = {(i, s.index): s.routes for i, g in enumerate(groups) for s in g.outputs}
        batch = to_batch(groups, routes, e.moe_layers, e.num_experts, e.topk)
        batch.versions = [s.versions for g in groups for s in g.outputs]  # to_batch's order
        return [g.key for g in groups], batch

    def _finished(self, outputs) -> list[int]:
        """Record the samples of one engine step that finished; the ids of the groups they complete. A group's
        samples are taken (their routes collected from the engine) once, when its last one finished: one engine
        call a completed group rather than one each engine step that finished a sample."""
        refuse_cut_short(outputs, self.engine.gone)
        complete = []
        for out in outputs:
            gid, j = self._requests.pop(out.request_id)
            group = self._groups[gid]
            group.ended.append((j, out))
            if len(group.ended) == group.sampling.n:
                complete.append(gid)
        ended = [(g, j, out) for g in complete for j, out in self._groups[g].ended]
        for gid, sample in self._take(ended):
            self._groups[gid].done[sample.index] = sample
        return complete

    def _take(self, ended: list[tuple[int, int, object]]) -> list[tuple[int, _Sample]]:
        """(group id, sample) of each (group id, sample index, vLLM RequestOutput) no longer running: its tokens so
        far with their route rows, joined to its earlier prefix. A sample with no token (aborted before its first)
        keeps its prefix alone, and what its prefill captured is dropped."""
        e = self.engine
        outputs = [o for _, _, o in ended]
        started = [o for o in outputs if o.outputs[0].token_ids]
        empty = [o.request_id for o in outputs if not o.outputs[0].token_ids]
        rows: dict[str, np.ndarray] = {}
        if e.capture is not None and started:
            routes = e.guard("route capture", e.capture.collect, e.llm, started, keep_others=True)
            rows = {o.request_id: routes[(i, 0)] for i, o in enumerate(started)}
        if e.capture is not None and empty:
            e.guard("route capture", e.capture.discard, e.llm, empty)
        taken = []
        for gid, j, out in ended:
            group = self._groups[gid]
            sample = _Sample.of(out.outputs[0], j, rows.get(out.request_id), f"sample {j} of {group.key!r}")
            if j in group.prefix:
                prefix = group.prefix.pop(j)
                sample = prefix.then(sample) if sample.token_ids else prefix
            taken.append((gid, sample))
        return taken

    def update_weights(self, load: Callable[[], None], version: int, abort: bool = False) -> None:
        """Run `load()` (a weight sync into this engine) with requests in flight and label what the engine samples
        from now on `version`. keep (default): the engine pauses with its requests kept and resumes, every running
        request re-prefilled under the new weights. `abort`: every running sample is aborted and continues after
        the load from the tokens it has (module docstring)."""
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import paused_in_flight

        if version <= self.version:
            raise ValueError(f"update_weights: version {version} after {self.version}: versions only grow")
        e = self.engine
        with paused_in_flight(e.llm, str(version), e.guard, abort=abort):
            cut = self._drain_aborted() if abort else []
            load()
        self.version = version
        for gid, sample in cut:
            group = self._groups[gid]
            j, seed = sample.index, group.seed_of(sample.index)
            if sample.token_ids:
                group.prefix[j] = sample
                seed = continuation_seed(seed, len(sample.token_ids))
            left = group.sampling.max_tokens - len(sample.token_ids)
            self._add(gid, j, group.prompt_token_ids + sample.token_ids, left, seed)

    def _drain_aborted(self) -> list[tuple[int, _Sample]]:
        """After the engine aborted every request: step its client until each running sample came back, finished or
        aborted with its output so far; (group id, output so far joined to any earlier prefix) of each aborted one."""
        e = self.engine
        cut = []
        while self._requests:
            outputs = [o for o in e.guard("step", e.llm.llm_engine.step) if o.finished]
            aborted = [o for o in outputs if o.outputs[0].finish_reason == "abort"]
            done = [o for o in outputs if o.outputs[0].finish_reason != "abort"]
            if done:  # finished before the abort: poll returns their groups
                self._complete += self._finished(done)
            cut += self._take([(*self._requests.pop(o.request_id), o) for o in aborted])
        return cut
