"""RL with LoRA through launch/train_moe.py (actor.lora, 2 ranks, the built-in tiny model): each weight sync sends
the adapted linears only, merged, and the engine then samples with the actor's policy (mu == pi_old to fp32
rounding: the merged weights reach vLLM); the adapter-only checkpoint resumes to the uninterrupted run's metrics;
the export writes a merged HF folder transformers loads."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from moe_rl.actor.weights import HFCheckpoint
from tests.conftest import run_job, untimed
from tests.reference import load_hf, random_batch

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.slow]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "launch/train_moe.py"]
LORA = ["actor.lora.rank=8", "actor.lr=1e-2", "logging.wandb.mode=disabled", "trainer.steps=4"]
# the HF tensors of the linears LoRA adapts (targets=all on the tiny Qwen3-MoE): attention, dense MLP, experts
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj")


def _steps(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def adapted_names(ckpt: HFCheckpoint) -> set[str]:
    """The HF tensors of the linears targets=all adapts."""
    return {n for n in ckpt.weight_map if n.removesuffix(".weight").rsplit(".", 1)[-1] in ADAPTED}


def adapted_bytes(model_dir) -> tuple[int, int]:
    """(bytes of the linears targets=all adapts, bytes of every tensor) of an HF folder, in the actor's float32."""
    ckpt = HFCheckpoint(model_dir)
    sizes = {n: ckpt.get(n).numel() * 4 for n in ckpt.weight_map}
    return sum(sizes[n] for n in adapted_names(ckpt)), sum(sizes.values())


def test_lora_rl_syncs_the_adapted_linears_resumes_exactly_and_exports(tmp_path):
    run = tmp_path / "run"
    out = run_job([*TORCHRUN, *LORA, f"hydra.run.dir={run}", "trainer.checkpoint_every=2"], timeout=600)
    steps = [s for s in _steps(run) if "reward/mean" in s]
    assert [s["step"] for s in steps] == [1, 2, 3, 4], out[-3000:]
    model = run / "tiny_model"  # the built-in tiny model the run wrote
    adapted, total = adapted_bytes(model)
    assert 0 < adapted < 0.9 * total
    for s in steps:
        assert s["weight_sync/bytes"] == adapted, (s["weight_sync/bytes"], adapted)  # the changed linears, whole
        assert s["mismatch/k3_kl"] < 1e-8, s["mismatch/k3_kl"]  # the engine samples with the merged weights
        assert s["actor/first_minibatch_ppo_kl"] == 0.0
    assert steps[-1]["actor/ppo_kl"] > 1e-6  # the adapters moved the policy

    resumed = tmp_path / "resumed"
    resume = f"trainer.resume={run}/checkpoints/step_000002"
    run_job([*TORCHRUN, *LORA, f"hydra.run.dir={resumed}", resume, "trainer.checkpoint_every=0"], timeout=600)
    again = [s for s in _steps(resumed) if "reward/mean" in s]
    assert [s["step"] for s in again] == [3, 4]
    for a, b in zip(steps[2:], again, strict=True):
        a, b = untimed(a), untimed(b)
        assert a.keys() == b.keys()
        differ = {k: (a[k], b[k]) for k in a if a[k] != pytest.approx(b[k], rel=1e-6, abs=1e-9)}
        assert not differ, differ

    exported = tmp_path / "hf"
    run_job([sys.executable, "-m", "moe_rl.tools.export_hf", f"{run}/checkpoints", "--out", str(exported)])
    assert (exported / "merged" / "config.json").is_file() and not (exported / "adapter").exists()  # experts: no PEFT
    ids, mask = random_batch(512, 2, 9, 0)
    with torch.no_grad():
        merged = load_hf(exported / "merged")(input_ids=ids, attention_mask=mask).logits
        base = load_hf(model)(input_ids=ids, attention_mask=mask).logits
    assert (merged - base).abs().max() > 1e-3
    shutil.rmtree(exported)
