"""Slicing of per-token tensors (routes above all) exactly as megatron-core slices the tokens.

Conventions (see design.md, "Token order inside Megatron"):
- padded (bshd) batches are `[b, T, ...]`; megatron's hidden states are `[S, B, H]` and a
  router sees `hidden.view(-1, H)`, i.e. token `s * B + b` (`to_router_order`);
- context parallel (zig-zag): the sequence is cut into 2*CP chunks and CP rank r keeps chunks
  r and 2*CP-1-r (megatron.core.utils.get_batch_on_this_cp_rank);
- sequence parallel: each TP rank keeps T/TP consecutive positions of what CP left it;
- packed (THD): samples are concatenated, each padded to a multiple of TP*CP*2; under CP each
  sample's padded segment is zig-zag split on its own (Transformer Engine's THD partition).

All functions are pure torch/numpy and device-agnostic, so each rank slices its own rows on
the host and moves only its slice to the device.
"""

from __future__ import annotations

import numpy as np
import torch

Array = torch.Tensor | np.ndarray


def zigzag_indices(length: int, cp: int, cp_rank: int) -> np.ndarray:
    """Positions of a length-`length` sequence that context-parallel rank `cp_rank` holds."""
    if cp == 1:
        return np.arange(length)
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} is not divisible by 2*cp = {2 * cp}")
    chunk = length // (2 * cp)
    first = np.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = np.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return np.concatenate([first, second])


def rank_positions(
    length: int, tp: int = 1, tp_rank: int = 0, cp: int = 1, cp_rank: int = 0, sequence_parallel: bool = False
) -> np.ndarray:
    """Sequence positions (of a bshd batch) whose tokens reach this rank's routers, in order."""
    pos = zigzag_indices(length, cp, cp_rank)
    if sequence_parallel and tp > 1:
        if len(pos) % tp:
            raise ValueError(f"{len(pos)} positions per CP rank are not divisible by tp={tp} (sequence parallel)")
        per = len(pos) // tp
        pos = pos[tp_rank * per : (tp_rank + 1) * per]
    return pos


def layer_columns(layers: list[int], moe_layers: list[int]) -> list[int]:
    """The route columns of `layers` (e.g. one pipeline stage's MoE layers) in routes whose columns are
    `moe_layers`."""
    col = {layer: i for i, layer in enumerate(moe_layers)}
    if unknown := [layer for layer in layers if layer not in col]:
        raise ValueError(f"MoE layers {unknown} are not among the route layers {list(moe_layers)}")
    return [col[layer] for layer in layers]


def slice_sequence(x: Array, positions: np.ndarray) -> Array:
    """x[:, positions] for `[b, T, ...]` arrays or tensors."""
    if isinstance(x, torch.Tensor):
        return x[:, torch.as_tensor(positions, dtype=torch.long)]
    return x[:, positions]


def to_router_order(x: torch.Tensor) -> torch.Tensor:
    """`[b, s, ...]` -> `[s * b, ...]` (megatron's `s * B + b` token order)."""
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])
