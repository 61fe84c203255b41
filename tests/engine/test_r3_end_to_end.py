"""End to end in bf16: vLLM rollouts with captured routes, Megatron log-probs with and without R3."""

from __future__ import annotations

import pytest
import torch

from moe_rl.rollout.config import SamplingConfig
from tests.engine.conftest import start_engine

pytestmark = pytest.mark.engine


def test_r3_brings_megatron_logprobs_closer_to_vllm(engines, tiny_models, world1):
    """Megatron's live routing differs from vLLM's on a few bf16 tokens; replaying vLLM's routes
    (R3) removes those flips, leaving only bf16 rounding between the two log-probs."""
    from moe_rl.actor.config import ParallelConfig
    from moe_rl.actor.forward import compute_logprobs
    from moe_rl.actor.model import ModelOptions, build_model, load_hf_config
    from moe_rl.actor.replay import RouteReplay
    from moe_rl.actor.weights import load_hf_weights
    from moe_rl.objectives import mismatch_metrics

    path = tiny_models["qwen3_moe"]
    eng = engines("qwen3_moe", "bfloat16")
    g = torch.Generator().manual_seed(17)
    prompts = [
        torch.randint(3, 500, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist() for _ in range(8)
    ]
    batch = eng.generate(prompts, SamplingConfig(n=4, max_tokens=16, seed=2))
    padded = batch.to_padded()

    chunks, conv = build_model(load_hf_config(path), ParallelConfig(), ModelOptions(dtype="bfloat16"))
    load_hf_weights(chunks, conv, path)
    replay = RouteReplay(chunks, eng.moe_layers, verify=True)
    live = compute_logprobs(
        chunks, padded.input_ids, padded.attention_mask, micro_batch_size=8, replay=replay, record=True
    )
    replay.dispatch_check(reset=True)
    r3 = compute_logprobs(
        chunks, padded.input_ids, padded.attention_mask, micro_batch_size=8, replay=replay, routes=padded.routes
    )
    checked, dispatched_elsewhere = replay.dispatch_check(reset=True)

    m = padded.loss_mask
    without = mismatch_metrics(live["logprobs"], padded.rollout_logprobs, m)
    with_r3 = mismatch_metrics(r3["logprobs"], padded.rollout_logprobs, m)
    # router disagreement between the trainer's live routing and the engine (real tokens, last row excluded)
    valid = padded.attention_mask.bool().clone()
    lengths = padded.attention_mask.sum(1)
    valid[torch.arange(len(lengths)), lengths - 1] = False
    differ = (live["routes"].long().sort(-1).values != padded.routes.long().sort(-1).values).any(-1)
    disagreement = differ[valid].float().mean().item()

    def token_diff(out) -> float:  # the largest per-token |log-prob difference| with the engine
        return (out["logprobs"] - padded.rollout_logprobs).abs()[m.bool()].max().item()

    ratio = float(with_r3["k3_kl"]) / float(without["k3_kl"])
    print(
        f"\nbf16 Megatron vs vLLM: router disagreement without replay {disagreement:.2%}; "
        f"R3 dispatch: {dispatched_elsewhere} of {checked} token rows elsewhere than replayed; "
        f"k3 KL without R3 {float(without['k3_kl']):.3e}, with R3 {float(with_r3['k3_kl']):.3e} "
        f"(ratio {ratio:.3f}); |log-ppl diff| {float(without['log_ppl_abs_diff']):.3e} -> "
        f"{float(with_r3['log_ppl_abs_diff']):.3e}; max token |logp diff| {token_diff(live):.3e} -> "
        f"{token_diff(r3):.3e}"
    )
    assert disagreement > 0, "bf16 engines should disagree somewhere on this batch (else the test proves nothing)"
    # R3 sent every token row of every MoE layer to exactly the engine's experts (verify=True also raises)
    assert (checked, dispatched_elsewhere) == (padded.input_ids.numel() * len(eng.moe_layers), 0)
    # What R3 leaves is bf16 kernel noise. Measured (CPU, vLLM seed 2): k3 KL 2.05e-2 without R3, 1.89e-3
    # with (ratio 0.092); largest per-token |log-prob diff| 3.31 without (a flipped expert), 0.257 with.
    # Routes not replayed leave the "without" numbers; replayed in b-major order instead of megatron's
    # s * B + b (tried), k3 KL 2.42 (ratio 118) and max |log-prob diff| 12.
    assert ratio < 0.3, ratio
    assert token_diff(r3) < 1.0, token_diff(r3)


def test_fp32_head_keeps_a_bf16_engines_logits_in_fp32(engines, tiny_models):
    """rollout.head_dtype=float32 (vLLM's hf_overrides head_dtype): the bf16 engine's lm_head sums and returns its
    logits in fp32 (the trainer's are fp32), where the default rounds them to bf16 (by up to half a bf16 step: 0.06
    for a logit of 30)."""
    seed = int(torch.randint(1 << 30, (1,)))
    default = engines("qwen3_moe", "bfloat16").llm.collective_rpc("moe_rl_head_logits", args=(seed,))[0]
    with start_engine(tiny_models["qwen3_moe"], "bfloat16", head_dtype="float32") as eng:
        fp32 = eng.llm.collective_rpc("moe_rl_head_logits", args=(seed,))[0]
    print(f"\nlogits (dtype, max error against the fp32 product, max |logit|): default {default}, fp32 head {fp32}")
    assert default[0] == "torch.bfloat16" and default[1] > 0
    assert fp32[0] == "torch.float32" and fp32[1] <= 1e-5 * fp32[2]
