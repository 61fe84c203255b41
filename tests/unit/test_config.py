"""Hydra config: the YAML matches the schema, overrides work, malformed ones fail naming the key."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from moe_rl.common.machine import resolve
from moe_rl.common.platform import as_on_cuda, this_machine
from moe_rl.config import (
    AlgorithmConfig,
    ConfigError,
    ConfigKeyError,
    SFTTrainerConfig,
    TrainConfig,
    TrainerConfig,
)
from moe_rl.config.describe import check_overrides
from moe_rl.config.store import register_configs
from moe_rl.config.validate import validate
from moe_rl.objectives.config import GeoMaskConfig, GSPOConfig, IcePopConfig, PPOConfig, TISConfig

CONF = str(Path(__file__).resolve().parents[2] / "conf")


def _compose(overrides=(), name="train_moe"):
    register_configs()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name=name, overrides=list(overrides))


def test_composed_defaults_are_the_dataclass_defaults():
    """conf/ adds nothing: the default composed config equals TrainConfig() (one source of defaults)."""
    obj: TrainConfig = OmegaConf.to_object(_compose())
    assert obj == TrainConfig()
    validate(obj, world_size=2)


def test_the_arithmetic_recipe_config_changes_only_what_it_says():
    """conf/arithmetic_rl.yaml (the recipe's RL stage): valid, and train_moe.yaml's defaults everywhere else."""
    obj: TrainConfig = OmegaConf.to_object(_compose(name="arithmetic_rl"))
    validate(obj, world_size=2)  # resolves the `auto` settings for this machine: compare with the defaults resolved
    base = TrainConfig()
    resolve(base, this_machine())
    default = dict(_flat(OmegaConf.to_container(OmegaConf.structured(base))))
    changed = {k: v for k, v in _flat(OmegaConf.to_container(OmegaConf.structured(obj))) if default[k] != v}
    assert set(changed) == {
        "data.task",
        "data.prompts_per_step",
        "actor.lr",
        "actor.lr_warmup_steps",  # warmup, then cosine to min_lr (the comment in the yaml)
        "actor.lr_decay",
        "actor.min_lr",
        "trainer.steps",
        "trainer.checkpoint_every",
        "trainer.val_every",
        "trainer.val_before_train",
        "trainer.seed",  # RL's own prompt pool, not SFT's (the comment in the yaml)
    }, changed
    assert isinstance(obj.algorithm.loss, GSPOConfig) and isinstance(obj.algorithm.correction, IcePopConfig)
    assert obj.actor.router_replay == "r3"  # today's defaults: GSPO + IcePop + R3


@pytest.mark.parametrize("mode", ["sync", "ahead", "inflight"])
def test_the_long_tail_config_is_the_recipe_on_its_task_in_every_mode_bench_inflight_runs(mode):
    """conf/arithmetic_longtail_rl.yaml: arithmetic_rl.yaml on 2-8 one-digit operands, valid on one rank with the
    engine on the other core in each of bench/inflight.py's modes (no run fails minutes into the bench)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("inflight_bench", Path(CONF).parent / "bench" / "inflight.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    obj: TrainConfig = OmegaConf.to_object(
        _compose([*bench.MODES[mode], "rollout.placement=separate"], name="arithmetic_longtail_rl")
    )
    validate(obj, world_size=1)
    recipe: TrainConfig = OmegaConf.to_object(_compose(name="arithmetic_rl"))
    assert (obj.data.arithmetic.operands, obj.data.arithmetic.max_operands, obj.data.arithmetic.digits) == (2, 8, 1)
    assert obj.algorithm == recipe.algorithm and obj.actor.router_replay == recipe.actor.router_replay
    assert obj.sampling.max_tokens >= 66  # the longest worked solution and its EOS
    assert obj.rollout.inflight == (mode == "inflight") and obj.trainer.max_staleness == (mode != "sync")


def test_the_arithmetic_lora_config_changes_only_the_adapters_and_the_learning_rate():
    """conf/arithmetic_rl_lora.yaml: the recipe's RL stage with LoRA; valid, and the same as arithmetic_rl.yaml except
    the adapters and the rates (the comparison in docs/guides/lora.md: same steps, batch and schedule shape)."""
    lora: TrainConfig = OmegaConf.to_object(_compose(name="arithmetic_rl_lora"))
    validate(lora, world_size=2)
    full: TrainConfig = OmegaConf.to_object(_compose(name="arithmetic_rl"))
    validate(full, world_size=2)
    a = dict(_flat(OmegaConf.to_container(OmegaConf.structured(full))))
    changed = {k for k, v in _flat(OmegaConf.to_container(OmegaConf.structured(lora))) if a[k] != v}
    assert changed == {"actor.lora.rank", "actor.lr", "actor.min_lr"}, changed
    assert lora.actor.lora.rank == 32 and lora.actor.lora.targets == ["all"]


def _flat(node, prefix=""):
    for k, v in node.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _default_of(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def test_conf_does_not_restate_schema_defaults():
    """Every YAML value in conf/ must differ from the schema default it would set (a restated
    default drifts; today's dataclass docstrings are the documentation)."""
    register_configs()
    top = OmegaConf.to_container(OmegaConf.load(Path(CONF) / "train_moe.yaml"))
    assert set(top) <= {"defaults", "hydra"}, (
        f"conf/train_moe.yaml sets schema keys: {set(top) - {'defaults', 'hydra'}}"
    )
    presets = sorted((Path(CONF) / "algorithm").glob("*.yaml"))
    assert {p.stem for p in presets} >= {"gspo_icepop", "ppo_tis", "grpo"}
    for preset in presets:
        composed = OmegaConf.to_object(_compose([f"algorithm={preset.stem}"])).algorithm
        chosen = {"loss": type(composed.loss)(), "correction": type(composed.correction)()}
        raw = OmegaConf.to_container(OmegaConf.load(preset))
        raw.pop("defaults", None)
        for key, value in _flat(raw):
            head, _, rest = key.partition(".")
            default = _default_of(chosen[head], rest) if head in chosen else _default_of(AlgorithmConfig(), key)
            assert value != default, f"{preset.name}: {key}={value!r} restates the schema default"


def test_algorithm_presets_and_groups():
    obj = OmegaConf.to_object(_compose(["algorithm=ppo_tis", "algorithm.loss.clip_high=0.28"]))
    assert obj.algorithm.loss == PPOConfig(clip_high=0.28) and obj.algorithm.correction == TISConfig()
    obj = OmegaConf.to_object(_compose(["algorithm/correction=geo-mask"]))
    assert obj.algorithm.loss == GSPOConfig() and obj.algorithm.correction == GeoMaskConfig(low=0.999, high=1.001)
    assert OmegaConf.to_object(_compose(["algorithm=grpo"])).algorithm.loss.agg == "seq-mean-token-mean"
    with pytest.raises(Exception, match="clip_lo"):  # a key of another loss's config
        _compose(["algorithm.loss.clip_lo=2"])
    with pytest.raises(Exception, match="cap"):
        _compose(["algorithm=ppo_tis", "algorithm.loss.cap=2"])


@pytest.mark.parametrize(
    "override,suggestion",
    [
        ("trainer.stepz=3", "trainer.steps"),
        ("logging.wandb_mode=online", "logging.wandb.mode"),
        ("algorithm.loss.clip_hi=0.3", "algorithm.loss.clip_high"),
        ("actor.router_replayy=r2", "actor.router_replay"),
    ],
)
def test_unknown_key_names_the_closest(override, suggestion):
    with pytest.raises(ConfigKeyError, match=f"did you mean {suggestion}\\?"):
        check_overrides([override])
    check_overrides(
        [
            "algorithm=ppo_tis",
            "algorithm/loss=ppo",
            "+extra=1",
            "hydra.run.dir=x",
            suggestion + "=" + override.split("=")[1],
        ]
    )


TYPOS = {  # a value outside a key's fixed set, and the valid ones the refusal lists
    "rollout.capture=hok": "config rollout.capture='hok': choose one of auto, hook, native, none",
    "model.recompute=fulll": "config model.recompute='fulll': choose one of full, selective, null",
    "model.tiny_arch=deepseek_v4": "config model.tiny_arch='deepseek_v4': choose one of qwen3_moe, mixtral, olmoe, "
    "glm4_moe, deepseek_v3, gpt_oss",
    "rollout.logprobs_mode=raw": "config rollout.logprobs_mode='raw': choose one of raw_logprobs, processed_logprobs",
    "rollout.cpu_start_method=forkserver": "config rollout.cpu_start_method='forkserver': choose one of fork, spawn",
    "actor.router_replay=r4": "config actor.router_replay='r4': choose one of r3, r2, off",
    "critic.router_replay=r3": "config critic.router_replay='r3': choose one of r2, off",
    "rollout.weight_transport=nccl": "config rollout.weight_transport='nccl': choose one of shm, rpc, cuda_ipc",
    "data.overlong_prompts=truncate": "config data.overlong_prompts='truncate': choose one of error, drop",
    "logging.wandb.mode=on": "config logging.wandb.mode='on': choose one of online, offline, disabled",
    "algorithm.kl_type=k2": "config algorithm.kl_type='k2': choose one of k1, k3, low_var_kl",
    "buffer.priority=fifo": "config buffer.priority='fifo': choose one of uniform, recency, advantage, rarity, mixed",
    "algorithm.prox_logp=approx": "config algorithm.prox_logp='approx': choose one of recompute, loglinear",
    "model.dtype=fp16": "config model.dtype='fp16': choose one of auto, float32, bfloat16",
    "trainer.mode=eval": "config trainer.mode='eval': choose one of train, rollout_only, from_dump",
    "data.task=gsm8k": "config data.task='gsm8k': choose one of toy, file, arithmetic, reasoning_gym, humaneval",
    "rollout.placement=remote": "config rollout.placement='remote': choose one of colocated, separate",
}


@pytest.mark.parametrize("override", sorted(TYPOS))
def test_a_value_outside_a_fixed_set_is_refused_naming_the_valid_ones(override):
    with pytest.raises(ConfigError) as e:
        check_overrides([override])
    assert str(e.value) == TYPOS[override]
    with pytest.raises(Exception, match=override.split("=")[1]):  # a YAML preset's value: Hydra refuses it too
        _compose([override])
    key, _ = override.split("=")
    check_overrides([f"{key}={TYPOS[override].split('choose one of ')[1].split(',')[0]}"])


@pytest.mark.parametrize(
    "override,message",
    [("trainer.stepz=3", "did you mean trainer.steps?"), ("rollout.capture=hok", TYPOS["rollout.capture=hok"])],
)
def test_a_bad_command_line_from_torchrun_is_one_message_before_anything_is_built(override, message, tmp_path):
    start = time.monotonic()
    out = subprocess.run(
        # --standalone: a free port (the default 29500 may be another job's); the timeout leaves room for
        # the suite's concurrent lane on 2 cores
        [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]
        + [override, f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=Path(CONF).parent,
        timeout=600,
    )
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert text.count(message) == 1, text[-3000:]
    assert not (tmp_path / "run").exists()  # refused before Hydra made the run directory: nothing was built
    elapsed = time.monotonic() - start
    print(f"\n{override}: refused in {elapsed:.1f} s")
    # 3.5-5 s on a quiet 2-core machine, 15.9 s once beside CI's other lanes; building the model and starting the
    # engines, which the refusal must come before, take several times that under the same load
    assert elapsed <= 30


@pytest.mark.parametrize(
    "override,match",
    [
        ("actor.router_replayy=r2", "router_replayy"),  # unknown key
        ("actor.lr=fast", "lr"),  # wrong type
    ],
)
def test_schema_errors_name_the_key(override, match):
    with pytest.raises(Exception, match=match):
        _compose([override])


@pytest.mark.parametrize(
    "overrides,world,match",
    [
        (["rollout.model=/x"], 2, "config rollout.model: is set from model.path"),
        (["rollout.seed=0"], 2, "config rollout.seed: is set from trainer.seed"),
        (["algorithm.loss.agg=mean"], 2, "config algorithm.loss.agg"),
        (["rollout.capture=none"], 2, "r3 replays the rollout engine's routes"),
        (["parallel.ep=3"], 2, "config parallel: .*ep\\*etp = 3\\*1 must divide"),
        (["parallel.tp=3"], 2, "config parallel: world size 2 is not divisible by tp\\*pp\\*cp = 3\\*1\\*1"),
        (["model.transformer_engine=true"], 1, "config model.transformer_engine: true needs CUDA"),
        (["rollout.weight_transport=cuda_ipc"], 1, "config rollout.weight_transport: cuda_ipc moves device memory"),
        (["rollout.sleep_while_training=true"], 1, "config rollout.sleep_while_training: true needs CUDA"),
        (["actor.distributed_optimizer=true"], 1, "config actor.distributed_optimizer: true needs CUDA"),
        (["data.prompts_per_step=3"], 2, "config trainer.balance_batch: true moves whole groups within their"),
        (["rollout.engines=3"], 4, "config rollout.engines: 3 engines cannot serve 4 data-parallel ranks"),
        (["parallel.tp=2", "rollout.engines=2"], 2, "cannot serve 1 data-parallel ranks .*choose a divisor of 1"),
        (["rollout.tensor_parallel_size=0"], 2, "config rollout.tensor_parallel_size: 0: must be >= 1"),
        (
            ["rollout.tensor_parallel_size=2", "rollout.placement=separate"],
            2,
            "config rollout.tensor_parallel_size: 2 with rollout.placement=separate",
        ),
        (["actor.mini_batches=5"], 2, "config actor.mini_batches: 5 does not divide the 32 samples"),
        (["data.task=file"], 1, "config data.path"),
        (
            ["data.task=file", "data.path=/no/such/file.jsonl"],
            1,
            "config data.path: '/no/such/file.jsonl' does not exist",
        ),
        (
            ["data.reward=no_such_module:f"],
            1,
            "config data.reward: .*cannot be loaded: No module named 'no_such_module'",
        ),
        (["data.reward=moe_rl.data.rewards:TOY_HORIZON"], 1, "config data.reward: .*not a function"),
        (["sampling.n=1"], 1, "config sampling.n: 1: algorithm.advantage=grpo compares samples within a group"),
        (["sampling.n=1", "algorithm.advantage=rloo"], 1, "config sampling.n: 1: algorithm.advantage=rloo"),
        (["sampling.n=0", "algorithm.advantage=reinforce"], 1, "config sampling.n: must be >= 1"),
        (["sampling.temperature=0"], 1, "config sampling.temperature: 0.0: training needs sampling"),
        (["sampling.max_tokens=0"], 1, "config sampling.max_tokens: 0: must be >= 1"),
        (["actor.micro_batch_size=0"], 1, "config actor.micro_batch_size: 0: must be >= 1"),
        (["actor.mini_batches=0"], 1, "config actor.mini_batches: 0: must be >= 1"),
        (["trainer.max_skipped_steps=0"], 1, "config trainer.max_skipped_steps"),
        (["trainer.checkpoint_every=-2"], 1, "config trainer.checkpoint_every: -2: choose N > 0 .* or -1 \\(never\\)"),
        (["algorithm.kl_coef=-0.1"], 1, "config algorithm.kl_coef: -0.1: must be >= 0"),
        (["algorithm.kl_in_reward=true"], 1, "config algorithm.kl_in_reward: needs algorithm.kl_coef > 0"),
        (["trainer.val_every=2"], 1, "config trainer.val_every: validation needs data.val_path"),
        (["data.val_path=/no/val.jsonl"], 1, "config data.val_path: '/no/val.jsonl' does not exist"),
        (["val.n=4"], 1, "config val.n: 4: greedy validation .* use val.n=1"),
        (["data.max_prompt_tokens=0"], 1, "config data.max_prompt_tokens: 0: must be >= 1"),
        (["buffer.enable=true", "buffer.capacity=2"], 1, "config buffer.capacity: 2 groups cannot hold one step's"),
        (["buffer.enable=true", "buffer.fresh_fraction=1.5"], 1, "config buffer.fresh_fraction: 1.5: must be in"),
        (["buffer.enable=true", "buffer.max_gen_batches=0"], 1, "config buffer.max_gen_batches: 0: must be >= 1"),
        (["buffer.enable=true", "trainer.max_staleness=1"], 1, "config buffer.enable: with trainer.max_staleness"),
        (["trainer.max_staleness=2"], 1, "config trainer.max_staleness: 2: without rollout.inflight choose 0 .* or 1"),
        (["trainer.max_staleness=-1"], 1, "config trainer.max_staleness: -1: must be >= 0"),
        (["rollout.inflight=true"], 1, "config rollout.inflight: true cannot be combined with trainer.max_staleness=0"),
        (
            ["rollout.inflight=true", "trainer.max_staleness=1", "algorithm.prox_logp=loglinear"],
            1,
            "config rollout.inflight: true cannot be combined with algorithm.prox_logp=loglinear",
        ),
        (
            ["rollout.inflight=true", "trainer.max_staleness=1", "rollout.capture=native"],
            1,
            "config rollout.inflight: true cannot be combined with rollout.capture=native",
        ),
        (["rollout.partial=true"], 1, "config rollout.partial: true needs rollout.inflight=true"),
        (
            ["rollout.inflight=true", "trainer.max_staleness=1", "rollout.partial=true", "sampling.stop=[x]"],
            1,
            "config rollout.partial: true cannot be combined with sampling.stop=\\['x'\\]",
        ),
        (["buffer.enable=true", "data.prompts_per_step=3"], 1, "config buffer.enable: needs data.prompts_per_step=3"),
        (["buffer.enable=true", "algorithm.advantage=gae", "algorithm/loss=ppo"], 1, "config buffer.enable: with alg"),
        (["algorithm.advantage=gae"], 1, "config algorithm.advantage: gae gives every token its own advantage"),
        (["algorithm.advantage=gae", "algorithm/loss=ppo", "critic.value_clip=0"], 1, "config critic.value_clip: 0"),
        (["algorithm.advantage=gae", "algorithm/loss=ppo", "critic.mini_batches=5"], 1, "config critic.mini_batches"),
        (
            ["algorithm.prox_logp=loglinear", "actor.router_replay=r2"],
            1,
            "config algorithm.prox_logp: loglinear skips the old-log-prob pass that actor.router_replay=r2 needs",
        ),
        (
            ["algorithm.prox_logp=loglinear", "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=true"],
            1,
            "config algorithm.prox_logp: loglinear skips the old-log-prob pass that algorithm.kl_in_reward=true",
        ),
    ],
)
def test_inconsistent_configs_fail_before_heavy_work(overrides, world, match):
    obj = OmegaConf.to_object(_compose(overrides))
    with pytest.raises(ValueError, match=match):
        validate(obj, world_size=world)


def test_cli_help_shows_examples():
    out = subprocess.run(
        [sys.executable, "launch/train_moe.py", "--help"],
        capture_output=True,
        text=True,
        cwd=Path(CONF).parent,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "router_replay" in out.stdout and "Powered by Hydra" in out.stdout
    assert "torchrun --nproc-per-node=2 launch/train_moe.py parallel.tp=2" in out.stdout  # the examples
    assert "launch/train_moe.py --keys [prefix]" in out.stdout


def test_every_key_has_a_comment_and_keys_prints_it():
    """The docstring under each field is the key's only documentation: none may be missing (loss and correction
    settings included), and `--keys <prefix>` prints it with the default."""
    from moe_rl.config.describe import _schema_keys, describe_keys

    rows, keys = describe_keys(), _schema_keys(TrainConfig())
    leaves = {k for k in keys if not any(other.startswith(k + ".") for other in keys)}
    described = {k for k, _, _ in rows}
    assert leaves <= described and all(
        k.startswith(("algorithm.loss.", "algorithm.correction.")) for k in described - leaves
    )
    assert [k for k, _, c in rows if not c.split("] ")[-1].strip()] == []
    out = subprocess.run(
        [sys.executable, "launch/train_moe.py", "--keys", "rollout.kv_cache"],
        capture_output=True,
        text=True,
        cwd=Path(CONF).parent,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.startswith("rollout.kv_cache_gib = None\n    "), out.stdout + out.stderr


def test_group_free_advantage_accepts_one_sample_per_prompt():
    obj = OmegaConf.to_object(_compose(["sampling.n=1", "algorithm.advantage=reinforce", "actor.mini_batches=1"]))
    validate(obj, world_size=1)


@pytest.mark.parametrize(
    "override,key",
    [
        ("sampling.n=1", "sampling.n"),
        ("sampling.temperature=0", "sampling.temperature"),
        ("actor.micro_batch_size=0", "actor.micro_batch_size"),
        ("sampling.max_tokens=0", "sampling.max_tokens"),
        ("data.path=/no/such.jsonl", "data.path"),
        ("data.reward=no_such_module:f", "data.reward"),
        ("parallel.tp=3", "parallel"),
    ],
)
def test_settings_that_cannot_learn_fail_fast_before_any_engine(override, key, tmp_path):
    """The trainer's own entry point: exit status 2 and one line naming the key (no traceback), no model and no
    engine built."""
    import time

    extra = ["data.task=file"] if key == "data.path" else []
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "launch/train_moe.py", override, *extra, f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        cwd=Path(CONF).parent,
        timeout=120,
    )
    seconds = time.perf_counter() - t0
    text = out.stdout + out.stderr
    assert out.returncode == 2 and f"[moe-rl] config {key}" in text and "Traceback" not in text, text[-3000:]
    assert "vLLM" not in text and not (tmp_path / "tiny_model").exists()  # nothing was built
    assert seconds < 60, seconds


def test_the_loss_is_chosen_by_its_group_only():
    by_group = OmegaConf.to_object(_compose(["algorithm.advantage=gae", "algorithm/loss=ppo"]))
    validate(by_group, world_size=2)
    assert by_group.algorithm.loss == PPOConfig()
    with pytest.raises(ConfigKeyError, match="algorithm.policy_loss is gone; choose the loss with the group"):
        check_overrides(["algorithm.policy_loss=ppo"])


def test_gpu_only_transport_choices_are_checked_as_on_a_gpu():
    """What a GPU machine would be told (validated here as on one, moe_rl.common.platform.as_on_cuda): cuda_ipc serves
    a colocated engine of one worker only."""
    gpu = ["actor.packing=false"]  # packing on GPU needs Transformer Engine (another check)
    with as_on_cuda():
        validate(OmegaConf.to_object(_compose([*gpu, "rollout.weight_transport=cuda_ipc"])), world_size=2)
        tp_engine = [*gpu, "rollout.weight_transport=cuda_ipc", "rollout.tensor_parallel_size=2", "parallel.tp=2"]
        with pytest.raises(ValueError, match="rollout.weight_transport: cuda_ipc maps the bucket on the leader's GPU"):
            validate(OmegaConf.to_object(_compose(tp_engine)), world_size=2)
    with pytest.raises(ValueError, match="needs CUDA"):  # and this machine's own answer outside it
        validate(OmegaConf.to_object(_compose([*gpu, "rollout.weight_transport=cuda_ipc"])), world_size=2)


@pytest.mark.parametrize(
    "visible, count, first, tp, expected",
    [
        (None, 4, 1, 1, "1"),
        ("4,5,6,7", 4, 2, 1, "6"),
        ("4,5,6,7", 4, 1, 2, "5,6"),
        ("GPU-a,GPU-b", 2, 0, 2, "GPU-a,GPU-b"),
    ],
)
def test_an_engine_sees_its_leaders_gpu_and_the_next_ones(visible, count, first, tp, expected):
    from moe_rl.rollout.engine import RolloutEngineError, engine_visible_devices

    assert engine_visible_devices(visible, count, first, tp) == expected
    with pytest.raises(RolloutEngineError, match="tensor_parallel_size=2: an engine led by the rank on device 3"):
        engine_visible_devices(visible, 4, 3, 2)


def test_a_run_without_checkpoints_names_the_setting_that_turned_them_off():
    """What the stop-signal warning cites (RL and SFT): the reason and `saves_checkpoints` come from one place."""
    cases = [
        (TrainerConfig(), None),
        (TrainerConfig(checkpoint_every=-1), "trainer.checkpoint_every=-1"),
        (TrainerConfig(mode="rollout_only"), "trainer.mode=rollout_only"),
        (TrainerConfig(mode="rollout_only", checkpoint_every=-1), "trainer.mode=rollout_only"),
        (SFTTrainerConfig(), None),
        (SFTTrainerConfig(checkpoint_every=-1), "trainer.checkpoint_every=-1"),
    ]
    for t, why in cases:
        assert t.no_checkpoint_because == why and t.saves_checkpoints == (why is None), (t, why)
