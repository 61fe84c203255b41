"""What a vLLM-CPU engine must do with new weights before it can use them, against a plain copy of the same bytes.
Prints one JSON line.

Why bench/weight_sync.py's `throughput_ratio` stays far below 0.5 on CPU, whatever the transport: vLLM-CPU's
kernels never read the weights as loaded. On x86 its experts run only on a prepacked copy
(`cpu_prepack_moe_weight`, in `CPUUnquantizedExperts.process_weights_after_loading`; no unpacked path but
zentorch's), and its linears on a oneDNN handle that owns a packed copy of the weight. So a sync cannot write into
the engine's weights in place: every sync ends with these packs, on the engine's cores.

Measured on one thread, best of --repeats, for one MoE layer of bench/weight_sync.py's model (fp32):
  copy_bytes_per_s      a plain copy of the [E, 2I, H] and [E, H, I] expert tensors
  prepack_bytes_per_s   vLLM's cpu_prepack_moe_weight of the same tensors
  prepack_ratio_cap     copy time / prepack time: the highest `throughput_ratio` a sync of experts alone could
                        reach if its bytes arrived for free and the prepack were the engine's only work
  onednn_handle_bytes_per_s  building the oneDNN handles of the dense [out, in] weights (qkv, o_proj)
  onednn_sees_in_place_write  whether a handle's output changes when its weight is overwritten in place

  python bench/engine_pack.py
  python bench/engine_pack.py --hidden 512 --moe-intermediate 1024    # weight_sync.py's 5x model
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--moe-intermediate", type=int, default=384)
    p.add_argument("--heads", type=int, default=4, help="attention heads of 64 dims (qkv and o_proj shapes)")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    import vllm._custom_ops as ops  # loads vLLM's CPU kernels (torch.ops._C)

    e, h, i = a.experts, a.hidden, a.moe_intermediate
    w13, w2 = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    expert_bytes = (w13.numel() + w2.numel()) * w13.element_size()
    d13, d2 = torch.empty_like(w13), torch.empty_like(w2)
    copy_s = best_seconds(lambda: (d13.copy_(w13), d2.copy_(w2)), a.repeats)
    pack_s = best_seconds(
        lambda: (ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec")), a.repeats
    )

    dense = [torch.randn(3 * a.heads * 64, h), torch.randn(h, a.heads * 64)]  # qkv (kv heads = heads), o_proj
    dense_bytes = sum(w.numel() * w.element_size() for w in dense)
    handle_s = best_seconds(lambda: [ops.create_onednn_mm(w.t(), 32) for w in dense], a.repeats)
    w = dense[1].clone()
    x = torch.randn(4, w.shape[1])  # [tokens, in]
    handle = ops.create_onednn_mm(w.t(), 32)
    before = ops.onednn_mm(handle, x, None)
    w.mul_(2.0)
    after = ops.onednn_mm(handle, x, None)
    print(
        json.dumps(
            {
                "expert_bytes": expert_bytes,
                "copy_bytes_per_s": expert_bytes / copy_s,
                "prepack_bytes_per_s": expert_bytes / pack_s,
                "prepack_ratio_cap": copy_s / pack_s,
                "dense_bytes": dense_bytes,
                "onednn_handle_bytes_per_s": dense_bytes / handle_s,
                "onednn_sees_in_place_write": not torch.equal(before, after),
            }
        )
    )


if __name__ == "__main__":
    main()
