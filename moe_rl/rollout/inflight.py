"""In-flight weight updates, the engine side (rollout/inflight_source.py drives it for the trainer): one engine
driven step by step, so that the trainer can update its weights while requests are still generating, and hand each
prompt's group to training when its last sample finishes.

`InflightEngine` wraps a `RolloutEngine` (rollout/engine.py): `submit` adds a prompt's group of `sampling.n`
samples, `poll` runs the engine until at least one group finished (or none is left) and returns the finished
groups as a RolloutBatch, `update_weights` pauses the engine with its requests kept, loads new weights and resumes.

Per-token provenance. At an update every running request is preempted: its KV cache is dropped and the engine
prefills its prompt and the tokens sampled so far again under the new weights before it samples the next token
(`compat.vllm.paused_in_flight`). So every token is sampled from logits the new weights computed, and its log-prob
mu is exactly that version's given the prefix; `RolloutBatch.versions` holds the version that sampled each response
token (vLLM's weight-version spans of the output). The route capture keeps the first route it recorded for each
position (`RouteAssembler`): a prefix position keeps the routes of the version that first computed it, and the
prefill after an update adds no new rows for it. Row p of a sample's routes (p < T - 1) was computed by the
version of response token max(0, p - len(prompt) + 1) (`route_versions`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

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


def route_versions(prompt_len: int, versions: np.ndarray) -> np.ndarray:
    """[prompt_len + len(versions) - 1] the version that computed each routed position: the prompt's positions
    (but the last) that of the first response token, position p >= prompt_len - 1 that of response token
    p - prompt_len + 1."""
    first = np.full(prompt_len - 1, versions[0] if len(versions) else 0, dtype=np.int64)
    return np.concatenate([first, versions])[: prompt_len + len(versions) - 1]


class InflightEngine:
    """A RolloutEngine driven one engine step at a time, its weights updated while requests are in flight."""

    def __init__(self, engine: RolloutEngine, version: int = 0):
        if engine.capture is not None and not isinstance(engine.capture, HookRouteCapture):
            raise ValueError("in-flight updates need the hook route capture (rollout.capture=hook)")
        self.engine, self.version = engine, version
        self._groups: dict[str, Hashable] = {}  # request id -> the caller's key
        self._next = 0
        engine.llm.llm_engine.set_weight_version(str(version))

    @property
    def running(self) -> int:
        """Groups submitted and not yet returned by `poll`."""
        return len(self._groups)

    def submit(self, key: Hashable, prompt_ids: list[int], sampling: SamplingConfig, seed: int | None) -> None:
        """Add one prompt's group: `sampling.n` samples of at most `sampling.max_tokens`, seeded by `seed` as
        RolloutEngine.generate seeds prompt i by `sampling.seed + i`. `key` comes back with the group."""
        # heavy: vLLM, imported on first use
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        e = self.engine
        limit = e.llm.llm_engine.model_config.max_model_len
        if not prompt_ids or len(prompt_ids) + sampling.max_tokens > limit:
            raise ValueError(f"submit {key!r}: {len(prompt_ids)} prompt tokens + {sampling.max_tokens} (limit {limit})")
        params = sampling_params(sampling, sampling.n, sampling.max_tokens, seed)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # a group comes back once, when its last sample finished
        request_id = f"inflight-{self._next}"
        self._next += 1
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        e.guard("add_request", e.llm.llm_engine.add_request, request_id, prompt, params)
        self._groups[request_id] = key

    def poll(self, max_steps: int | None = None) -> tuple[list[Hashable], RolloutBatch | None]:
        """Step the engine until at least one group finished, nothing runs, or `max_steps` engine steps passed:
        (the finished groups' keys, their samples as one RolloutBatch with `versions`; its prompt_index i is
        keys[i]'s group), or ([], None)."""
        e = self.engine
        finished, steps = [], 0
        while not finished and self._groups and (max_steps is None or steps < max_steps):
            finished = [o for o in e.guard("step", e.llm.llm_engine.step) if o.finished]
            steps += 1
        if not finished:
            return [], None
        refuse_cut_short(finished, e.gone)
        routes = None
        if e.capture is not None:
            routes = e.guard("route capture", e.capture.collect, e.llm, finished, keep_others=True)
        batch = to_batch(finished, routes, e.moe_layers, e.num_experts, e.topk)
        batch.versions = [  # in to_batch's order: outputs in turn, samples by index
            token_versions(c, f"request {out.request_id} sample {c.index}")
            for out in finished
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        keys = [self._groups.pop(o.request_id) for o in finished]
        return keys, batch

    def update_weights(self, load: Callable[[], None], version: int) -> None:
        """Pause the engine keeping its requests, run `load()` (a weight sync into this engine), label what it
        samples from now on `version` and resume: every running request continues, re-prefilled under the new
        weights."""
        # compat.vllm registers an at-fork hook: imported where an engine runs
        from moe_rl.compat.vllm import paused_in_flight

        if version <= self.version:
            raise ValueError(f"update_weights: version {version} after {self.version}: versions only grow")
        e = self.engine
        with paused_in_flight(e.llm, str(version), e.guard):
            load()
        self.version = version
