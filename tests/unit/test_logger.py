"""Run logging: one plain line per step to a file (no wrapping), metrics.jsonl, wandb settings."""

from __future__ import annotations

import json

import torch

from moe_rl.common.machine import Machine, resolve
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


def test_step_lines_also_reach_the_run_log_as_info_records(tmp_path, capsys, caplog):
    """Hydra's file handler (train_moe.log) takes INFO records and its console handler WARNING and up: the line is
    printed once and recorded once."""
    import logging

    cfg = TrainConfig()
    cfg.logging.wandb.mode = "disabled"
    log = RunLogger(tmp_path, cfg)
    with caplog.at_level(logging.INFO, logger="moe_rl"):
        log.log(1, {"reward/mean": 0.25})
        log.warn(1, "something")
    printed = capsys.readouterr().out.splitlines()
    recorded = [r.getMessage() for r in caplog.records if r.name == "moe_rl" and r.levelno == logging.INFO]
    assert printed == recorded and len(printed) == 2 and printed[1] == "step 1 warning: something"


def test_the_run_header_names_the_model_layout_and_objective(tiny_models, tmp_path):
    """Parameters counted from the safetensors headers equal transformers' count of the loaded model."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from moe_rl.actor.model import load_hf_config
    from moe_rl.trainer.logger import run_header

    path = str(tiny_models["qwen3_moe"])
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), {"parallel": {"tp": 2, "ep": 2}}))
    cfg.model.path = path
    resolve(cfg, Machine(cuda=False, transformer_engine=False))  # the `auto` settings, as validation resolves them
    lines = run_header(cfg, tmp_path, path, load_hf_config(path), world=4)
    params = AutoModelForCausalLM.from_pretrained(path).num_parameters()
    assert f"{params / 1e6:,.1f}M parameters" in lines[1] and "(qwen3_moe)" in lines[1]
    assert lines[2].endswith("world 4 = DP 2 x TP 2 x PP 1 x CP 1, EP 2, ETP 1; 2 engine(s) of TP 1 in float32")
    assert "train: 30 steps x 4 prompts x 8 samples per DP rank; gspo + icepop, advantage grpo" in lines[3]
    assert lines[4] == (
        "machine settings (CPU; `auto` resolves here): model.transformer_engine=false, model.dtype=float32, "
        "rollout.dtype=float32"
    )


def test_the_run_header_says_once_what_the_engines_cast(tiny_models, tmp_path):
    """A 16-bit engine narrows the float32 checkpoint on load and a float32 actor's weights at every sync; the
    console leaves out vLLM's warning per weight, so the header names the cast (and only a real one)."""
    from omegaconf import OmegaConf

    from moe_rl.actor.model import load_hf_config
    from moe_rl.trainer.logger import checkpoint_dtype, run_header

    path = str(tiny_models["qwen3_moe"])
    assert checkpoint_dtype(path) == "float32"

    def engines(model_dtype: str, rollout_dtype: str) -> str:
        overrides = {"model": {"path": path, "dtype": model_dtype}, "rollout": {"dtype": rollout_dtype}}
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), overrides))
        return run_header(cfg, tmp_path, path, load_hf_config(path), world=2)[2].split("; ", 1)[1]

    note = " (vLLM's note per weight: train_moe.log)"
    assert engines("float32", "bfloat16") == (
        "2 engine(s) of TP 1 in bfloat16, cast from the float32 checkpoint and the float32 actor at each sync" + note
    )
    assert engines("bfloat16", "bfloat16") == "2 engine(s) of TP 1 in bfloat16, cast from the float32 checkpoint" + note
    assert engines("float32", "float32") == "2 engine(s) of TP 1 in float32"


def test_a_step_without_an_update_shows_no_nan():
    """trainer.mode=rollout_only logs no actor metrics: the step line leaves clipfrac and gnorm out (it showed
    `clipfrac nan gnorm nan`); a training step's line keeps its fields in their order."""
    from moe_rl.trainer.logger import step_line

    common = {"reward/mean": 0.2, "response/length_mean": 22.7, "mismatch/kl": -9.94e-08, "mismatch/k3_kl": 5.86e-08}
    common["memory/peak_rss_gib"] = 0.64  # the console's KL is k3 (never negative), not k1 (float noise of any sign)
    line = step_line(1, 2, common | {"time/rollout": 6.9})
    assert line == "step 1/2 reward 0.200 len 22.7 kl(mu||pi_old) 5.86e-08 rss 0.64G | rollout=6.9s"
    trained = step_line(1, 2, common | {"actor/clipfrac": 0.232, "actor/grad_norm": 3.113})
    assert "kl(mu||pi_old) 5.86e-08 clipfrac 0.232 gnorm 3.113 rss 0.64G |" in trained


def test_the_console_leaves_out_vllms_notes_on_the_cpu_engines_deliberate_settings(tmp_path, capsys):
    """conf/train_moe.yaml's job logging, as Hydra composes it: a vLLM warning about a setting moe-rl makes on purpose
    (eager mode, no tcmalloc; the loader's per-weight note of a float32 -> bfloat16 cast), and on CPU a library's
    Python warning about the GPU packages, reach train_moe.log only; vLLM's other warnings and everyone else's reach
    both."""
    import logging.config
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from moe_rl.config.store import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[2] / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        hydra_cfg = compose(config_name="train_moe", return_hydra_config=True).hydra
    job_logging = OmegaConf.to_container(hydra_cfg.job_logging, resolve=False)
    job_logging["handlers"]["file"]["filename"] = str(tmp_path / "train_moe.log")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logging.config.dictConfig(job_logging)
        cast = "Attempted to load weight %s with dtype %s into parameter with dtype %s"  # vLLM's loader, per weight
        records = [
            ("vllm.v1.worker.cpu_worker", "libtcmalloc is not found in LD_PRELOAD. For best ...", None),
            ("vllm.config.vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs", None),
            ("vllm.v1.core.kv_cache_utils", "KV cache is too small for max_model_len", None),
            ("megatron.core", "a megatron warning", None),
            ("vllm.model_executor.models.utils", cast, ("lm_head.weight", torch.float32, torch.bfloat16)),
            ("vllm.model_executor.models.utils", cast, ("norm.weight", torch.float16, torch.bfloat16)),
            # Python warnings, as logging.captureWarnings (the launchers) logs them
            ("py.warnings", "x.py:24: UserWarning: Transformer Engine and Apex are not installed. Falling back", None),
            ("py.warnings", "y.py:9: UserWarning: a warning of another kind", None),
            # megatron's checkpoint loading, on every resume; the same deprecation from elsewhere still shows
            (
                "py.warnings",
                "/site-packages/megatron/core/dist_checkpointing/strategies/torch.py:799: FutureWarning: "
                "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
                None,
            ),
            (
                "py.warnings",
                "/site-packages/torch/distributed/checkpoint/default_planner.py:503: FutureWarning: Please use "
                "DTensor instead and we are deprecating ShardedTensor.",
                None,
            ),
            ("py.warnings", "mine.py:3: FutureWarning: `load_state_dict` is deprecated", None),
        ]
        # straight to the root's handlers: a vLLM imported earlier in this process may have stopped its loggers'
        # propagation (VLLM_CONFIGURE_LOGGING), which the launcher turns off
        for name, msg, args in records:
            record = logging.LogRecord(name, logging.WARNING, __file__, 0, msg, args, None)
            for handler in root.handlers:
                handler.handle(record)
                handler.flush()
    finally:
        for handler in root.handlers[:]:
            handler.close()
            root.removeHandler(handler)
        root.handlers[:], root.level = saved[0], saved[1]
    console = capsys.readouterr().out
    assert "libtcmalloc" not in console and "Enforce eager" not in console
    assert "KV cache is too small" in console and "a megatron warning" in console
    # without CUDA, a library's warning about the GPU packages is left out; any other warning shows
    assert ("Transformer Engine and Apex" in console) == torch.cuda.is_available()
    assert "a warning of another kind" in console
    assert "ShardedTensor" not in console and "dist_checkpointing" not in console
    assert "mine.py:3" in console
    # the float32 -> bfloat16 cast rollout.dtype asks for stays in the file; another dtype pair still shows
    assert "lm_head.weight" not in console and "norm.weight with dtype torch.float16" in console
    log = (tmp_path / "train_moe.log").read_text()
    kept = (
        "libtcmalloc",
        "Enforce eager",
        "KV cache is too small",
        "a megatron warning",
        "lm_head.weight",
        "Apex",
        "ShardedTensor",
    )
    assert all(m in log for m in kept)
