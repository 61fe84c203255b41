"""One plan: a model, a training config and a GPU count -> the tables of every kind of rank and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_rl.common.machine import CUDA_WITH_TE, machine_settings, settings_line
from moe_rl.plan.assume import describe
from moe_rl.plan.layout import Layout, check
from moe_rl.plan.memory import GIB, GpuVerdict, RankTable, engine_table, lengths, trainer_table, verdicts
from moe_rl.plan.params import ParamCounts, active, count
from moe_rl.plan.spec import ModelSpec


@dataclass
class Plan:
    spec: ModelSpec
    counts: ParamCounts
    layout: Layout
    gpu_bytes: int
    tables: list[RankTable]
    gpus: list[GpuVerdict]
    settings: dict[str, Any] = field(default_factory=dict)  # the machine settings planned with (resolved `auto`)

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.gpus)

    @property
    def peak(self) -> int:
        """Bytes on the fullest GPU."""
        return max(g.peak for g in self.gpus)

    @property
    def margin(self) -> int:
        return self.gpu_bytes - self.peak

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.spec.name,
            "total_parameters": self.counts.total,
            "active_parameters": active(self.counts, self.spec),
            "mtp_parameters": self.counts.mtp,
            "fits": self.fits,
            "peak_gib": round(self.peak / GIB, 3),
            "margin_gib": round(self.margin / GIB, 3),
            "gpu_memory_gib": round(self.gpu_bytes / GIB, 3),
            "settings": self.settings,
            "layout": self.layout.as_dict(),
            "ranks": [t.as_dict() for t in self.tables],
            "gpus": [
                {"label": g.label, "count": g.count, "peak_bytes": g.peak, "fits": g.fits, "notes": g.notes}
                for g in self.gpus
            ],
        }


def make_plan(
    spec: ModelSpec,
    cfg: Any,
    gpus: int,
    gpu_bytes: int,
    layout: Layout | None = None,
    assumed: frozenset[str] = frozenset(),
) -> Plan:
    """Validate `cfg` on `gpus` ranks as the trainer would, less what the what-if features `assumed` lift (unless
    `layout` is given, already checked), and size every kind of rank."""
    layout = layout or check(cfg, spec, gpus, assumed)
    counts = count(spec)
    trainers = [trainer_table(spec, counts, cfg, layout, s) for s in range(layout.pp)]
    engine = engine_table(spec, counts, cfg, layout, gpu_bytes)
    gpus_ = verdicts(trainers, engine, cfg, layout, gpu_bytes)
    return Plan(spec, counts, layout, gpu_bytes, [*trainers, engine], gpus_, machine_settings(cfg))


def render(plan: Plan, cfg: Any) -> str:
    """The plan as text: the model, one table per kind of rank, one line per kind of GPU, the verdict."""
    s, c = plan.spec, plan.counts
    ln = lengths(cfg, s)
    out = [
        f"model {s.name} ({s.model_type}): {c.total / 1e9:.2f}B parameters, {active(c, s) / 1e9:.2f}B active"
        f" ({s.num_experts} experts, top-{s.topk}, {len(s.moe_layers)} of {s.num_layers} layers MoE)",
    ]
    if c.mtp:
        out.append(f"  MTP layers ({s.num_mtp_layers}): {c.mtp / 1e9:.2f}B more, not trained by moe-rl, not counted")
    out.append(f"layout {plan.layout.describe()}")
    out.append(settings_line(cfg, CUDA_WITH_TE))
    if plan.layout.assumed:
        out.append("ASSUMED, as if moe-rl had it (the trainer refuses such a layout or does not do this):")
        out += describe(plan.layout.assumed)
    out.append(
        f"samples: {cfg.data.prompts_per_step} prompts x {cfg.sampling.n} per data-parallel rank, "
        f"{ln.prompt} + {ln.response} tokens each (data.max_prompt_tokens / sampling.max_tokens)"
    )
    for t in plan.tables:
        params = f", {t.parameters_per_rank / 1e9:.3f}B parameters" if t.parameters_per_rank is not None else ""
        out.append("")
        out.append(f"{t.label} ({t.count} GPUs{params})")
        for r in t.rows:
            out.append(f"  {r.name:<26}{r.bytes / GIB:>10.2f} GiB  {r.note}")
        out.append(f"  {'total':<26}{t.total / GIB:>10.2f} GiB")
        if t.host_total:
            out.append(f"  {'host memory (not in total)':<26}{t.host_total / GIB:>10.2f} GiB  per rank")
        if t.kind == "engine":
            e = t.extra
            out.append(
                f"  KV: {e['kv_bytes_per_token'] / 1024:.1f} KiB per token; the step's {e['samples']} samples need "
                f"{e['kv_needed_bytes'] / GIB:.2f} GiB, one full-context sequence {e['kv_min_bytes'] / GIB:.2f} GiB"
            )
    out.append("")
    for g in plan.gpus:
        mark = "ok  " if g.fits else "OVER"
        out.append(f"{mark} {g.label} x{g.count}: {g.peak / GIB:.2f} of {plan.gpu_bytes / GIB:.1f} GiB")
        out += [f"     - {n}" for n in g.notes]
    verdict = "fits" if plan.fits else "does NOT fit"
    if plan.layout.assumed:
        verdict += f" (with --assume {' '.join(sorted(plan.layout.assumed))})"
    out.append(
        f"verdict: {verdict}; fullest GPU {plan.peak / GIB:.2f} GiB, margin {plan.margin / GIB:+.2f} GiB "
        f"(activations and engine workspace are estimates)"
    )
    return "\n".join(out)
