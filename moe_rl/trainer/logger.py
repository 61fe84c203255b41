"""Run logging: one console line per step (rich), metrics.jsonl in the run directory, wandb."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path


class RunLogger:
    def __init__(self, run_dir: Path, cfg, enabled: bool = True, wandb_id: str | None = None):
        """wandb_id: continue that wandb run (a resumed checkpoint's)."""
        self.enabled = enabled
        self.run = None
        if not enabled:
            return
        from rich.console import Console

        self.console = Console()
        self.path = Path(run_dir) / "metrics.jsonl"
        if cfg.logging.wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=cfg.logging.wandb_project,
                mode=cfg.logging.wandb_mode,
                dir=str(run_dir),
                id=wandb_id,
                resume="allow" if wandb_id else None,
                config=dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg),
            )

    @property
    def run_id(self) -> str | None:
        return None if self.run is None else self.run.id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.run is not None:
            self.run.log(metrics, step=step)
        times = " ".join(f"{k[5:]}={v:.1f}s" for k, v in metrics.items() if k.startswith("time/"))
        self.console.print(
            f"[bold]step {step}[/] reward {metrics.get('reward/mean', float('nan')):.3f} "
            f"len {metrics.get('response/length_mean', 0):.1f} "
            f"kl(mu||pi_old) {metrics.get('mismatch/kl', float('nan')):.2e} "
            f"clipfrac {metrics.get('actor/clipfrac', float('nan')):.3f} "
            f"gnorm {metrics.get('actor/grad_norm', float('nan')):.3f} | {times}"
        )

    def warn(self, step: int, message: str) -> None:
        if self.enabled:
            self.console.print(f"[yellow]step {step} warning:[/] {message}")

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
