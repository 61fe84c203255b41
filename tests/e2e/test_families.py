"""The RL loop, the HF export and the diagnostic CLI on the DeepSeek-V3-style router families."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.test_train_moe import _train

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]


def test_glm4_moe_learns_and_exports(tmp_path, world1):
    """2 processes, GLM-4.5 tiny (dense layer 0, sigmoid router with bias, 2 groups, shared expert)."""
    from safetensors.torch import load_file

    from moe_rl.tools.export_hf import export
    from tests.reference import load_hf

    history = _train(tmp_path, ["model.tiny_arch=glm4_moe", "trainer.steps=20", "logging.wandb.mode=disabled"])
    first = sum(h["reward/mean"] for h in history[:5]) / 5
    last = sum(h["reward/mean"] for h in history[-5:]) / 5
    print(f"\nglm4_moe mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert last >= 2 * first
    assert min(h["router/agreement"] for h in history) > 0.99
    assert all(h["router/replay_mismatches"] == 0 for h in history)
    # the engine serves the synced weights (fp32): mu and pi_old agree to rounding after every sync
    assert max(abs(h["mismatch/kl"]) for h in history) < 1e-5

    out = export(tmp_path / "checkpoints", tmp_path / "hf")
    init = load_file(tmp_path / "tiny_model" / "model.safetensors")
    trained = load_hf(str(out)).state_dict()
    bias = [k for k in init if k.endswith("e_score_correction_bias")]
    assert len(bias) == 3 and all(torch.equal(trained[k], init[k]) for k in bias)  # update rate 0
    assert not torch.equal(
        trained["model.layers.1.mlp.shared_experts.up_proj.weight"],
        init["model.layers.1.mlp.shared_experts.up_proj.weight"],
    )
