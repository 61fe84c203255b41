"""One trajectory's expert routes across turns, recorded append-only.

Each turn the engine computes some positions of the trajectory: the ones the prefix cache does not hold
(the last sampled token of the previous turn, which was sampled but never fed through the model, the
observation, then the new turn's tokens but its last). A turn contributes rows only for positions no earlier
turn recorded; rows of earlier turns are kept as they are. That is the record the tokens were sampled with:
peers that take the whole route tensor of the last turn (verl #5825, miles #3307) replace the routes of
earlier turns by a later prefill's, wrong as soon as the weights changed between turns.

A position computed twice (a partial prefix-cache block, the last prompt token the engine always recomputes,
a preemption) keeps its first row; `recomputed` counts such rows and `recomputed_changed` the ones whose
expert set differed (routes/recomputed_fraction, routes/recomputed_disagreement). A position no turn computed
for this trajectory (a prefix-cache hit on blocks another trajectory computed) takes the row of that
trajectory, whose tokens up to it are the same; with none, it is an error naming sample, turn and position,
or under `rollout.multi_turn.missing_routes=live` a marked row (`routing.records.missing_row`) that the actor's
live router routes.
"""

from __future__ import annotations

import numpy as np
import torch

from moe_rl.routing.compare import route_sets_differ
from moe_rl.routing.records import RouteError


def expert_sets_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[N] bool: rows [N, L, K] whose expert set differs on some layer (routing.compare.route_sets_differ)."""
    differ, _ = route_sets_differ(torch.from_numpy(np.ascontiguousarray(a)), torch.from_numpy(np.ascontiguousarray(b)))
    return differ.any(-1).numpy()


def check_append_only(before: np.ndarray, after: np.ndarray, sample: str, turn: int) -> None:
    """Raise unless the record after a turn keeps every row recorded before it (run every turn)."""
    n = before.shape[0]
    if after.shape[0] < n:
        raise RouteError(f"sample {sample}, turn {turn}: the route record shrank from {n} to {after.shape[0]} rows")
    changed = np.nonzero((before != after[:n]).any(axis=(-1, -2)))[0]
    if changed.size:
        raise RouteError(
            f"sample {sample}, turn {turn}: rows of earlier turns were overwritten at {changed.size} positions "
            f"(first: position {int(changed[0])}); the routes a token was sampled with must be kept"
        )


class StitchedRoutes:
    """The record of positions [0, len(self)) of one trajectory."""

    def __init__(self, num_moe_layers: int, topk: int, dtype: np.dtype):
        self.rows = np.zeros((0, num_moe_layers, topk), dtype=dtype)
        self.recomputed = 0  # rows a later turn computed again
        self.recomputed_changed = 0  # ... with a different expert set
        self.computed = 0  # rows computed over all turns (the recomputed fraction's denominator)
        self.missing = 0  # rows without a route, left to the actor's live router (missing_routes=live)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def add_turn(self, rows: np.ndarray, computed: np.ndarray, needed: int) -> list[int]:
        """Append this turn's rows for positions [len(self), needed) from the engine's capture (`rows` [n, L, K]
        over positions 0..n-1, `computed` [n]); count recomputed rows. Returns the new positions the engine did
        not compute for this trajectory (to fill with `fill` or fail)."""
        if rows.shape[0] < needed or computed.shape[0] != rows.shape[0]:
            raise RouteError(f"{rows.shape[0]} captured rows ({computed.shape[0]} flags) for {needed} positions")
        known = len(self)
        again = np.nonzero(computed[:known])[0]
        self.computed += int(computed.sum())
        self.recomputed += again.size
        self.recomputed_changed += int(expert_sets_differ(rows[again], self.rows[again]).sum())
        self.rows = np.concatenate([self.rows, rows[known:needed]])
        return [known + int(p) for p in np.nonzero(~computed[known:needed])[0]]

    def fill(self, position: int, row: np.ndarray) -> None:
        self.rows[position] = row
