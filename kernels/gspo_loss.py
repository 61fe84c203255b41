"""Fused GSPO loss with IcePop / TIS token weights over packed sequences (cu_seqlens).

Inputs are 1-D over the N packed tokens; sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1].
One Triton program per sequence: the forward reads each token twice (sequence ratio, then
loss and metrics) and writes only per-sequence partials; the backward reads each token once
and writes its gradient. The `[N]` per-token loss is never stored.

Math (same as `moe_rl.objectives.gspo_loss` + `icepop_weights` / `tis_weights`):
  log s_i = sum_t m (logp - old) / sum_t m,  s_i = exp(min(log s_i, 10))
  w_t     = icepop: k_t if low <= k_t <= high else 0 | tis: min(k_t, cap) | none: 1,  k_t = exp(old - rollout)
            | weights: given per token (any correction computed beforehand, e.g. sequence-level TIS)
  pg_t    = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)) * w_t * m_t
  loss    = sum_i c_i sum_t pg_t   with c_i from the aggregation mode (`aggregation.sequence_coefficients`,
            shared with moe_rl.objectives; global `num_tokens` / `num_seqs` make it a drop-in under DP)
  dloss/dlogp_t = c_i * w_t * m_t * (-A_i s_i) * [unclipped] * [log s_i <= 10]
"""

from __future__ import annotations

import math

import torch

from .aggregation import sequence_coefficients

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a CPU/GPU extra
    HAVE_TRITON = False

CORRECTION_IDS = {"none": 0, "icepop": 1, "tis": 2, "weights": 3}
METRIC_NAMES = ("clipfrac", "ppo_kl", "correction_zeroed_fraction", "weight_mean", "seq_ratio_mean")
MAX_LOG_RATIO = 10.0


# ---- pure-torch reference (segment ops; runs on any device) ------------------------------


def _segments(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=n)


def _token_weights(old, roll, correction: str, low: float, high: float, cap: float) -> torch.Tensor:
    """Per-token weights; under correction="weights" `roll` holds them."""
    if correction == "none":
        return torch.ones_like(old)
    if correction == "weights":
        return roll.detach()
    log_k = (old - roll).detach()
    if correction == "icepop":
        keep = (log_k >= math.log(low)) & (log_k <= math.log(high))
        return torch.where(keep, log_k.clamp(max=math.log(high)).exp(), torch.zeros_like(log_k))
    if correction == "tis":
        return log_k.clamp(max=math.log(cap)).exp()
    raise ValueError(f"unknown correction {correction!r}; fused kernel supports {sorted(CORRECTION_IDS)}")


def gspo_loss_reference(
    logp,
    old_logp,
    advantages,
    loss_mask,
    cu_seqlens,
    rollout_logp=None,
    correction="icepop",
    clip_low=3e-4,
    clip_high=4e-4,
    low=0.5,
    high=5.0,
    cap=2.0,
    agg="seq-mean-token-mean",
    horizon=None,
    num_tokens=None,
    num_seqs=None,
    token_weights=None,
):
    """Packed-sequence GSPO in plain torch (autograd). Returns (loss, metrics)."""
    n, s = logp.shape[0], cu_seqlens.numel() - 1
    seg = _segments(cu_seqlens, n)
    m = loss_mask.to(logp.dtype)
    ntok = torch.zeros(s, dtype=logp.dtype, device=logp.device).index_add_(0, seg, m)
    seq_lr = torch.zeros_like(ntok).index_add_(0, seg, (logp - old_logp).detach() * m) / ntok.clamp(min=1)
    log_s = seq_lr[seg] + logp - logp.detach()
    sv = log_s.clamp(max=MAX_LOG_RATIO).exp()
    adv = advantages.to(logp.dtype)[seg]
    pg1 = -adv * sv
    pg2 = -adv * sv.clamp(1 - clip_low, 1 + clip_high)
    w = _token_weights(old_logp, _correction_input(correction, rollout_logp, token_weights), correction, low, high, cap)
    pg = torch.maximum(pg1, pg2) * w * m
    seq_sum = torch.zeros_like(ntok).index_add(0, seg, pg)
    coef = sequence_coefficients(ntok.detach(), agg, num_tokens, num_seqs, horizon)
    loss = (coef.to(logp.dtype) * seq_sum).sum()
    tot = m.sum().clamp(min=1)
    with torch.no_grad():
        has = (ntok > 0).to(m.dtype)
        metrics = {
            "clipfrac": ((pg2 > pg1).to(m.dtype) * m).sum() / tot,
            "ppo_kl": ((old_logp - logp) * m).sum() / tot,
            "correction_zeroed_fraction": ((w == 0).to(m.dtype) * m).sum() / tot,
            "weight_mean": (w * m).sum() / tot,
            "seq_ratio_mean": (seq_lr.exp() * has).sum() / has.sum().clamp(min=1),
        }
    return loss, metrics


def _correction_input(correction: str, rollout_logp, token_weights):
    """The per-token tensor the correction reads: log mu (icepop, tis) or the weights themselves."""
    if correction == "weights":
        if token_weights is None:
            raise ValueError('correction="weights" needs token_weights')
        return token_weights
    if correction != "none" and rollout_logp is None:
        raise ValueError(f"correction={correction!r} needs rollout_logp")
    return rollout_logp


# ---- Triton ------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _token_weight(od, ROLL, offs, inb, log_low, log_high, log_cap, CORRECTION: tl.constexpr, BLOCK: tl.constexpr):
        """IcePop (1) / TIS (2) / none (0) weight of each token in the block, from log k = old - rollout,
        or the given weight (3, `ROLL` holds the weights).

        `od` holds the block's old log-probs, already loaded by the caller."""
        if CORRECTION == 0:
            w = tl.full([BLOCK], 1.0, tl.float32)
        elif CORRECTION == 3:
            w = tl.load(ROLL + offs, mask=inb, other=0.0).to(tl.float32)
        else:
            rl = tl.load(ROLL + offs, mask=inb, other=0.0).to(tl.float32)
            log_k = od - rl
            if CORRECTION == 1:
                keep = (log_k >= log_low) & (log_k <= log_high)
                w = tl.where(keep, tl.exp(tl.minimum(log_k, log_high)), 0.0)
            else:
                w = tl.exp(tl.minimum(log_k, log_cap))
        return w

    @triton.jit
    def _gspo_fwd_kernel(
        LOGP,
        OLD,
        ROLL,
        MASK,
        ADV,
        CU,
        SEQ_LR,
        SEQ_OUT,
        clip_low,
        clip_high,
        log_low,
        log_high,
        log_cap,
        CORRECTION: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        start = tl.load(CU + i)
        end = tl.load(CU + i + 1)
        offs0 = tl.arange(0, BLOCK)
        # pass 1: sequence log-ratio
        acc_lr = tl.zeros([BLOCK], dtype=tl.float32)
        acc_n = tl.zeros([BLOCK], dtype=tl.float32)
        for b in range(start, end, BLOCK):
            offs = b + offs0
            inb = offs < end
            m = tl.load(MASK + offs, mask=inb, other=0).to(tl.float32)
            lp = tl.load(LOGP + offs, mask=inb, other=0.0).to(tl.float32)
            od = tl.load(OLD + offs, mask=inb, other=0.0).to(tl.float32)
            acc_lr += (lp - od) * m
            acc_n += m
        n = tl.sum(acc_n, axis=0)
        seq_lr = tl.sum(acc_lr, axis=0) / tl.maximum(n, 1.0)
        s = tl.exp(tl.minimum(seq_lr, 10.0))
        a = tl.load(ADV + i).to(tl.float32)
        pg1 = -a * s
        pg2 = -a * tl.minimum(tl.maximum(s, 1.0 - clip_low), 1.0 + clip_high)
        pg = tl.maximum(pg1, pg2)
        clipped = (pg2 > pg1).to(tl.float32)
        # pass 2: weights, loss and metrics
        acc_pg = tl.zeros([BLOCK], dtype=tl.float32)
        acc_kl = tl.zeros([BLOCK], dtype=tl.float32)
        acc_zero = tl.zeros([BLOCK], dtype=tl.float32)
        acc_w = tl.zeros([BLOCK], dtype=tl.float32)
        for b in range(start, end, BLOCK):
            offs = b + offs0
            inb = offs < end
            m = tl.load(MASK + offs, mask=inb, other=0).to(tl.float32)
            lp = tl.load(LOGP + offs, mask=inb, other=0.0).to(tl.float32)
            od = tl.load(OLD + offs, mask=inb, other=0.0).to(tl.float32)
            w = _token_weight(od, ROLL, offs, inb, log_low, log_high, log_cap, CORRECTION, BLOCK)
            acc_pg += pg * w * m
            acc_kl += (od - lp) * m
            acc_zero += (w == 0.0).to(tl.float32) * m
            acc_w += w * m
        tl.store(SEQ_LR + i, seq_lr)
        tl.store(SEQ_OUT + i * 6 + 0, tl.sum(acc_pg, axis=0))
        tl.store(SEQ_OUT + i * 6 + 1, n)
        tl.store(SEQ_OUT + i * 6 + 2, clipped * n)
        tl.store(SEQ_OUT + i * 6 + 3, tl.sum(acc_kl, axis=0))
        tl.store(SEQ_OUT + i * 6 + 4, tl.sum(acc_zero, axis=0))
        tl.store(SEQ_OUT + i * 6 + 5, tl.sum(acc_w, axis=0))

    @triton.jit
    def _gspo_bwd_kernel(
        GRAD,
        OLD,
        ROLL,
        MASK,
        ADV,
        CU,
        SEQ_LR,
        COEF,
        clip_low,
        clip_high,
        log_low,
        log_high,
        log_cap,
        CORRECTION: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        start = tl.load(CU + i)
        end = tl.load(CU + i + 1)
        seq_lr = tl.load(SEQ_LR + i)
        s = tl.exp(tl.minimum(seq_lr, 10.0))
        a = tl.load(ADV + i).to(tl.float32)
        pg1 = -a * s
        pg2 = -a * tl.minimum(tl.maximum(s, 1.0 - clip_low), 1.0 + clip_high)
        live = (pg1 >= pg2) & (seq_lr <= 10.0)
        g_seq = tl.load(COEF + i) * tl.where(live, -a * s, 0.0)
        offs0 = tl.arange(0, BLOCK)
        for b in range(start, end, BLOCK):
            offs = b + offs0
            inb = offs < end
            m = tl.load(MASK + offs, mask=inb, other=0).to(tl.float32)
            od = tl.load(OLD + offs, mask=inb, other=0.0).to(tl.float32)
            w = _token_weight(od, ROLL, offs, inb, log_low, log_high, log_cap, CORRECTION, BLOCK)
            tl.store(GRAD + offs, g_seq * w * m, mask=inb)

    class _FusedGSPO(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logp, old, roll, mask, adv, cu, params, correction, agg, horizon, counts, block):
            s = cu.numel() - 1
            seq_lr = torch.empty(s, dtype=torch.float32, device=logp.device)
            out = torch.empty(s, 6, dtype=torch.float32, device=logp.device)
            cid = CORRECTION_IDS[correction]
            roll_ = roll if roll is not None else old
            _gspo_fwd_kernel[(s,)](logp, old, roll_, mask, adv, cu, seq_lr, out, *params, CORRECTION=cid, BLOCK=block)
            coef = sequence_coefficients(out[:, 1], agg, *counts, horizon)
            loss = (coef * out[:, 0]).sum()
            ctx.save_for_backward(old, roll_, mask, adv, cu, seq_lr, coef)
            ctx.params, ctx.cid, ctx.block, ctx.logp_dtype = params, cid, block, logp.dtype
            tot = out[:, 1].sum().clamp(min=1)
            has = (out[:, 1] > 0).to(torch.float32)
            metrics = torch.stack(
                [
                    out[:, 2].sum() / tot,
                    out[:, 3].sum() / tot,
                    out[:, 4].sum() / tot,
                    out[:, 5].sum() / tot,
                    (seq_lr.exp() * has).sum() / has.sum().clamp(min=1),
                ]
            )
            ctx.mark_non_differentiable(metrics)
            return loss.to(logp.dtype), metrics

        @staticmethod
        def backward(ctx, grad_loss, _grad_metrics):
            old, roll, mask, adv, cu, seq_lr, coef = ctx.saved_tensors
            grad = torch.empty(old.shape[0], dtype=torch.float32, device=old.device)
            _gspo_bwd_kernel[(cu.numel() - 1,)](
                grad,
                old,
                roll,
                mask,
                adv,
                cu,
                seq_lr,
                coef * grad_loss.float(),
                *ctx.params,
                CORRECTION=ctx.cid,
                BLOCK=ctx.block,
            )
            return grad.to(ctx.logp_dtype), *([None] * 11)


def _use_triton(t: torch.Tensor, force: bool | None) -> bool:
    import os

    if force is not None:
        if force and not HAVE_TRITON:
            raise RuntimeError("triton is not installed")
        return force
    return HAVE_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def fused_gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rollout_logp: torch.Tensor | None = None,
    correction: str = "icepop",
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    low: float = 0.5,
    high: float = 5.0,
    cap: float = 2.0,
    agg: str = "seq-mean-token-mean",
    horizon: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    token_weights: torch.Tensor | None = None,
    use_triton: bool | None = None,
    block: int = 256,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss (+ IcePop/TIS or given token weights) and its metrics over packed sequences.

    logp, old_logp, rollout_logp, token_weights, loss_mask: [N]; advantages: [S];
    cu_seqlens: [S + 1] int. `num_tokens` / `num_seqs`: the global counts the aggregation divides
    by (default: this call's). Triton on CUDA (or under TRITON_INTERPRET=1); the torch
    reference otherwise. Gradient flows to `logp` only; metrics are means over this call's tokens.
    """
    n = logp.shape[0]
    if logp.dim() != 1 or old_logp.shape != logp.shape or loss_mask.shape != logp.shape:
        raise ValueError(
            f"packed inputs must be 1-D of one length: logp {tuple(logp.shape)}, "
            f"old_logp {tuple(old_logp.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    for name, x in (("rollout_logp", rollout_logp), ("token_weights", token_weights)):
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} {tuple(x.shape)} != logp {tuple(logp.shape)}")
    if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at N={n}; got {cu_seqlens.tolist()[:8]}...")
    if advantages.shape != (cu_seqlens.numel() - 1,):
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must have one entry per sequence ({cu_seqlens.numel() - 1})"
        )
    if correction not in CORRECTION_IDS:
        raise ValueError(f"unknown correction {correction!r}; fused kernel supports {sorted(CORRECTION_IDS)}")
    source = _correction_input(correction, rollout_logp, token_weights)
    if not _use_triton(logp, use_triton):
        return gspo_loss_reference(
            logp,
            old_logp,
            advantages,
            loss_mask,
            cu_seqlens,
            rollout_logp,
            correction,
            clip_low,
            clip_high,
            low,
            high,
            cap,
            agg,
            horizon,
            num_tokens,
            num_seqs,
            token_weights,
        )
    sequence_coefficients(torch.ones(1), agg, num_tokens, num_seqs, horizon)  # validate agg before launching
    params = (clip_low, clip_high, math.log(low), math.log(high), math.log(cap))
    roll = None if source is None else source.detach().to(torch.float32).contiguous()
    loss, m = _FusedGSPO.apply(
        logp.contiguous(),
        old_logp.detach().contiguous(),
        roll,
        loss_mask.to(logp.dtype).contiguous(),
        advantages.detach().to(torch.float32).contiguous(),
        cu_seqlens.to(torch.int64).contiguous(),
        params,
        correction,
        agg,
        horizon,
        (num_tokens, num_seqs),
        block,
    )
    return loss, dict(zip(METRIC_NAMES, m.unbind(0), strict=True))
