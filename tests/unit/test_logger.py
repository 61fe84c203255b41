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


def test_a_resumed_run_sets_aside_the_records_of_the_steps_it_trains_again(tmp_path, capsys):
    cfg = TrainConfig()
    cfg.logging.wandb.mode = "disabled"
    first = RunLogger(tmp_path, cfg)
    first.log(0, {"val/reward_mean": 0.1, "val/pass@k": 0.2, "val/pass@1": 0.1, "val/length_mean": 3, "val/prompts": 4})
    for step in (1, 2, 3):  # a crash after step 3; the newest checkpoint is step 2's
        first.log(step, {"reward/mean": step / 10})
    first.close()
    again = RunLogger(tmp_path, cfg, resumed_step=2)
    again.log(3, {"reward/mean": 0.35})
    again.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r.get("reward/mean")) for r in records] == [(0, None), (1, 0.1), (2, 0.2), (3, 0.35)]
    superseded = [json.loads(line) for line in (tmp_path / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [{"step": 3, "reward/mean": 0.3}]
    assert "the records of step 3, logged after the checkpoint of step 2" in capsys.readouterr().out
    RunLogger(tmp_path, cfg, resumed_step=3).close()  # nothing after step 3: nothing moves
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
