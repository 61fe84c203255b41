"""The trainer's preflight (trainer.preflight): the plan of this run, made before the model is built."""

from __future__ import annotations

from typing import Any

from moe_rl.common.errors import ConfigError
from moe_rl.plan.layout import layout_of
from moe_rl.plan.memory import GIB, lengths
from moe_rl.plan.planner import make_plan, render
from moe_rl.plan.spec import load_spec


def preflight(cfg: Any, model_path: str, world_size: int, gpu_bytes: int | None) -> str:
    """The plan of `cfg` (already validated) for the model at `model_path` on `world_size` ranks. `gpu_bytes`: one
    GPU's memory (CUDA), where a layout that does not fit raises ConfigError with the plan's tables; None (CPU): the
    trainer rank's estimate only. Returns the line to print."""
    spec = load_spec(model_path)
    layout = layout_of(cfg, world_size)
    if gpu_bytes is None:  # CPU: no GPU to fit; the trainer rank's rows (the fullest stage)
        table = max(make_plan(spec, cfg, world_size, 1 << 62, layout).tables[:-1], key=lambda t: t.total)
        rows = ", ".join(f"{r.name} {r.bytes / GIB:.3f}" for r in table.rows)
        ln = lengths(cfg, spec)
        return (
            f"preflight: a trainer rank holds about {table.total / GIB:.3f} GiB at samples of {ln.prompt} + "
            f"{ln.response} tokens (data.max_prompt_tokens + sampling.max_tokens): {rows} GiB"
        )
    plan = make_plan(spec, cfg, world_size, gpu_bytes, layout)
    if not plan.fits:
        raise ConfigError(
            "config trainer.preflight: this layout does not fit these GPUs (trainer.preflight=false starts anyway; "
            f"moe-rl-plan --search lists layouts that do):\n{render(plan, cfg)}"
        )
    return (
        f"preflight: fits; fullest GPU {plan.peak / GIB:.1f} of {gpu_bytes / GIB:.1f} GiB "
        f"(margin {plan.margin / GIB:.1f} GiB; activations and engine workspace are estimates)"
    )
