"""Run logging: one plain line per step to a file (no wrapping), metrics.jsonl, wandb settings."""

from __future__ import annotations

import json

from moe_rl.config import TrainConfig
from moe_rl.trainer.logger import RunLogger


def test_one_unwrapped_line_per_step_when_stdout_is_a_file(tmp_path, capsys):
    cfg = TrainConfig()
    cfg.logging.wandb.mode = "disabled"
    log = RunLogger(tmp_path, cfg)
    metrics = {"reward/mean": 0.25, "mismatch/kl": 1e-8, "actor/grad_norm": 2.0}
    metrics |= {f"time/{phase}": 1.0 for phase in ("rollout", "reward", "old_logprobs", "diagnostics", "update")}
    log.log(1, metrics)
    log.warn(1, "x" * 200)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines  # a 150-character step line and a long warning stay one line each
    assert lines[0].startswith("step 1/30 reward 0.250") and "update=1.0s" in lines[0]
    assert lines[1] == "step 1 warning: " + "x" * 200
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, **metrics}


def test_wandb_offline_files_land_in_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrainConfig()
    w = cfg.logging.wandb
    w.mode, w.name, w.group, w.tags = "offline", "unit", "sweep-a", ["r3", "gspo"]
    log = RunLogger(tmp_path, cfg)
    assert (log.run.name, log.run.group, list(log.run.tags)) == ("unit", "sweep-a", ["r3", "gspo"])
    assert log.run.config["algorithm"]["loss"] == {
        "name": "gspo",
        "clip_low": 3e-4,
        "clip_high": 4e-4,
        "agg": "seq-mean-token-mean",
    }
    assert log.run.config["algorithm"]["correction"] == {"name": "icepop", "low": 0.5, "high": 5.0}
    log.log(1, {"reward/mean": 0.5})
    run_id = log.run_id
    log.close()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
