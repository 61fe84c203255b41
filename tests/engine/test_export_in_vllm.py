"""The HF export of a trained checkpoint is served by vLLM with the actor's log-probs."""

from __future__ import annotations

import pytest
import torch

from moe_rl.actor.forward import compute_logprobs
from moe_rl.actor.hf_export import untrained_mtp_tensors
from moe_rl.actor.model import load_hf_config
from moe_rl.actor.weights import HFCheckpoint
from moe_rl.tools.export_hf import export
from moe_rl.trainer import checkpoint
from tests.engine.conftest import start_engine
from tests.reference import hf_forward, load_hf, untied_batch
from tests.unit.test_checkpoint import _actor_and_adam, _adam_step

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_exported_checkpoint_loads_in_vllm(arch, tiny_models, tmp_path, world1):
    """deepseek_v3 (MLA) also carries a multi-token-prediction layer the actor does not train: the export
    copies it unchanged, and vLLM serves the decoder with the trained weights. gpt_oss: the experts the actor holds
    one by one are written stacked, as vLLM's loader reads them."""
    chunks, opt = _actor_and_adam(tiny_models[arch])
    _adam_step(chunks, opt, 0)
    state = {"data_position": 0, "wandb_run_id": None, "model_path": str(tiny_models[arch])}
    checkpoint.save(tmp_path / "ckpt", 1, chunks, opt, state)
    out = export(tmp_path / "ckpt", tmp_path / "hf")
    mtp = untrained_mtp_tensors(out, load_hf_config(out))
    assert len(mtp) == (44 if arch == "deepseek_v3" else 0)  # layer 4: attention, router, 8+1 experts, heads
    source = HFCheckpoint(tiny_models[arch])
    assert all(torch.equal(t, source.get(k)) for k, t in mtp.items())

    # fresh sequences with no token near a routing tie (the engine's and the actor's rounding may break one
    # differently); lengths 12 and 5..12
    ids, mask, *_ = untied_batch(load_hf(str(out)), 500, 3, 12, int(torch.randint(0, 2**31, ())), min_len=5)
    seqs = [row[: int(n)].tolist() for row, n in zip(ids, mask.sum(-1), strict=True)]
    engine = start_engine(out)
    try:
        served = engine.prompt_logprobs(seqs)
    finally:
        engine.shutdown()
    init = load_hf(str(tiny_models[arch]))
    moved = 0.0
    for seq, lp in zip(seqs, served, strict=True):
        ids = torch.tensor([seq])
        actor = compute_logprobs(chunks, ids, torch.ones_like(ids), with_entropy=False)["logprobs"][0]
        diff = (torch.from_numpy(lp[1:]).float() - actor[1:]).abs().max().item()
        assert diff < 1e-3, diff  # fp32 engine vs fp32 actor
        logits, _ = hf_forward(init, ids, torch.ones_like(ids))
        before = torch.log_softmax(logits[0].float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
        moved = max(moved, (before - actor[1:]).abs().max().item())
    assert moved > 1e-2, "the served weights look like the initial ones"


def test_exported_lora_checkpoint_loads_in_vllm_merged(tiny_models, tmp_path, world1):
    """A LoRA checkpoint (adapters only, every target, B != 0) exports as merged/, which vLLM serves with the
    LoRA actor's log-probs."""
    import dataclasses

    from moe_rl.actor import lora
    from moe_rl.actor.config import LoraConfig, ParallelConfig
    from moe_rl.actor.model import load_model
    from moe_rl.actor.optimizer import build_optimizer

    path = tiny_models["qwen3_moe"]
    m = load_model(path, ParallelConfig())
    cfg = LoraConfig(rank=4, alpha=8.0)
    lora.attach(m.chunks, cfg)
    lora.init_adapters(m.chunks, int(torch.randint(0, 2**31, ())), b_std=0.05)
    state = {"data_position": 0, "model_path": str(path), "lora": dataclasses.asdict(cfg)}
    checkpoint.save(tmp_path / "ckpt", 1, m.chunks, build_optimizer(m.chunks, 1e-3), state)
    out = export(tmp_path / "ckpt", tmp_path / "hf")
    assert (out / "merged" / "config.json").is_file()
    ids, mask, *_ = untied_batch(load_hf(str(out / "merged")), 500, 3, 12, int(torch.randint(0, 2**31, ())), min_len=5)
    seqs = [row[: int(n)].tolist() for row, n in zip(ids, mask.sum(-1), strict=True)]
    engine = start_engine(out / "merged")
    try:
        served = engine.prompt_logprobs(seqs)
    finally:
        engine.shutdown()
    for seq, lp in zip(seqs, served, strict=True):
        ids = torch.tensor([seq])
        actor = compute_logprobs(m.chunks, ids, torch.ones_like(ids), with_entropy=False)["logprobs"][0]
        with lora.adapters_off(m.chunks):
            base = compute_logprobs(m.chunks, ids, torch.ones_like(ids), with_entropy=False)["logprobs"][0]
        assert (torch.from_numpy(lp[1:]).float() - actor[1:]).abs().max().item() < 1e-3  # fp32 engine vs fp32 actor
        assert (base[1:] - actor[1:]).abs().max().item() > 1e-2  # the adapters matter
