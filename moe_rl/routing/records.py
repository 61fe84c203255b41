"""The route-record contract (see docs: design.md, "Route records").

A record for one sample of T tokens is `routes[T, L_moe, K]`: row t holds the K expert ids
each MoE layer chose when token t was the *input* at position t. Only MoE layers are stored
(`moe_layers` maps them to decoder layers). dtype uint8 for <= 256 experts, int16 up to
32767. Engines return T - 1 rows (the last sampled token never went through a forward); the
trainer's row T - 1 and padding rows hold K *distinct* valid ids (0..K-1), because duplicate
ids break megatron's token dispatchers.

Everything here raises `RouteError` naming the sample and layer; nothing falls back to live
routing silently.
"""

from __future__ import annotations

import base64

import numpy as np


class RouteError(ValueError):
    """A route record violates the contract."""


def route_dtype(num_experts: int) -> np.dtype:
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    raise RouteError(f"{num_experts} experts do not fit the int16 route record (max 32767)")


def filler_row(num_moe_layers: int, topk: int, dtype: np.dtype) -> np.ndarray:
    """[L_moe, K] row of distinct valid ids for positions without a recorded route."""
    return np.broadcast_to(np.arange(topk, dtype=dtype), (num_moe_layers, topk)).copy()


def missing_row(num_moe_layers: int, topk: int, dtype: np.dtype) -> np.ndarray:
    """[L_moe, K] row for a position with no recorded route that the actor's live router is to route
    (rollout.multi_turn.missing_routes=live): every slot expert 0, a row no router can produce (K >= 2)."""
    if topk < 2:
        raise RouteError("a route row without a recorded route needs top-k >= 2 (it is marked by repeated ids)")
    return np.zeros((num_moe_layers, topk), dtype=dtype)


def missing_rows(routes):
    """[...] bool over [..., K] expert ids (numpy or torch): rows marked as having no recorded route
    (`missing_row`); none when K = 1."""
    if routes.shape[-1] < 2:
        return routes[..., 0] != routes[..., 0]
    return (routes == routes[..., :1]).all(-1)


def validate_routes(
    routes: np.ndarray,
    *,
    num_tokens: int,
    num_experts: int,
    num_moe_layers: int,
    topk: int,
    sample: int | str = "?",
    allow_missing: bool = False,
) -> np.ndarray:
    """Check one sample's record and return it with exactly `num_tokens` rows in the contract dtype.

    Accepts T - 1 rows (engine output; the last row is filled) or T rows. `allow_missing`: positions whose
    every layer is a `missing_row` pass (the actor routes them live).
    """
    where = f"sample {sample}"
    r = np.asarray(routes)
    if r.ndim != 3:
        raise RouteError(f"{where}: routes must be [T, L_moe, K], got shape {r.shape}")
    if not np.issubdtype(r.dtype, np.integer):
        raise RouteError(f"{where}: routes must hold integer expert ids, got dtype {r.dtype}")
    rows, layers, k = r.shape
    if layers != num_moe_layers:
        raise RouteError(f"{where}: routes have {layers} layers, the model has {num_moe_layers} MoE layers")
    if k != topk:
        raise RouteError(f"{where}: routes have K={k} ids per row, the model routes to top-{topk}")
    if rows not in (num_tokens - 1, num_tokens):
        raise RouteError(
            f"{where}: routes have {rows} rows for {num_tokens} tokens "
            f"(expected {num_tokens - 1} from the engine or {num_tokens})"
        )
    if rows:
        bad = (r < 0) | (r >= num_experts)
        if bad.any():
            t, layer, _ = np.argwhere(bad)[0]
            raise RouteError(
                f"{where}, MoE layer {layer}, token {t}: expert id {int(r[t, layer][bad[t, layer]][0])} "
                f"out of range [0, {num_experts})"
            )
        srt = np.sort(r, axis=-1)
        dup = (srt[..., 1:] == srt[..., :-1]).any(-1)
        if allow_missing:
            dup &= ~missing_rows(r).all(-1, keepdims=True)
        if dup.any():
            t, layer = np.argwhere(dup)[0]
            raise RouteError(
                f"{where}, MoE layer {layer}, token {t}: duplicate expert ids {r[t, layer].tolist()} "
                "(K distinct ids required)"
            )
    dtype = route_dtype(num_experts)
    out = np.empty((num_tokens, layers, k), dtype=dtype)
    out[:rows] = r
    if rows < num_tokens:
        out[rows:] = filler_row(layers, k, dtype)
    return out


def from_native(routed_experts: np.ndarray, moe_layers: list[int], sample: int | str = "?") -> np.ndarray:
    """vLLM's native `CompletionOutput.routed_experts` -> MoE-layer record.

    Native arrays are `[len(prompt) + len(output) - 1, num_hidden_layers, K]` (uint8, or uint16
    above 256 experts) with dense layers as zeros. Dense layers are dropped; a dense layer
    with non-zero ids means the layer map is wrong and is refused.
    """
    r = np.asarray(routed_experts)
    if r.ndim != 3:
        raise RouteError(f"sample {sample}: native routed_experts must be [T-1, layers, K], got shape {r.shape}")
    if moe_layers and max(moe_layers) >= r.shape[1]:
        raise RouteError(
            f"sample {sample}: native routes have {r.shape[1]} layers, MoE layer {max(moe_layers)} does not exist"
        )
    dense = [i for i in range(r.shape[1]) if i not in set(moe_layers)]
    for layer in dense:
        if r[:, layer].any():
            raise RouteError(
                f"sample {sample}, decoder layer {layer}: the model config says dense, but the engine "
                "reported non-zero expert ids (wrong moe layer map?)"
            )
    out = r[:, moe_layers]
    if out.dtype == np.uint16:
        if out.size and out.max() > 32767:
            raise RouteError(f"sample {sample}: expert id {int(out.max())} exceeds the int16 record")
        out = out.astype(np.int16)
    return out


def from_sglang(
    data: str | bytes, num_tokens: int, num_layers: int, topk: int, moe_layers: list[int], sample: int | str = "?"
) -> np.ndarray:
    """SGLang's routed experts (base64 of little-endian int32 `[T-1, num_layers, K]`) -> MoE-layer record."""
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:
        raise RouteError(f"sample {sample}: routed experts are not valid base64: {e}") from None
    expected = (num_tokens - 1) * num_layers * topk * 4
    if len(raw) != expected:
        raise RouteError(
            f"sample {sample}: {len(raw)} bytes of routes, expected {expected} for "
            f"{num_tokens - 1} rows x {num_layers} layers x top-{topk} int32"
        )
    arr = np.frombuffer(raw, dtype="<i4").reshape(num_tokens - 1, num_layers, topk)
    if arr.size and (arr.min() < 0 or arr.max() > 32767):
        raise RouteError(f"sample {sample}: expert ids outside [0, 32767] in SGLang routes")
    native_dtype = np.uint8 if arr.size == 0 or arr.max() < 256 else np.uint16
    return from_native(arr.astype(native_dtype), moe_layers, sample)
