"""Time the two fused kernels in kernels/ against their unfused torch references. Prints one JSON line.

Imports the kernels and moe_rl.objectives.corrections (torch only; no megatron or vLLM) from this
source tree, so it runs on a bare GPU machine with torch + Triton (moe_rl.kernels: installed, or the
moe_rl/kernels link bench/gpu_check.sh makes). On CUDA: compiled kernels, CUDA-event timing (warm-up, then
the median of --reps), bytes/s and FLOP/s against the H100 roofline (3 TB/s HBM, 990 TFLOP/s
bf16 dense). On CPU: the torch backends at small sizes, wall-clock timing, roofline fields null.

  gspo_loss       fused_gspo_loss (IcePop weights as token weights, as the product passes them; fp32,
                  packed) vs gspo_loss_reference (autograd); bytes model 28 B/token forward,
                  40 B/token forward + backward.
  linear_logprob  fused_linear_logprob (its default, token-chunked torch backend; on CUDA also its
                  Triton kernel, "triton") vs linear_logprob_reference (full [N, V] logits);
                  FLOPs 2NVD forward, 8NVD forward + backward (the backward recomputes the logits),
                  peak memory per variant, max |delta| vs the reference and vs fp64 on <= 1024 tokens.

A variant that does not fit is reported as {"oom": true}; any other failure as {"error": ...}
(exit status 1). Each measurement stops adding repetitions after --budget-s seconds.

  python bench/kernels.py                                  # CUDA: 64 x 4096 tokens; N=16384 V=151936 D=1024
  python bench/kernels.py --tokens 4096 --vocab 32768      # smaller log-prob problem
  python bench/kernels.py --gspo-seqs 256 --gspo-len 2048 --skip-reference --reps 20
  CUDA_VISIBLE_DEVICES= python bench/kernels.py            # CPU: 8 x 512 tokens; N=512 V=32768 D=256
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# The kernels are imported by main(), not here: run from bench/, this file is itself the module
# `kernels` to any `import kernels` (transformers probes for the Hugging Face package of that name),
# and must then import nothing that fails.
fused_gspo_loss = gspo_loss_reference = fused_linear_logprob = linear_logprob_reference = icepop_weights = None


def _import_kernels() -> None:
    """The kernels from this source tree (the repo root goes first on sys.path: bench/ is sys.path[0]), and the
    IcePop weights the product passes to the GSPO kernel."""
    global fused_gspo_loss, gspo_loss_reference, fused_linear_logprob, linear_logprob_reference, icepop_weights
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels.gspo_loss import fused_gspo_loss, gspo_loss_reference
    from kernels.linear_logprob import fused_linear_logprob, linear_logprob_reference
    from moe_rl.objectives.corrections import icepop_weights


try:
    import triton

    TRITON_VERSION: str | None = triton.__version__
except ImportError:  # the CPU path does not need it
    TRITON_VERSION = None

HBM_BYTES_PER_S = 3e12  # H100 HBM3, rounded down
BF16_DENSE_FLOPS = 990e12  # H100 SXM bf16 dense tensor core
GSPO_BYTES_FWD, GSPO_BYTES_FWD_BWD = 28, 40  # per token, fp32 (see docs/performance.md)
TRUTH_TOKENS = 1024  # tokens checked against an fp64 log-softmax


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], reps: int, warmup: int, budget_s: float, cuda: bool) -> dict:
    """Median seconds of `fn` after warm-up (which also absorbs Triton compilation).

    CUDA events time device work; both loops stop early once `budget_s` has passed so one slow
    kernel cannot eat a whole device session, but at least one timed call always runs."""
    t_start = time.perf_counter()
    for _ in range(warmup):
        fn()
        _sync(cuda)
        if time.perf_counter() - t_start > budget_s:
            break
    times: list[float] = []
    t_start = time.perf_counter()
    for _ in range(max(1, reps)):
        if cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            fn()
            ev1.record()
            ev1.synchronize()
            times.append(ev0.elapsed_time(ev1) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if time.perf_counter() - t_start > budget_s:
            break
    return {"seconds": statistics.median(times), "reps": len(times)}


def _is_oom(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in msg or "can't allocate" in msg


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: a scale-free gradient check (bf16 grads are ~1e-2 relative)."""
    return _max_abs(a, b) / max(b.double().abs().max().item(), 1e-30)


# ---- GSPO loss --------------------------------------------------------------------------------


def gspo_inputs(seqs: int, length: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Packed batch that runs every branch: every other sequence gets a log-ratio offset of
    1e-3 * sign(A) (outside the 3e-4 / 4e-4 clip range, so it clips), the rest stay inside it,
    and rollout noise makes IcePop zero about 1% of tokens. The IcePop weights are computed here,
    once, outside the timed calls (as the product computes them before the loss)."""
    g = torch.Generator().manual_seed(0)
    n = seqs * length
    adv = torch.randn(seqs, generator=g)
    old = -3.0 * torch.rand(n, generator=g)
    inside = 1e-4 * (2 * torch.rand(seqs, generator=g) - 1)
    seq_offset = torch.where(torch.arange(seqs) % 2 == 0, 1e-3 * adv.sign(), inside)
    logp = old + seq_offset.repeat_interleave(length) + 1e-3 * torch.randn(n, generator=g)
    roll = old + 0.3 * torch.randn(n, generator=g)
    mask = (torch.rand(n, generator=g) > 0.2).float()  # fp32 so the kernel wrapper does not cast
    cu = torch.arange(0, n + 1, length, dtype=torch.int64)
    weights = icepop_weights(old, roll, mask)
    t = dict(logp=logp, old_logp=old, token_weights=weights, loss_mask=mask, advantages=adv, cu_seqlens=cu)
    t = {k: v.to(device) for k, v in t.items()}
    t["logp"].requires_grad_(True)
    return t


def bench_gspo(seqs: int, length: int, reps: int, warmup: int, budget_s: float, skip_ref: bool, cuda: bool) -> dict:
    """Fused (Triton on CUDA, torch on CPU) vs the autograd reference: time, bytes/s and max |delta|."""
    device = torch.device("cuda" if cuda else "cpu")
    x = gspo_inputs(seqs, length, device)
    n = seqs * length
    out: dict = {"tokens": n, "seqs": seqs, "len": length, "correction": "icepop", "dtype": "float32"}

    def fused():
        return fused_gspo_loss(**x, use_triton=cuda)

    def reference():
        return gspo_loss_reference(**x)

    def run(fn: Callable, name: str) -> dict:
        try:
            fwd = time_call(lambda: fn()[0], reps, warmup, budget_s, cuda)
            fwd_bwd = time_call(lambda: torch.autograd.grad(fn()[0], x["logp"]), reps, warmup, budget_s, cuda)
        except Exception as e:  # reported in the JSON instead of losing the run
            return {"oom": True} if _is_oom(e) else {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            _free(cuda)
        r = {"seconds_fwd": fwd["seconds"], "seconds_fwd_bwd": fwd_bwd["seconds"], "reps": fwd_bwd["reps"]}
        if name == "fused":
            bytes_fwd, bytes_all = GSPO_BYTES_FWD * n, GSPO_BYTES_FWD_BWD * n
            bps = bytes_all / fwd_bwd["seconds"]
            r |= {
                "bytes_moved_fwd": bytes_fwd,
                "bytes_moved": bytes_all,
                "achieved_bytes_per_s_fwd": bytes_fwd / fwd["seconds"],
                "achieved_bytes_per_s": bps,
                "roofline_bytes_per_s": HBM_BYTES_PER_S if cuda else None,
                "roofline_fraction": bps / HBM_BYTES_PER_S if cuda else None,
            }
        return r

    out |= run(fused, "fused")
    # Correctness always (cheap at these sizes), so a wrong kernel shows even with --skip-reference.
    try:
        lf, mf = fused()
        (gf,) = torch.autograd.grad(lf, x["logp"])
        lr, mr = reference()
        (gr,) = torch.autograd.grad(lr, x["logp"])
        out["loss"] = lf.item()
        out["max_abs_delta_loss"] = _max_abs(lf.detach(), lr.detach())
        out["max_abs_delta_grad"] = _max_abs(gf, gr)
        out["max_abs_delta_metrics"] = max(_max_abs(mf[k], mr[k]) for k in mr)
        out["metrics"] = {k: v.item() for k, v in mf.items()}
    except Exception as e:  # reported in the JSON
        out["check_error"] = f"{type(e).__name__}: {e}"[:500]
    if not cuda:
        out["note"] = "CPU: use_triton=False runs the torch reference, so fused == reference here"
    if not skip_ref:
        ref = run(reference, "reference")
        out["reference"] = ref
        if "seconds_fwd_bwd" in ref and "seconds_fwd_bwd" in out:
            out["speedup_fwd"] = ref["seconds_fwd"] / out["seconds_fwd"]
            out["speedup_fwd_bwd"] = ref["seconds_fwd_bwd"] / out["seconds_fwd_bwd"]
    return out


# ---- fused linear -> log-prob -----------------------------------------------------------------


def _fp64_logp(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ground truth on a token subset: the bf16 reference rounds its logits to bf16, so a
    fused-vs-reference delta alone cannot tell kernel error from reference rounding."""
    lp_all = torch.log_softmax(h.double() @ w.double().t(), dim=-1)
    return lp_all.gather(-1, y[:, None])[:, 0], -(lp_all.exp() * lp_all).sum(-1)


def bench_linear_logprob(
    n: int, v: int, d: int, dtype: torch.dtype, reps: int, warmup: int, budget_s: float, skip_ref: bool, cuda: bool
) -> dict:
    """Fused (token-chunked torch; on CUDA also Triton) vs full logits: time, FLOP/s, peak memory, |delta|."""
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    h = torch.randn(n, d, device=device).to(dtype).requires_grad_(True)
    w = (torch.randn(v, d, device=device) * (2.0 / d**0.5)).to(dtype).requires_grad_(True)  # logits std ~ 2
    y = torch.randint(0, v, (n,), device=device)
    out: dict = {"N": n, "V": v, "D": d, "dtype": str(dtype).removeprefix("torch.")}
    k = min(n, TRUTH_TOKENS)
    truth_lp, truth_ent = _fp64_logp(h.detach()[:k], w.detach(), y[:k])
    fwd_flops = 2 * n * v * d
    bwd_flops = {"fused": 6 * n * v * d, "triton": 6 * n * v * d, "reference": 4 * n * v * d}
    variants = {"fused": lambda: fused_linear_logprob(h, w, y)}  # the default: token-chunked torch backend
    if cuda:  # the Triton kernel beside it
        variants["triton"] = lambda: fused_linear_logprob(h, w, y, backend="triton")
    variants["reference"] = lambda: linear_logprob_reference(h, w, y)
    results: dict[str, torch.Tensor] = {}
    for name, fn in variants.items():
        if name == "reference" and skip_ref:
            continue
        last: dict[str, torch.Tensor] = {}

        def fwd_bwd(fn=fn, last=last):
            lp, ent = fn()
            dh, dw = torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
            last.update(lp=lp.detach(), ent=ent.detach(), dh=dh, dw=dw)

        r: dict = {}
        try:
            _free(cuda)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            fwd = time_call(fn, reps, warmup, budget_s, cuda)
            both = time_call(fwd_bwd, reps, warmup, budget_s, cuda)
            if cuda:
                r["max_memory_allocated"] = torch.cuda.max_memory_allocated()
                r["peak_extra_bytes"] = r["max_memory_allocated"] - base
            flops = fwd_flops + bwd_flops[name]
            r |= {
                "seconds_fwd": fwd["seconds"],
                "seconds_fwd_bwd": both["seconds"],
                "reps": both["reps"],
                "flops_fwd": fwd_flops,
                "flops_fwd_bwd": flops,
                "tflops_fwd": fwd_flops / fwd["seconds"] / 1e12,
                "tflops_fwd_bwd": flops / both["seconds"] / 1e12,
                "roofline_fraction_fwd": fwd_flops / fwd["seconds"] / BF16_DENSE_FLOPS if cuda else None,
                "roofline_fraction": flops / both["seconds"] / BF16_DENSE_FLOPS if cuda else None,
                "max_abs_err_logp_vs_fp64": _max_abs(last["lp"][:k], truth_lp),
                "max_abs_err_entropy_vs_fp64": _max_abs(last["ent"][:k], truth_ent),
            }
            results[name] = {key: t.cpu() for key, t in last.items()}  # off the GPU: next variant's peak is its own
        except Exception as e:  # reported in the JSON instead of losing the run
            r = {"oom": True} if _is_oom(e) else {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            last.clear()
            _free(cuda)
        if name == "fused":
            out |= r
        else:
            out[name] = r
    out["truth_tokens"] = k
    out["flops_note"] = "fused bwd recomputes logits (6NVD); reference bwd reuses them (4NVD)"
    if "fused" in results and "reference" in results:
        f, r = results["fused"], results["reference"]
        out["max_abs_delta_logp"] = _max_abs(f["lp"], r["lp"])
        out["max_abs_delta_entropy"] = _max_abs(f["ent"], r["ent"])
        out["max_rel_delta_dhidden"] = _max_rel(f["dh"], r["dh"])
        out["max_rel_delta_dweight"] = _max_rel(f["dw"], r["dw"])
        out["speedup_fwd"] = out["reference"]["seconds_fwd"] / out["seconds_fwd"]
        out["speedup_fwd_bwd"] = out["reference"]["seconds_fwd_bwd"] / out["seconds_fwd_bwd"]
        if cuda:
            out["memory_ratio"] = out["peak_extra_bytes"] / out["reference"]["peak_extra_bytes"]
            if "triton" in results:
                t = out["triton"]
                t["speedup_fwd_bwd_vs_fused"] = out["seconds_fwd_bwd"] / t["seconds_fwd_bwd"]
                t["max_abs_delta_logp"] = _max_abs(results["triton"]["lp"], r["lp"])
                t["max_rel_delta_dweight"] = _max_rel(results["triton"]["dw"], r["dw"])
    return out


def _has_error(d: object) -> bool:
    if isinstance(d, dict):
        return any(k in ("error", "check_error") or _has_error(v) for k, v in d.items())
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gspo-seqs", type=int, help="packed sequences (CUDA 64, CPU 8)")
    p.add_argument("--gspo-len", type=int, help="tokens per sequence (CUDA 4096, CPU 512)")
    p.add_argument("--tokens", type=int, help="log-prob N (CUDA 16384, CPU 512)")
    p.add_argument("--vocab", type=int, help="log-prob V (CUDA 151936, CPU 32768)")
    p.add_argument("--hidden", type=int, help="log-prob D (CUDA 1024, CPU 256)")
    p.add_argument(
        "--dtype", choices=["auto", "bf16", "fp32"], default="auto", help="log-prob inputs (CUDA bf16, CPU fp32)"
    )
    p.add_argument("--reps", type=int, help="timed repetitions, median reported (CUDA 10, CPU 3)")
    p.add_argument("--warmup", type=int, help="untimed calls first (CUDA 2, CPU 1)")
    p.add_argument("--budget-s", type=float, default=60.0, help="stop adding repetitions after this (per measurement)")
    p.add_argument("--skip-reference", action="store_true", help="time only the fused kernels (still checked)")
    p.add_argument("--only", choices=["gspo", "logprob"], help="run one of the two sections")
    a = p.parse_args()
    _import_kernels()

    cuda = torch.cuda.is_available()
    big = {"gspo_seqs": 64, "gspo_len": 4096, "tokens": 16384, "vocab": 151_936, "hidden": 1024, "reps": 10}
    small = {"gspo_seqs": 8, "gspo_len": 512, "tokens": 512, "vocab": 32_768, "hidden": 256, "reps": 3}
    for key, default in (big if cuda else small).items():
        if getattr(a, key) is None:
            setattr(a, key, default)
    if a.warmup is None:
        a.warmup = 2 if cuda else 1
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(a.dtype, torch.bfloat16 if cuda else torch.float32)

    res: dict = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": TRITON_VERSION,
        "threads": torch.get_num_threads(),
        "reps": a.reps,
        "warmup": a.warmup,
    }
    if a.only in (None, "gspo"):
        res["gspo_loss"] = bench_gspo(a.gspo_seqs, a.gspo_len, a.reps, a.warmup, a.budget_s, a.skip_reference, cuda)
    if a.only in (None, "logprob"):
        res["linear_logprob"] = bench_linear_logprob(
            a.tokens, a.vocab, a.hidden, dtype, a.reps, a.warmup, a.budget_s, a.skip_reference, cuda
        )
    print(json.dumps(res))
    return 1 if _has_error(res) else 0


if __name__ == "__main__":
    sys.exit(main())
