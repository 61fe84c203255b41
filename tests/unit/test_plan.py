"""moe-rl-plan: counts equal transformers' own, KV bytes equal vLLM's own spec, the rows follow the optimizer's
formulas, the trainer's refusals are the planner's, and the command line's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_rl.common.errors import ConfigError
from moe_rl.plan.cli import main
from moe_rl.plan.kv import kv_bytes_per_token
from moe_rl.plan.layout import build_config, check
from moe_rl.plan.memory import ENGINE_OVERHEAD, GIB
from moe_rl.plan.params import (
    active,
    balanced_ends,
    count,
    padded_vocab,
    stage_layers,
    trainer_rank_params,
)
from moe_rl.plan.planner import make_plan
from moe_rl.plan.search import search
from moe_rl.plan.spec import PRESETS_DIR, load_spec, preset_names, spec_from_config

PRESETS = ["deepseek-v3", "glm-4.5", "glm-4.5-air", "qwen3-235b-a22b", "qwen3-30b-a3b"]
TINY = {  # the tiny models of tests/conftest.py, and the small size
    "qwen3_moe": ["--arch", "qwen3_moe", "--dense-layers", "1"],
    "qwen3_moe_tied": ["--arch", "qwen3_moe", "--dense-layers", "1", "--tie-embeddings"],
    "qwen3_moe_small": ["--arch", "qwen3_moe", "--size", "small"],
    "mixtral": ["--arch", "mixtral"],
    "olmoe": ["--arch", "olmoe"],
    "glm4_moe": ["--arch", "glm4_moe"],
    "deepseek_v3": ["--arch", "deepseek_v3", "--mtp-layers", "1"],
    "gpt_oss": ["--arch", "gpt_oss"],
}
GPU_BASE = ["model.dtype=bfloat16", "model.transformer_engine=true", "rollout.dtype=bfloat16"]


def _config(model: str) -> dict:
    path = Path(model) / "config.json" if Path(model).is_dir() else PRESETS_DIR / f"{model}.json"
    return {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, str]:
    from moe_rl.tools.tiny_model import main as build

    root = tmp_path_factory.mktemp("plan_tiny")
    for name, args in TINY.items():
        build([*args, "--out", str(root / name)])
    return {name: str(root / name) for name in TINY}


def test_presets_are_listed():
    assert preset_names() == PRESETS


def _transformers_counts(raw: dict) -> tuple[int, int, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return total, experts, len(model.model.layers)


def _check_counts(model: str, raw: dict):
    spec, total_ref_experts = load_spec(model), _transformers_counts(raw)
    total, experts, layers = total_ref_experts
    counts = count(spec)
    assert layers == spec.num_layers  # transformers builds no MTP layer: their count is ours, MTP excluded
    assert counts.total == total
    assert counts.routed_experts == experts
    assert active(counts, spec) == total - experts + experts * spec.topk // spec.num_experts


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_counts_equal_transformers(preset):
    _check_counts(preset, _config(preset))


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_model_counts_equal_transformers(tiny, name):
    _check_counts(tiny[name], _config(tiny[name]))


def test_mtp_layers_are_counted_apart():
    for preset, mtp in (("deepseek-v3", 11.61), ("glm-4.5", 3.99), ("glm-4.5-air", 2.38)):
        assert round(count(load_spec(preset)).mtp / 1e9, 2) == mtp
    assert count(load_spec("qwen3-30b-a3b")).mtp == 0


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("tp", [1, 8])
def test_kv_bytes_equal_vllm_spec(preset, tp, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from vllm.config import ModelConfig, ParallelConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    (tmp_path / "config.json").write_text(json.dumps(_config(preset)))
    mc = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16")
    pc = ParallelConfig(tensor_parallel_size=tp)
    block = 16
    kind = MLAAttentionSpec if mc.use_mla else FullAttentionSpec
    page = kind(block_size=block, num_kv_heads=mc.get_num_kv_heads(pc), head_size=mc.get_head_size(), dtype=mc.dtype)
    per_token = page.page_size_bytes // block * mc.get_num_layers_by_block_type(pc, "attention")
    assert kv_bytes_per_token(load_spec(preset), tp, "bfloat16") == per_token


def test_padded_vocab_and_divisibility_match_the_actor(tiny):
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.converters import get_converter
    from moe_rl.actor.model import check_divisibility, load_hf_config, padded_vocab_size

    assert all(padded_vocab(v, t) == padded_vocab_size(v, t) for v in (151936, 129280, 1000) for t in (1, 2, 8))
    path = tiny["qwen3_moe"]
    conv, spec = get_converter(load_hf_config(path)), load_spec(path)
    for bad in (ParallelConfig(tp=3), ParallelConfig(ep=3), ParallelConfig(pp=5), ParallelConfig(etp=7)):
        with pytest.raises(ConfigError) as theirs:
            check_divisibility(conv, bad)
        cfg = build_config([*GPU_BASE, *(f"parallel.{k}={getattr(bad, k)}" for k in ("tp", "pp", "ep", "etp"))])
        with pytest.raises(ConfigError) as ours:
            check(cfg, spec, 8 * 3 * 5 * 7)
        assert str(ours.value) == str(theirs.value)


def test_trainer_shares_add_up_to_the_model():
    spec = load_spec("qwen3-30b-a3b")
    counts = count(spec)
    ranks = [trainer_rank_params(spec, counts, 2, 4, None, 8, 1, s) for s in range(4)]
    vocab_pad = (padded_vocab(spec.vocab_size, 2) - spec.vocab_size) * spec.hidden * 2  # embedding and LM head
    replicated = sum(layer.replicated for layer in counts.layers) + spec.hidden  # norms and routers: on both TP ranks
    assert sum(r.experts for r in ranks) * 8 == counts.routed_experts
    assert sum(r.dense for r in ranks) * 2 == counts.total - counts.routed_experts + vocab_pad + replicated


def test_optimizer_rows_follow_the_optimizers():
    spec = load_spec("qwen3-30b-a3b")
    params = count(spec).total + (padded_vocab(spec.vocab_size, 1) - spec.vocab_size) * spec.hidden * 2
    cpu = make_plan(spec, build_config(GPU_BASE), 1, 80 * GIB)
    rows = {r.name: r.bytes for r in cpu.tables[0].rows}
    assert cpu.tables[0].parameters_per_rank == params
    # CPU-path optimizer, bf16: fp32 main grads, fp32 master weights and Adam moments, unsharded
    assert (rows["parameters"], rows["gradients"], rows["optimizer state"]) == (2 * params, 4 * params, 12 * params)
    dist = make_plan(spec, build_config([*GPU_BASE, "actor.distributed_optimizer=true"]), 4, 80 * GIB)
    rows = {r.name: r.bytes for r in dist.tables[0].rows}
    assert (rows["parameters"], rows["gradients"]) == (2 * params, 4 * params)  # bf16 params, fp32 main grads
    assert rows["optimizer state"] == pytest.approx(12 * params / 4, abs=12)  # fp32 master + 2 moments over dp=4


def test_rows_follow_the_settings():
    spec = load_spec("deepseek-v3")
    base = make_plan(spec, build_config(GPU_BASE), 64, 80 * GIB, None).tables[0]
    names = {r.name for r in base.rows}
    assert "reference model" not in names and "critic parameters" not in names
    routes = next(r for r in base.rows if r.name == "route records")
    assert "x 1 B" in routes.note  # 256 experts: uint8 routes
    more = make_plan(spec, build_config([*GPU_BASE, "algorithm.kl_coef=0.01", "actor.router_replay=off"]), 64, 80 * GIB)
    names = {r.name for r in more.tables[0].rows}
    assert "reference model" in names and "route records" not in names


def test_refusals_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="qwen3-30b-a3b"):
        load_spec("qwen3-31b")
    raw = _config("qwen3-30b-a3b")
    del raw["num_experts"]
    with pytest.raises(ConfigError, match="num_experts/num_local_experts/n_routed_experts is missing"):
        spec_from_config(raw)
    spec = load_spec("qwen3-30b-a3b")
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide num_experts=128"):
        check(build_config([*GPU_BASE, "parallel.ep=3"]), spec, 3)
    with pytest.raises(ConfigError, match="world size 6 is not divisible by tp"):
        check(build_config([*GPU_BASE, "parallel.tp=4"]), spec, 6)
    with pytest.raises(ConfigError, match="actor.packing"):  # the trainer's GPU rule, refused here too
        check(build_config(["model.transformer_engine=false"]), spec, 1)
    with pytest.raises(ConfigError, match="actor.optimizer_offload.fraction: 0.5 needs actor.distributed_optimizer"):
        check(build_config(["actor.optimizer_offload.fraction=0.5"]), spec, 8)
    with pytest.raises(ConfigError, match="actor.optimizer_offload.fraction: 2.0: must be in"):
        check(build_config(["actor.distributed_optimizer=true", "actor.optimizer_offload.fraction=2"]), spec, 8)
    with pytest.raises(ConfigError, match="did you mean parallel.tp"):
        build_config(["parallel.tpp=2"])


def test_cli_json_and_verdicts(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--model", "qwen3-30b-a3b", "--gpus", "1", "--gpu-memory-gib", "80", "--json", *GPU_BASE])
    out = json.loads(capsys.readouterr().out)
    assert done.value.code == 1 and out["fits"] is False and out["peak_gib"] > 80
    assert out["total_parameters"] == 30532122624 and out["active_parameters"] == 3353032704
    assert {r["kind"] for r in out["ranks"]} == {"trainer", "engine"}
    assert out["ranks"][0]["parameters_per_rank"] > 0 and out["layout"]["tp"] == 1
    with pytest.raises(SystemExit) as done:
        main(["--model", "qwen3-30b-a3b", "--gpu-memory-gib", "80"])
    assert done.value.code == 2 and "--gpus is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["--model", "nope", "--gpus", "1", "--gpu-memory-gib", "80"])
    assert done.value.code == 2 and "glm-4.5-air" in capsys.readouterr().err


def test_search_returns_accepted_layouts_best_first():
    spec = load_spec("qwen3-30b-a3b")
    overrides = [
        *GPU_BASE,
        "actor.distributed_optimizer=true",
        "data.max_prompt_tokens=1024",
        "sampling.max_tokens=1024",
    ]
    plans = search(spec, build_config(overrides), 16, 80 * GIB, {})
    assert plans and all(p.fits for p in plans)
    keys = [(p.layout.tp * p.layout.pp * p.layout.cp, p.layout.ep * p.layout.etp) for p in plans]
    assert keys == sorted(keys)
    fixed = search(spec, build_config([*overrides, "parallel.tp=2"]), 16, 80 * GIB, {"parallel.tp": 2})
    assert fixed and {p.layout.tp for p in fixed} == {2}  # a key set on the command line stays


def test_preflight_stops_a_layout_that_does_not_fit_and_says_the_cpu_estimate(tiny):
    """trainer.preflight: the trainer's line on CPU is the plan's fullest trainer rank; on a GPU that the plan does
    not fit, the run stops before the model is built, with the plan's tables."""
    from moe_rl.plan.layout import layout_of
    from moe_rl.plan.preflight import preflight

    model = tiny["qwen3_moe_small"]
    cfg = build_config(["data.max_prompt_tokens=100", "sampling.max_tokens=28"])
    trainer = make_plan(load_spec(model), cfg, 2, 1 << 40, layout_of(cfg, 2)).tables[0]
    line = preflight(cfg, model, 2, None)
    assert line.startswith(
        f"preflight: a trainer rank holds about {trainer.total / GIB:.3f} GiB at samples of 100 + 28"
    )
    assert all(f"{r.name} {r.bytes / GIB:.3f}" in line for r in trainer.rows)
    assert "fits; fullest GPU" in preflight(cfg, model, 2, 80 * GIB)
    with pytest.raises(ConfigError, match="trainer.preflight: this layout does not fit") as e:
        preflight(cfg, model, 2, trainer.total // 2)
    assert "verdict: does NOT fit" in str(e.value) and "activations" in str(e.value)


def test_what_megatron_and_the_trainer_hold_where_the_rules_differ():
    """EP=1 under the distributed optimizer: megatron keeps the experts in the dense buffer, sharded over dp*cp (not
    over the expert-data-parallel ranks); the critic has its own non-distributed optimizer; route records live in host
    memory; true on-policy turns the fused log-prob op off."""
    spec = load_spec("qwen3-30b-a3b")
    cfg = build_config(
        [
            *GPU_BASE,
            "actor.distributed_optimizer=true",
            "parallel.tp=2",
            "algorithm.advantage=gae",
            "algorithm/loss=ppo",
        ]
    )
    layout = check(cfg, spec, 8)
    rows = {r.name: r for r in make_plan(spec, cfg, 8, 80 * GIB, layout).tables[0].rows}
    rp = trainer_rank_params(spec, count(spec), 2, 1, None, 1, 1, 0)
    assert rows["optimizer state"].bytes == rp.dense * 12 // 4 + rp.experts * 12 // 4  # dp*cp = 4, not 8
    # the critic's own optimizer (bf16: fp32 main grads, fp32 master + Adam moments), unsharded
    assert rows["critic gradients"].bytes == 2 * rows["critic parameters"].bytes
    assert rows["critic optimizer state"].bytes == 6 * rows["critic parameters"].bytes
    table = make_plan(spec, cfg, 8, 80 * GIB, layout).tables[0]
    assert rows["route records"].host and table.total == sum(r.bytes for r in table.rows if r.name != "route records")
    exact = build_config([*GPU_BASE, "trainer.true_on_policy=true"])
    logits = {r.name: r for r in make_plan(spec, exact, 8, 80 * GIB).tables[0].rows}["log-prob logits"]
    assert "full" in logits.note and logits.bytes > GIB
    half = make_plan(spec, build_config([*GPU_BASE, "rollout.dtype=half"]), 8, 80 * GIB)  # vLLM's name for float16
    assert half.tables[-1].rows[0].note.startswith("half")
    auto = make_plan(spec, build_config(["rollout.dtype=auto"]), 8, 80 * GIB)  # auto: bfloat16 on CUDA
    assert auto.tables[-1].rows[0].note.startswith("bfloat16") and auto.settings["rollout.dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="rollout.dtype: 'float8'"):
        make_plan(spec, build_config([*GPU_BASE, "rollout.dtype=float8"]), 8, 80 * GIB)


def test_the_command_line_refuses_counts_that_cannot_be(capsys):
    for flags in (["--gpus", "0"], ["--gpus", "-8", "--search"], ["--gpus", "8", "--gpu-memory-gib", "0"]):
        with pytest.raises(SystemExit) as done:
            main(["--model", "qwen3-30b-a3b", "--gpu-memory-gib", "80", *flags])
        assert done.value.code == 2 and "must be" in capsys.readouterr().err


def test_uneven_stages_are_megatrons_first_and_last_stage_layout():
    """parallel.first_stage_layers / last_stage_layers: the stages are those megatron builds with
    num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage; the search's balanced choice reaches the
    first MoE layer on the first stage; a stage without an MoE layer is refused, naming it."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from moe_rl.actor.config import ParallelConfig

    for layers, pp, first, last in [
        (61, 11, 6, 1),
        (61, 8, 8, 5),
        (61, 3, None, 21),
        (61, 2, 30, None),
        (7, 4, 1, None),
    ]:
        sizes = ParallelConfig(pp=pp, first_stage_layers=first, last_stage_layers=last).stage_layers(layers)
        assert sum(sizes) == layers and min(sizes) >= 1
        c = TransformerConfig(
            num_layers=layers,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
            num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last,
        )
        megatron = [
            (get_transformer_layer_offset(c, pp_rank=r), get_num_layers_to_build(c, pp_rank=r)) for r in range(pp)
        ]
        assert megatron == [(sum(sizes[:r]), sizes[r]) for r in range(pp)]
        assert [len(stage_layers(layers, pp, None, r, first, last)) for r in range(pp)] == sizes
    assert balanced_ends(61, 11, min_first=4) == (6, 1)  # 6, 9 x 6, 1: DeepSeek-V3's first 3 layers are dense
    assert balanced_ends(61, 8, min_first=4) == (8, 5) and balanced_ends(5, 8) is None
    with pytest.raises(ConfigError, match="cannot share the remaining 58 of num_hidden_layers=61 equally"):
        ParallelConfig(pp=11, first_stage_layers=3).stage_layers(61)
    with pytest.raises(ConfigError, match="pipeline stage 0 would hold layers 0..2, none of them MoE"):
        ParallelConfig(pp=11, first_stage_layers=3, last_stage_layers=4).rank_layers(61, range(3, 61))
    with pytest.raises(ConfigError, match="need parallel.pp > 1 and no parallel.vpp"):
        ParallelConfig(pp=2, vpp=2, first_stage_layers=3).stage_layers(8)


def test_assumptions_lift_only_their_own_rule_and_move_only_their_own_bytes():
    spec = load_spec("deepseek-v3")
    dist = [*GPU_BASE, "actor.distributed_optimizer=true", "model.recompute=full", "data.max_prompt_tokens=1024"]
    with pytest.raises(ConfigError, match="parallel.pp\\*vpp=8 does not divide num_hidden_layers=61"):
        check(build_config([*dist, "parallel.pp=8", "parallel.ep=8"]), spec, 64)
    uneven = build_config(
        [*dist, "parallel.pp=8", "parallel.ep=8", "parallel.first_stage_layers=8", "parallel.last_stage_layers=5"]
    )
    plan = make_plan(spec, uneven, 64, 80 * GIB)
    assert [t.parameters_per_rank for t in plan.tables[:-1]] == [
        trainer_rank_params(spec, count(spec), 1, 8, None, 8, 1, s, 8, 5).total for s in range(8)
    ]
    assert "pp=8 first_stage_layers=8 last_stage_layers=5 cp=1" in plan.layout.describe()
    wide = build_config([*dist, "parallel.pp=8", "parallel.first_stage_layers=8", "parallel.last_stage_layers=5"])
    wide.rollout.tensor_parallel_size, wide.rollout.engines = 16, 1
    with pytest.raises(ConfigError, match="--assume engine-across-nodes"):
        check(wide, spec, 128)
    assert check(wide, spec, 128, frozenset({"engine-across-nodes"})).engine_tp == 16

    qwen, cfg = load_spec("qwen3-30b-a3b"), build_config(dist[:-1])
    # trainer-offload: a shared GPU holds the engine's budget or the trainer and a sleeping engine, whichever is more
    shared = make_plan(qwen, cfg, 8, 80 * GIB, assumed=frozenset({"trainer-offload"}))
    engine = shared.tables[-1].extra["budget_bytes"]
    assert shared.gpus[-1].peak == max(engine, shared.tables[0].total + ENGINE_OVERHEAD)
    assert make_plan(qwen, cfg, 8, 80 * GIB).gpus[-1].peak == shared.tables[0].total + engine


def test_deepseek_v3_fits_only_with_what_moe_rl_lacks(capsys):
    """The layout the search reports as DeepSeek-V3's smallest with the two assumptions (docs/guides/planning.md):
    refused without them, with the reason; fits with them, and the JSON says what it assumed."""
    base = [
        "--model",
        "deepseek-v3",
        "--gpu-memory-gib",
        "79.6",
        "--json",
        *GPU_BASE,
        "actor.distributed_optimizer=true",
    ]
    base += ["data.max_prompt_tokens=1024", "sampling.max_tokens=4096", "rollout.gpu_memory_utilization=0.9"]
    base += ["rollout.sleep_while_training=true", "model.recompute=full", "parallel.tp=8", "parallel.ep=4"]
    base += ["parallel.etp=8", "parallel.first_stage_layers=5", "parallel.last_stage_layers=1"]
    with pytest.raises(SystemExit) as done:
        main([*base, "--search", "--gpus", "416"])
    out = json.loads(capsys.readouterr().out)
    assert done.value.code == 1 and out["fits"] is False and "engine-across-nodes" in out["reason"]
    assume = ["--assume", "engine-across-nodes"]
    offload = ["actor.optimizer_offload.fraction=1"]  # a feature now (it was --assume optimizer-offload)
    layout = ["parallel.pp=13", "rollout.tensor_parallel_size=32", "rollout.engines=1"]
    with pytest.raises(SystemExit) as done:
        main([*base, *assume, *offload, *layout, "--search", "--gpus", "416"])
    out = json.loads(capsys.readouterr().out)
    assert done.value.code == 0 and out["fits"] and out["assumed"] == ["engine-across-nodes"]
    assert out["layout"]["pp"] == 13 and out["layout"]["engine_tp"] == 32 and out["layout"]["assumed"] == out["assumed"]
    with pytest.raises(SystemExit) as done:
        main([*base, *assume, *layout, "--gpus", "416"])  # one plan, without the optimizer offload
    assert done.value.code == 1 and not json.loads(capsys.readouterr().out)["fits"]
    with pytest.raises(SystemExit) as done:
        main([*base, "--assume", "optimizer-offload", "--gpus", "8"])
    assert done.value.code == 2 and "actor.optimizer_offload.fraction=1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main([*base, "--assume", "cpu-adam", "--gpus", "8"])
    assert done.value.code == 2 and "invalid choice: 'cpu-adam'" in capsys.readouterr().err


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_optimizer_offload_moves_its_share_of_the_optimizer_rows_to_host_memory(fraction):
    """actor.optimizer_offload.fraction f: (1 - f) of the optimizer-state row stays on the GPU; f of the rank's state
    elements go to the host as fp32 master + Adam moments (12 B) and a pinned fp32 gradient copy (4 B); the fp32 main
    grads and everything else stay where they were."""
    qwen = load_spec("qwen3-30b-a3b")
    base = ["actor.distributed_optimizer=true", "parallel.ep=8", "data.max_prompt_tokens=1024"]
    on_gpu = make_plan(qwen, build_config(base), 8, 80 * GIB).tables[0]
    off = make_plan(qwen, build_config([*base, f"actor.optimizer_offload.fraction={fraction}"]), 8, 80 * GIB).tables[0]
    before, after = ({r.name: r for r in t.rows} for t in (on_gpu, off))
    layout = check(build_config(base), qwen, 8)
    rp = trainer_rank_params(qwen, count(qwen), 1, 1, None, 8, 1, 0)
    elements = rp.dense // (layout.dp * layout.cp) + rp.experts // layout.expert_dp
    assert before["optimizer state"].bytes == elements * 12  # bf16: fp32 master + two moments, sharded
    assert after["optimizer state"].bytes == int(elements * 12 * (1 - fraction))
    host = after["optimizer state (host)"]
    assert host.host and host.bytes == int(elements * fraction) * 12
    assert after["gradient copies (host)"].bytes == int(elements * fraction) * 4
    assert after["gradients"] == before["gradients"]  # the DDP buffer's fp32 main grads stay on the GPU
    assert on_gpu.total - off.total == before["optimizer state"].bytes - after["optimizer state"].bytes
    assert off.host_total - on_gpu.host_total == int(elements * fraction) * 16


def test_optimizer_offload_is_refused_on_a_cpu_run():
    from moe_rl.config import TrainConfig
    from moe_rl.config.validate import validate

    cfg = TrainConfig()
    cfg.actor.optimizer_offload.fraction = 1.0
    with pytest.raises(ConfigError, match="actor.optimizer_offload.fraction: 1.0: megatron's CPU optimizer offload"):
        validate(cfg, 2)


def test_the_offload_options_are_megatrons_optimizer_config_fields():
    """The fields actor.optimizer_offload sets exist in the installed megatron-core's OptimizerConfig, with the type
    of their default (megatron's __post_init__ needs Transformer Engine once they are on: not built here)."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    from moe_rl.actor.config import OptimizerOffloadConfig
    from moe_rl.actor.optimizer import offload_options

    assert offload_options(OptimizerOffloadConfig()) == {}
    options = offload_options(OptimizerOffloadConfig(fraction=0.25, overlap=False))
    defaults = {f.name: f.default for f in dataclasses.fields(OptimizerConfig)}
    assert set(options) <= set(defaults)
    assert all(type(v) is type(defaults[k]) for k, v in options.items())
    assert options["optimizer_offload_fraction"] == 0.25 and options["overlap_cpu_optimizer_d2h_h2d"] is False


def test_a_plan_of_the_defaults_plans_what_a_cuda_run_runs(tiny_models, tmp_path, monkeypatch, capsys):
    """`moe-rl-plan --model qwen3-30b-a3b --gpus 64 --gpu-memory-gib 80` with no other argument gives a plan (not a
    refusal), and its machine settings are the ones a CUDA run's header prints: the trainer's validation and header
    on a machine whose platform probe says CUDA with Transformer Engine installed."""
    import torch

    from moe_rl.actor.model import load_hf_config
    from moe_rl.common import platform
    from moe_rl.config import TrainConfig
    from moe_rl.config.validate import validate
    from moe_rl.trainer.logger import run_header

    args = ["--model", "qwen3-30b-a3b", "--gpus", "64", "--gpu-memory-gib", "80"]
    with pytest.raises(SystemExit) as done:
        main([*args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert done.value.code in (0, 1) and out["layout"]["dp"] == 64 and out["ranks"]  # a plan, not a refusal (2)
    with pytest.raises(SystemExit):
        main(args)
    planned = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("machine settings"))
    path = str(tiny_models["qwen3_moe"])

    def header() -> tuple[TrainConfig, list[str]]:
        cfg = TrainConfig()
        cfg.model.path = path
        validate(cfg, 64)  # what the trainer's start-up runs first: resolves `auto` for the machine
        return cfg, run_header(cfg, tmp_path, path, load_hf_config(path), world=64)

    cpu_cfg, cpu_lines = header()
    assert cpu_lines[-1].startswith("machine settings (CPU;") and cpu_cfg.model.dtype == "float32"
    assert cpu_cfg.model.transformer_engine is False and cpu_cfg.rollout.dtype == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(platform, "transformer_engine_installed", lambda: True)
    cuda_cfg, cuda_lines = header()
    assert cuda_lines[-1] == planned
    assert out["settings"] == {
        "model.transformer_engine": cuda_cfg.model.transformer_engine,
        "model.dtype": str(cuda_cfg.model.dtype),
        "rollout.dtype": cuda_cfg.rollout.dtype,
    }
    assert out["settings"] == {"model.transformer_engine": True, "model.dtype": "bfloat16", "rollout.dtype": "bfloat16"}
    monkeypatch.setattr(platform, "transformer_engine_installed", lambda: False)  # CUDA without transformer-engine
    with pytest.raises(ConfigError, match="auto is false here: transformer-engine is not installed"):
        header()
