"""Rollout benchmarks, printed as one JSON document:

1. generation tokens/s with route capture on vs off (same prompts, seeds, model; ratio), and each
   engine's start and first (warm-up) call, which pays one-time costs a step-1 rollout sees;
2. route bytes per token for a 48-layer, 128-expert, top-8 model: the uint8 record vs int32
   and base64(int32) transports;
3. weight-sync throughput (bucketed safetensors through the engine RPC, into the engine's
   weights) vs a plain in-process copy of the same bytes.

  python bench/rollout.py                     # ~2 minutes on 2 CPU cores
  python bench/rollout.py --prompts 32 --max-tokens 128
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # keep stdout for the JSON result


def route_bytes(layers: int = 48, experts: int = 128, topk: int = 8, tokens: int = 4096) -> dict:
    from moe_rl.routing.records import route_dtype

    rng = np.random.default_rng(0)
    ids = np.argsort(rng.random((tokens, layers, experts)), axis=-1)[..., :topk]
    record = ids.astype(route_dtype(experts))
    as_int32 = ids.astype("<i4").tobytes()
    as_b64 = base64.b64encode(as_int32)
    per_tok = {
        "uint8_record": record.nbytes / tokens,
        "int32": len(as_int32) / tokens,
        "base64_int32": len(as_b64) / tokens,
    }
    return {
        "layers": layers,
        "experts": experts,
        "topk": topk,
        "bytes_per_token": per_tok,
        "int32_over_record": per_tok["int32"] / per_tok["uint8_record"],
        "base64_over_record": per_tok["base64_int32"] / per_tok["uint8_record"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import torch
    from transformers import AutoConfig

    from moe_rl.actor.weights import HFCheckpoint
    from moe_rl.models.tiny import TinySpec, build_tiny_model
    from moe_rl.rollout.config import RolloutConfig, SamplingConfig
    from moe_rl.rollout.engine import RolloutEngine
    from moe_rl.routing.model_layout import moe_layout
    from moe_rl.weight_sync import push_weights

    tmp = Path(tempfile.mkdtemp(prefix="moe-rl-bench-"))
    spec = TinySpec(
        arch="qwen3_moe",
        num_experts=32,
        topk=4,
        layers=4,
        hidden=256,
        heads=4,
        kv_heads=2,
        head_dim=64,
        moe_intermediate=256,
        vocab_size=512,
    )
    path = build_tiny_model(spec, tmp / "model")
    lay = moe_layout(AutoConfig.from_pretrained(path))
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 500, (int(torch.randint(4, 32, (1,), generator=g)),), generator=g).tolist()
        for _ in range(a.prompts)
    ]
    sampling = SamplingConfig(n=a.n, max_tokens=a.max_tokens, seed=0)
    result: dict = {"model": spec.__dict__, "sampling": sampling.__dict__, "prompts": a.prompts}

    gen = {}
    for capture in ("none", "hook"):
        cfg = RolloutConfig(model=str(path), dtype="float32", capture=capture)
        t0 = time.perf_counter()
        with RolloutEngine(cfg, lay.moe_layers, lay.num_experts, lay.topk) as eng:
            start_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            eng.generate(prompts[:2], SamplingConfig(n=1, max_tokens=4))  # warm-up
            first_s = time.perf_counter() - t0
            best = float("inf")
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                batch = eng.generate(prompts, sampling)
                best = min(best, time.perf_counter() - t0)
            tokens = sum(len(r) for r in batch.response_ids)
            gen[capture] = {"seconds": best, "response_tokens": tokens, "tokens_per_s": tokens / best}
            gen[capture] |= {"engine_start_seconds": start_s, "first_call_seconds": first_s}
            if capture == "hook":
                ckpt = HFCheckpoint(path)
                named = [(k, ckpt.get(k)) for k in ckpt.weight_map]
                nbytes = sum(t.numel() * t.element_size() for _, t in named)
                sync = min((push_weights(eng, named) for _ in range(a.repeats)), key=lambda s: s["seconds"])
                t0 = time.perf_counter()
                for _ in range(a.repeats):
                    copies = [t.clone() for _, t in named]
                copy_s = (time.perf_counter() - t0) / a.repeats
                del copies
                result["weight_sync"] = {
                    "bytes": nbytes,
                    "tensors": len(named),
                    "buckets": sync["buckets"],
                    "sync_seconds": sync["seconds"],
                    "sync_gb_per_s": nbytes / sync["seconds"] / 1e9,
                    "plain_copy_seconds": copy_s,
                    "plain_copy_gb_per_s": nbytes / copy_s / 1e9,
                    "sync_over_copy_time": sync["seconds"] / copy_s,
                }
    result["generation"] = gen
    result["capture_overhead_ratio"] = gen["none"]["tokens_per_s"] / gen["hook"]["tokens_per_s"]
    result["route_transport"] = route_bytes()
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
