"""The RL loop and the HF export on the DeepSeek-V3-style router families and on GPT-OSS."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ONE_ENGINE
from tests.e2e.test_train_moe import _train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize(
    "arch, attention_weight",
    [
        ("glm4_moe", "model.layers.1.self_attn.q_proj.weight"),  # GQA with qkv bias, partial RoPE
        ("deepseek_v3", "model.layers.1.self_attn.kv_b_proj.weight"),  # MLA
    ],
)
def test_sigmoid_router_family_learns_and_exports(arch, attention_weight, tmp_path, world1):
    """2 processes, a tiny model with dense layer 0 and the sigmoid router (expert bias, 2 groups, shared expert)."""
    from safetensors.torch import load_file

    from moe_rl.tools.export_hf import export
    from tests.reference import load_hf

    history = _train(
        tmp_path, [f"model.tiny_arch={arch}", "trainer.steps=20", "logging.wandb.mode=disabled", ONE_ENGINE]
    )
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\n{arch} mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    assert min(h["router/agreement"] for h in history if "router/agreement" in h) > 0.99  # steps 1 and 11
    assert all(h["router/replay_mismatches"] == 0 for h in history)
    # the engine serves the synced weights (fp32): mu and pi_old agree to rounding after every sync
    assert max(abs(h["mismatch/kl"]) for h in history) < 1e-5

    out = export(tmp_path / "checkpoints", tmp_path / "hf")
    init = load_file(tmp_path / "tiny_model" / "model.safetensors")
    trained = load_hf(str(out)).state_dict()
    bias = [k for k in init if k.endswith("e_score_correction_bias")]
    assert len(bias) == 3 and all(torch.equal(trained[k], init[k]) for k in bias)  # update rate 0
    for key in ("model.layers.1.mlp.shared_experts.up_proj.weight", attention_weight):
        assert not torch.equal(trained[key], init[key]), key


GPT_OSS = ["model.tiny_arch=gpt_oss", "logging.wandb.mode=disabled"]


@pytest.fixture(scope="module")
def gpt_oss_dp2(tmp_path_factory):
    """The default job (30 steps) on GPT-OSS with 2 data-parallel ranks: (its folder, its metrics)."""
    run_dir = tmp_path_factory.mktemp("gpt_oss_dp2")
    return run_dir, _train(run_dir, GPT_OSS)


def _serves_the_synced_weights(history: list[dict]) -> None:
    assert min(h["router/agreement"] for h in history if "router/agreement" in h) > 0.99
    assert all(h["router/replay_mismatches"] == 0 for h in history)
    assert max(abs(h["mismatch/kl"]) for h in history) < 1e-5  # a sync that kept old weights shows here


def test_gpt_oss_learns_and_exports(gpt_oss_dp2, world1):
    """GPT-OSS (sinks, sliding window of 8 keys on layers 0 and 2, biases, clamped SwiGLU, YaRN): the default job
    learns with 2 data-parallel ranks. The engine serves every synced weight (vLLM's own loader copies the sinks and
    stacked experts past a weight update: compat.vllm), so the engine's log-probs stay the actor's; the export is the
    HF layout transformers loads."""
    from safetensors.torch import load_file

    from moe_rl.tools.export_hf import export
    from tests.reference import load_hf

    tmp_path, history = gpt_oss_dp2
    assert len(history) == 30  # the default steps
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\ngpt_oss dp2: mean reward first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    _serves_the_synced_weights(history)
    out = export(tmp_path / "checkpoints", tmp_path / "hf")
    init = load_file(tmp_path / "tiny_model" / "model.safetensors")
    trained = load_hf(str(out)).state_dict()
    assert set(trained) == set(init)
    for key in ("model.layers.0.self_attn.sinks", "model.layers.2.mlp.experts.gate_up_proj_bias"):
        assert trained[key].shape == init[key].shape and not torch.equal(trained[key], init[key]), key


def test_gpt_oss_with_the_experts_split_over_two_ranks_steps_as_data_parallel(gpt_oss_dp2, tmp_path):
    """parallel.ep=2: step 1 samples what the data-parallel run samples (same weights, same seeds) and updates as it
    does (EP changes only the order of the sums), and every later sync serves the engine the split experts."""
    _, reference = gpt_oss_dp2
    history = _train(tmp_path, [*GPT_OSS, "parallel.ep=2", "trainer.steps=3", "trainer.checkpoint_every=-1"])
    got, ref = history[0], reference[0]
    for k in ("reward/mean", "response/length_mean"):
        assert got[k] == ref[k], (k, got[k], ref[k])
    for k in ("actor/grad_norm", "actor/entropy", "actor/clipfrac", "mismatch/k3_kl"):
        assert got[k] == pytest.approx(ref[k], rel=1e-4, abs=1e-9), (k, got[k], ref[k])
    assert len(history) == 3
    _serves_the_synced_weights(history)
