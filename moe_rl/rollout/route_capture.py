"""Capture of the experts vLLM routes every token to, behind one interface.

Two implementations produce the same per-sample records (`[T - 1, L_moe, K]`, MoE layers in
decoder order):

- `HookRouteCapture` (CPU / model runner V1): a worker extension sets each MoE router's
  capture callback (`BaseRouter.set_capture_fn`, the hook vLLM's own capturer uses; ids are
  logical, before EPLB mapping) and wraps the model runner's `_prepare_inputs`
  (`moe_rl.compat.vllm.on_prepare_inputs`) to learn each step's request order, token counts
  and start positions. `RouteAssembler` places every captured row at its request and
  position. Cached prompt tokens produce no rows: single-turn rollouts run with prefix caching off;
  multi-turn rollouts keep it on and take each turn's computed rows with their mask
  (`take_partial`), stitched append-only by `rollout/multi_turn/routes.py`.
- `NativeRouteCapture` (GPU builds with `enable_return_routed_experts=True`, model runner
  V2): reads `CompletionOutput.routed_experts` and drops dense layers (`from_native`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from moe_rl.routing.records import RouteError, from_native


class RouteAssembler:
    """Per-request route rows from step-wise captures (runs inside the engine's worker).

    Each engine step: `begin_step(req_ids, num_tokens, start_positions)`, then one
    `add_layer(layer_id, topk_ids)` per MoE layer with rows in the step's batch order.
    """

    def __init__(self, moe_layers: list[int], topk: int, dtype: np.dtype):
        self.moe_layers = list(moe_layers)
        self.col = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.topk = topk
        self.dtype = np.dtype(dtype)
        self.rows: dict[str, np.ndarray] = {}  # req_id -> [capacity, L_moe, K]
        self.filled: dict[str, np.ndarray] = {}  # req_id -> [capacity, L_moe] bool
        self._step: list[tuple[str, int, int]] = []

    def begin_step(self, req_ids: list[str], num_tokens: list[int], starts: list[int]) -> None:
        self._step = [(r, int(n), int(s)) for r, n, s in zip(req_ids, num_tokens, starts, strict=True)]
        for r, n, s in self._step:
            self._ensure(r, s + n)

    def _ensure(self, req: str, length: int) -> None:
        cur = self.rows.get(req)
        if cur is not None and cur.shape[0] >= length:
            return
        cap = max(length, 2 * (0 if cur is None else cur.shape[0]), 16)
        new = np.zeros((cap, len(self.moe_layers), self.topk), dtype=self.dtype)
        newf = np.zeros((cap, len(self.moe_layers)), dtype=bool)
        if cur is not None:
            new[: cur.shape[0]] = cur
            newf[: cur.shape[0]] = self.filled[req]
        self.rows[req], self.filled[req] = new, newf

    def add_layer(self, layer_id: int, topk_ids: np.ndarray) -> None:
        if layer_id not in self.col:
            raise RouteError(
                f"captured routes for decoder layer {layer_id}, which is not an MoE layer "
                f"of this model ({self.moe_layers})"
            )
        c = self.col[layer_id]
        total = sum(n for _, n, _ in self._step)
        if topk_ids.shape[0] < total:
            raise RouteError(f"layer {layer_id}: {topk_ids.shape[0]} captured rows for {total} scheduled tokens")
        off = 0
        for req, n, start in self._step:
            # the first route recorded for a position stays: a request preempted (KV pressure, or an in-flight
            # weight update) prefills its positions again, and the tokens after them were sampled on the first
            new = ~self.filled[req][start : start + n, c]
            self.rows[req][start : start + n, c][new] = topk_ids[off : off + n][new]
            self.filled[req][start : start + n, c] = True
            off += n

    def take(self, req_id: str, num_rows: int) -> np.ndarray:
        """The first `num_rows` rows of a request (removed from the assembler)."""
        rows = self.rows.pop(req_id, None)
        filled = self.filled.pop(req_id, None)
        if rows is None:
            raise RouteError(f"request {req_id}: no routes were captured")
        if rows.shape[0] < num_rows or not filled[:num_rows].all():
            have = int(filled.all(-1).sum()) if filled is not None else 0
            raise RouteError(
                f"request {req_id}: routes captured for {have} positions, {num_rows} needed "
                "(prefix caching on, or a forward bypassed the router hook?)"
            )
        return rows[:num_rows].copy()

    def take_partial(self, req_id: str, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows [num_rows, L_moe, K], computed [num_rows] bool) of a request (removed): the positions the
        engine computed for it, on every MoE layer; prefix-cache hits stay uncomputed."""
        rows = self.rows.pop(req_id, None)
        filled = self.filled.pop(req_id, None)
        if rows is None:  # every position was a cache hit except ones never captured: nothing computed
            rows = np.zeros((0, len(self.moe_layers), self.topk), dtype=self.dtype)
            filled = np.zeros((0, len(self.moe_layers)), dtype=bool)
        part = filled[:num_rows].any(-1) & ~filled[:num_rows].all(-1)
        if part.any():
            raise RouteError(
                f"request {req_id}: position {int(np.argmax(part))} was captured on some MoE layers only "
                "(a forward bypassed the router hook?)"
            )
        out = np.zeros((num_rows, len(self.moe_layers), self.topk), dtype=self.dtype)
        mask = np.zeros(num_rows, dtype=bool)
        n = min(num_rows, rows.shape[0])
        out[:n], mask[:n] = rows[:n], filled[:n].all(-1)
        return out, mask

    def clear(self) -> None:
        self.rows.clear()
        self.filled.clear()


def child_request_ids(parent_id: str, n: int, worker_ids: list[str]) -> list[str]:
    """Internal ids of the n samples of one `LLM.generate` request, in sample order.

    vLLM fans a request out to children `"{i}_{parent}"` when n > 1 and may append
    `"-{suffix}"` to make ids unique inside the engine.
    """

    def matches(wid: str, base: str) -> bool:
        return wid == base or wid.startswith(base + "-")

    bases = [f"{i}_{parent_id}" for i in range(n)] if n > 1 else [parent_id]
    out = []
    for base in bases:
        hits = [w for w in worker_ids if matches(w, base)]
        if len(hits) != 1:
            raise RouteError(f"request {parent_id}: expected one engine request for {base!r}, found {hits}")
        out.append(hits[0])
    return out


class RouteCapture(Protocol):
    """What the engine needs from a capture implementation."""

    def engine_kwargs(self) -> dict[str, Any]: ...

    def install(self, llm: Any) -> None: ...

    def collect(self, llm: Any, outputs: list[Any]) -> dict[tuple[int, int], np.ndarray]:
        """{(output index, sample index): routes [T - 1, L_moe, K]} for `LLM.generate` outputs."""
        ...

    def collect_partial(self, llm: Any, outputs: list[Any]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        """Like `collect`, for an engine with prefix caching on: (routes [T - 1, L_moe, K], computed [T - 1]
        bool); rows of positions served from the prefix cache are zero and not computed."""
        ...


class HookRouteCapture:
    def __init__(self, moe_layers: list[int], topk: int, dtype: np.dtype, prefix_caching: bool = False):
        self.moe_layers, self.topk, self.dtype = moe_layers, topk, np.dtype(dtype)
        self.prefix_caching = prefix_caching

    def engine_kwargs(self) -> dict[str, Any]:
        return {"enable_prefix_caching": self.prefix_caching}

    def install(self, llm: Any) -> None:
        bound = llm.collective_rpc("moe_rl_install_capture", args=(self.moe_layers, self.topk, self.dtype.str))
        for layers in bound:
            if sorted(layers) != sorted(self.moe_layers):
                raise RouteError(
                    f"the engine's MoE routers are at layers {sorted(layers)}, the model config says {self.moe_layers}"
                )

    def collect(self, llm: Any, outputs: list[Any], keep_others: bool = False) -> dict[tuple[int, int], np.ndarray]:
        """As RouteCapture.collect; `keep_others`: the routes of requests still running stay (rollout/inflight.py)."""
        return {k: rows for k, (rows, _) in self._take(llm, outputs, False, keep_others).items()}

    def collect_partial(self, llm: Any, outputs: list[Any]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        return self._take(llm, outputs, partial=True)

    def discard(self, llm: Any, request_ids: list[str]) -> None:
        """Forget what was captured for these requests, the rest stays (rollout/inflight.py: aborted before their
        first sampled token)."""
        worker_ids = llm.collective_rpc("moe_rl_capture_request_ids")[0]
        gone = {w: 0 for r in request_ids for w in worker_ids if w == r or w.startswith(r + "-")}
        if gone:
            llm.collective_rpc("moe_rl_take_routes", args=(gone, True, True))

    def _take(
        self, llm: Any, outputs: list[Any], partial: bool, keep_others: bool = False
    ) -> dict[tuple[int, int], tuple[np.ndarray, Any]]:
        wanted: dict[str, tuple[int, int, int]] = {}
        worker_ids = llm.collective_rpc("moe_rl_capture_request_ids")[0]
        for i, out in enumerate(outputs):
            ids = child_request_ids(out.request_id, len(out.outputs), worker_ids)
            for c in out.outputs:
                wanted[ids[c.index]] = (i, c.index, len(out.prompt_token_ids) + len(c.token_ids) - 1)
        rows = {k: v[2] for k, v in wanted.items()}
        got = llm.collective_rpc("moe_rl_take_routes", args=(rows, partial, keep_others))[0]
        result = {}
        for req, (i, j, n) in wanted.items():
            raw, shape, computed = got[req]
            mask = None if computed is None else np.frombuffer(computed, dtype=bool).reshape(n)
            result[(i, j)] = (np.frombuffer(raw, dtype=self.dtype).reshape(shape), mask)
        return result


class NativeRouteCapture:
    def __init__(self, moe_layers: list[int]):
        self.moe_layers = moe_layers

    def engine_kwargs(self) -> dict[str, Any]:
        return {"enable_return_routed_experts": True}

    def install(self, llm: Any) -> None:
        return None

    def collect(self, llm: Any, outputs: list[Any]) -> dict[tuple[int, int], np.ndarray]:
        result = {}
        for i, out in enumerate(outputs):
            for c in out.outputs:
                if getattr(c, "routed_experts", None) is None:
                    raise RouteError(f"output {i} sample {c.index}: the engine returned no routed_experts")
                result[(i, c.index)] = from_native(c.routed_experts, self.moe_layers, sample=f"{i}/{c.index}")
        return result

    def collect_partial(self, llm: Any, outputs: list[Any]) -> dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]:
        # the engine runs with prefix caching off under native capture: every position is computed
        return {k: (rows, np.ones(rows.shape[0], dtype=bool)) for k, rows in self.collect(llm, outputs).items()}
