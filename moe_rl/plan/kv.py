"""KV-cache bytes per token of a vLLM engine worker, from the config alone.

vLLM sizes one KV block of a layer as its attention spec's `page_size_bytes` (vllm/v1/kv_cache_interface.py):
  FullAttentionSpec (GQA):  2 (K and V) x block_size x num_kv_heads x head_size x dtype bytes, with
                            num_kv_heads = max(1, total KV heads // TP) (ModelConfig.get_num_kv_heads);
  MLAAttentionSpec (MLA):   block_size x 1 x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, the same on
                            every TP rank (one latent per token; get_num_kv_heads is 1 under MLA).
Per token and worker: page_size_bytes / block_size summed over the attention layers (every decoder layer; the MTP
layers get no cache without speculative decoding). The cache dtype is the engine dtype (kv_cache_dtype=auto).
tests/unit/test_plan.py compares this with vLLM's own ModelConfig and spec classes for every preset.
"""

from __future__ import annotations

from moe_rl.common.errors import ConfigError
from moe_rl.plan.spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
VLLM_DTYPES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}  # the names vLLM's dtype takes


def engine_dtype_bytes(dtype: str) -> int:
    """Bytes per element of the engine's rollout.dtype, by any name vLLM takes but `auto` (which the plan cannot
    resolve without the weights' dtype)."""
    if str(dtype) not in VLLM_DTYPES:
        raise ConfigError(f"config rollout.dtype: {dtype!r}: name one of {sorted(VLLM_DTYPES)} to plan with")
    return VLLM_DTYPES[str(dtype)]


def kv_bytes_per_token(spec: ModelSpec, tensor_parallel_size: int, dtype: str) -> int:
    """KV-cache bytes one token takes on one engine worker (all layers)."""
    size = engine_dtype_bytes(dtype)
    if spec.mla:
        per_layer = (spec.kv_lora_rank + spec.qk_rope_head_dim) * size
    else:
        per_layer = 2 * max(1, spec.num_kv_heads // tensor_parallel_size) * spec.head_dim * size
    return per_layer * spec.num_layers


KV_BLOCK_MARGIN = 256  # tokens per sequence for its last, partly filled KV block: vLLM's largest CPU block size


def cpu_kv_cache_gib(spec: ModelSpec, tensor_parallel_size: int, dtype: str, sequences: int, tokens: int) -> float:
    """rollout.kv_cache_gib for a CPU engine that holds at most `sequences` sequences of at most `tokens` tokens at
    once: every one at its longest, with one block of margin each (dtype auto: 4-byte elements, the most it
    resolves to)."""
    dtype = "float32" if str(dtype) == "auto" else str(dtype)
    return sequences * (tokens + KV_BLOCK_MARGIN) * kv_bytes_per_token(spec, tensor_parallel_size, dtype) / 2**30
