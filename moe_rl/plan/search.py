"""Search layouts: every TP, PP (megatron's uneven first / last stages where PP does not divide the layers: the
most balanced split whose first stage reaches an MoE layer), CP, EP, ETP, engine TP and engine count the trainer
accepts (the same checks as one plan) that fits on N GPUs; or the smallest multiple of 8 GPUs on which one fits.

Best first: fewest model-parallel ranks (tp x pp x cp), then the fewest expert-parallel ranks (ep x etp), then the
smallest engine TP, then the largest margin on the fullest GPU. Keys set on the command line stay fixed.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from moe_rl.common.errors import ConfigError
from moe_rl.plan.assume import ENGINE_TP_ACROSS_NODES
from moe_rl.plan.kv import engine_dtype_bytes
from moe_rl.plan.layout import check
from moe_rl.plan.memory import GIB
from moe_rl.plan.params import balanced_ends, count, engine_rank_params
from moe_rl.plan.planner import Plan, make_plan
from moe_rl.plan.spec import ModelSpec

KEYS = {
    "parallel.tp": ("parallel", "tp"),
    "parallel.pp": ("parallel", "pp"),
    "parallel.cp": ("parallel", "cp"),
    "parallel.ep": ("parallel", "ep"),
    "parallel.etp": ("parallel", "etp"),
    "parallel.first_stage_layers": ("parallel", "first_stage_layers"),
    "parallel.last_stage_layers": ("parallel", "last_stage_layers"),
    "rollout.tensor_parallel_size": ("rollout", "tensor_parallel_size"),
    "rollout.engines": ("rollout", "engines"),
}
"""The keys the search varies (unless the command line sets them)."""

POWERS = (1, 2, 4, 8)  # TP, CP, ETP and engine TP: within one 8-GPU node


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _engine_tps(assumed: frozenset[str]) -> list[int]:
    return list(POWERS) + (list(ENGINE_TP_ACROSS_NODES) if "engine-across-nodes" in assumed else [])


def _choices(spec: ModelSpec, gpus: int, fixed: dict[str, int], assumed: frozenset[str]) -> Iterator[dict[str, int]]:
    def values(key: str, options: list[int]) -> list[int]:
        return [fixed[key]] if key in fixed else [v for v in options if v <= gpus]

    stages = min(gpus, 32, spec.num_layers)
    min_first = min(spec.moe_layers, default=0) + 1  # the first stage reaches an MoE layer
    uneven = ("parallel.first_stage_layers", "parallel.last_stage_layers")
    for tp in values("parallel.tp", list(POWERS)):
        for pp in values("parallel.pp", [p for p in range(1, stages + 1) if p <= gpus // tp]):
            if any(k in fixed for k in uneven):
                ends = tuple(fixed.get(k) for k in uneven)
            elif spec.num_layers % pp:  # megatron's uneven stages (first / last), as balanced as they go
                if (ends := balanced_ends(spec.num_layers, pp, min_first)) is None:
                    continue
            else:
                ends = (None, None)
            for cp in values("parallel.cp", [1, 2]):
                if gpus % (tp * pp * cp):
                    continue
                dp = gpus // (tp * pp * cp)
                for ep in values("parallel.ep", _divisors(spec.num_experts, gpus)):
                    for etp in values("parallel.etp", sorted({1, tp})):
                        for engine_tp in values("rollout.tensor_parallel_size", _engine_tps(assumed)):
                            for engines in values("rollout.engines", _divisors(dp, dp)):
                                yield {
                                    "parallel.tp": tp,
                                    "parallel.pp": pp,
                                    "parallel.first_stage_layers": ends[0],
                                    "parallel.last_stage_layers": ends[1],
                                    "parallel.cp": cp,
                                    "parallel.ep": ep,
                                    "parallel.etp": etp,
                                    "rollout.tensor_parallel_size": engine_tp,
                                    "rollout.engines": engines,
                                }


def engine_never_fits(
    spec: ModelSpec, base: Any, gpu_bytes: int, fixed: dict[str, int], assumed: frozenset[str] = frozenset()
) -> str | None:
    """Why no layout can fit whatever the GPU count, when an engine worker's weights alone exceed what
    rollout.gpu_memory_utilization gives it at every engine TP the search may use (an engine's workers share one
    node: TP <= 8, unless engine-across-nodes is assumed); else None."""
    counts, r = count(spec), base.rollout
    budget = r.gpu_memory_utilization * gpu_bytes
    key = "rollout.tensor_parallel_size"
    options = [fixed[key]] if key in fixed else _engine_tps(assumed)
    tp = max(options)
    weights = engine_rank_params(spec, counts, tp) * engine_dtype_bytes(r.dtype)
    if weights <= budget:
        return None
    return (
        f"an engine worker's {r.dtype} weights alone take {weights / GIB:.1f} GiB at "
        f"rollout.tensor_parallel_size={tp}, "
        f"more than rollout.gpu_memory_utilization={r.gpu_memory_utilization} x {gpu_bytes / GIB:g} GiB = "
        f"{budget / GIB:.1f} GiB: no GPU count helps"
        + (
            ""
            if "engine-across-nodes" in assumed
            else " (engine TP stays within one 8-GPU node; --assume engine-across-nodes plans as if it did not)"
        )
    )


def rank_key(plan: Plan) -> tuple:
    """Best first (the module docstring's rule)."""
    lay = plan.layout
    return (lay.tp * lay.pp * lay.cp, lay.ep * lay.etp, lay.engine_tp, -plan.margin)


def search(
    spec: ModelSpec,
    base: Any,
    gpus: int,
    gpu_bytes: int,
    fixed: dict[str, int],
    progress: Callable[[str], None] | None = None,
    refused: list[str] | None = None,
    assumed: frozenset[str] = frozenset(),
) -> list[Plan]:
    """Every accepted layout on `gpus` GPUs that fits, best first. `refused`: collects why each layout that the
    trainer refuses was refused (to say so when the keys given leave none). `assumed`: what-if features
    (moe_rl.plan.assume) that widen what is accepted."""
    found, tried, start, said = [], 0, time.monotonic(), 0.0
    for choice in _choices(spec, gpus, fixed, assumed):
        tried += 1
        cfg = copy.deepcopy(base)
        for key, value in choice.items():
            section, name = KEYS[key]
            setattr(getattr(cfg, section), name, value)
        try:
            layout = check(cfg, spec, gpus, assumed)
        except ConfigError as e:
            if refused is not None:
                refused.append(str(e))
            continue
        plan = make_plan(spec, cfg, gpus, gpu_bytes, layout)
        if plan.fits:
            found.append(plan)
        elapsed = time.monotonic() - start
        if progress and elapsed > 3 and elapsed - said > 2:
            said = elapsed
            progress(f"searching {gpus} GPUs: {tried} layouts tried, {len(found)} fit ({elapsed:.0f} s)")
    if not tried:
        given = " ".join(f"{k}={v}" for k, v in fixed.items())
        raise ConfigError(f"no layout on {gpus} GPUs has {given}: tp x pp x cp must divide the GPU count")
    return sorted(found, key=rank_key)


def smallest(
    spec: ModelSpec,
    base: Any,
    gpu_bytes: int,
    fixed: dict[str, int],
    max_gpus: int = 1024,
    progress: Callable[[str], None] | None = None,
    refused: list[str] | None = None,
    assumed: frozenset[str] = frozenset(),
) -> list[Plan]:
    """The layouts that fit on the smallest multiple of 8 GPUs (up to max_gpus) on which any does; [] if none."""
    for gpus in range(8, max_gpus + 1, 8):
        if progress:
            progress(f"trying {gpus} GPUs")
        try:
            plans = search(spec, base, gpus, gpu_bytes, fixed, progress, refused, assumed)
        except ConfigError:  # the keys given leave no layout on this count; a larger one may have some
            continue
        if plans:
            return plans
    return []


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
