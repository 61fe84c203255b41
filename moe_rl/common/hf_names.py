"""Names of HF tensors that come one expert at a time: GPT-OSS stores a layer's experts stacked in one tensor
([E, ...]) where megatron holds one module per expert. The actor's converters name each expert's slice
(`expert_slice`); whoever needs whole HF tensors (an HF export, the engine loading a weight sync) stacks them
back (`ExpertStacker`)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

_SLICE = re.compile(r"^(.+)@(\d+)/(\d+)$")


def expert_slice(stacked: str, expert: int, num_experts: int) -> str:
    """The name of expert `expert`'s slice (index on dim 0) of the stacked HF tensor `stacked` ([E, ...]):
    GPT-OSS stores a layer's experts in one tensor where megatron holds one module per expert."""
    return f"{stacked}@{expert}/{num_experts}"


def split_expert_slice(name: str) -> tuple[str, int, int] | None:
    """(stacked name, expert, number of experts) of an `expert_slice` name; None for a plain HF name."""
    m = _SLICE.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


class ExpertStacker:
    """Turns `expert_slice` tensors back into whole stacked HF tensors: `add` returns the finished (name, tensor)
    pairs (a plain tensor at once, a stacked one when its last slice arrived). Holds the slices of unfinished
    tensors only."""

    def __init__(self):
        self._open: dict[str, list[torch.Tensor | None]] = {}

    def add(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        s = split_expert_slice(name)
        if s is None:
            return [(name, t)]
        stacked, e, n = s
        slices = self._open.setdefault(stacked, [None] * n)
        slices[e] = t
        if any(x is None for x in slices):
            return []
        del self._open[stacked]
        return [(stacked, torch.stack(slices))]  # type: ignore[arg-type]

    def finish(self) -> None:
        """Refuse unfinished stacks (a slice that never came: a defect in the sender's plan)."""
        if self._open:
            missing = {k: [i for i, x in enumerate(v) if x is None] for k, v in self._open.items()}
            raise ValueError(f"stacked expert tensors missing experts: {missing}")


def stack_expert_slices(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A dict of HF tensors from (name, tensor) pairs where experts may come as `expert_slice`s."""
    stacker, out = ExpertStacker(), {}
    for name, t in items:
        out.update(stacker.add(name, t))
    stacker.finish()
    return out
