"""Fused GSPO loss with given token weights over packed sequences (cu_seqlens).

Inputs are 1-D over the N packed tokens; sequence i is tokens cu_seqlens[i]:cu_seqlens[i+1].
One Triton program per sequence: the forward reads each token twice (sequence ratio, then
loss and metrics) and writes only per-sequence partials; the backward reads each token once
and writes its gradient. The `[N]` per-token loss is never stored.

Math (same as `moe_rl.objectives.gspo_loss` with `weights`):
  log s_i = sum_t m (logp - old) / sum_t m,  s_i = exp(min(log s_i, 10))
  w_t     = token_weights[t], computed beforehand by the correction (`moe_rl.objectives.corrections`:
            IcePop, TIS, sequence-level TIS, ...); 1 when token_weights is None
  pg_t    = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high)) * w_t * m_t
  loss    = sum_i c_i sum_t pg_t   with c_i from the aggregation mode (`aggregation.sequence_coefficients`,
            shared with moe_rl.objectives; global `num_tokens` / `num_seqs` make it a drop-in under DP)
  dloss/dlogp_t = c_i * w_t * m_t * (-A_i s_i) * [unclipped] * [log s_i <= 10]
"""

from __future__ import annotations

import torch

from .aggregation import sequence_coefficients

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a CPU/GPU extra
    HAVE_TRITON = False

METRIC_NAMES = ("clipfrac", "ppo_kl", "correction_zeroed_fraction", "weight_mean", "seq_ratio_mean")
MAX_LOG_RATIO = 10.0


# ---- pure-torch reference (segment ops; runs on any device) ------------------------------


def _segments(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=n)


def gspo_loss_reference(
    logp,
    old_logp,
    advantages,
    loss_mask,
    cu_seqlens,
    *,
    token_weights=None,
    clip_low=3e-4,
    clip_high=4e-4,
    agg="seq-mean-token-mean",
    horizon=None,
    num_tokens=None,
    num_seqs=None,
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
    w = torch.ones_like(old_logp) if token_weights is None else token_weights.detach()
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


# ---- Triton ------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def _token_weight(W, offs, inb, HAS_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
        """The given weight of each token in the block, or 1 without weights (`W` then is any pointer, unread)."""
        if HAS_WEIGHTS:
            w = tl.load(W + offs, mask=inb, other=0.0).to(tl.float32)
        else:
            w = tl.full([BLOCK], 1.0, tl.float32)
        return w

    @triton.jit
    def _gspo_fwd_kernel(
        LOGP,
        OLD,
        W,
        MASK,
        ADV,
        CU,
        SEQ_LR,
        SEQ_OUT,
        clip_low,
        clip_high,
        HAS_WEIGHTS: tl.constexpr,
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
            w = _token_weight(W, offs, inb, HAS_WEIGHTS, BLOCK)
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
        W,
        MASK,
        ADV,
        CU,
        SEQ_LR,
        COEF,
        clip_low,
        clip_high,
        HAS_WEIGHTS: tl.constexpr,
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
            w = _token_weight(W, offs, inb, HAS_WEIGHTS, BLOCK)
            tl.store(GRAD + offs, g_seq * w * m, mask=inb)

    class _FusedGSPO(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logp, old, weights, mask, adv, cu, params, agg, horizon, counts, block):
            s = cu.numel() - 1
            seq_lr = torch.empty(s, dtype=torch.float32, device=logp.device)
            out = torch.empty(s, 6, dtype=torch.float32, device=logp.device)
            has_w = weights is not None
            w = weights if has_w else mask  # without weights the kernels read no W; any pointer will do
            _gspo_fwd_kernel[(s,)](logp, old, w, mask, adv, cu, seq_lr, out, *params, HAS_WEIGHTS=has_w, BLOCK=block)
            coef = sequence_coefficients(out[:, 1], agg, *counts, horizon)
            loss = (coef * out[:, 0]).sum()
            ctx.save_for_backward(w, mask, adv, cu, seq_lr, coef)
            ctx.params, ctx.has_w, ctx.block, ctx.logp_dtype = params, has_w, block, logp.dtype
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
            w, mask, adv, cu, seq_lr, coef = ctx.saved_tensors
            grad = torch.empty(mask.shape[0], dtype=torch.float32, device=mask.device)
            _gspo_bwd_kernel[(cu.numel() - 1,)](
                grad,
                w,
                mask,
                adv,
                cu,
                seq_lr,
                coef * grad_loss.float(),
                *ctx.params,
                HAS_WEIGHTS=ctx.has_w,
                BLOCK=ctx.block,
            )
            return grad.to(ctx.logp_dtype), *([None] * 10)


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
    *,
    token_weights: torch.Tensor | None = None,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    horizon: int | None = None,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    use_triton: bool | None = None,
    block: int = 256,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss (with the given token weights, none: 1) and its metrics over packed sequences.

    logp, old_logp, token_weights, loss_mask: [N]; advantages: [S]; cu_seqlens: [S + 1] int.
    `token_weights`: the correction's weights, computed beforehand (`moe_rl.objectives.corrections`);
    None: no reweighting. `num_tokens` / `num_seqs`: the global counts the aggregation divides
    by (default: this call's). Triton on CUDA (or under TRITON_INTERPRET=1); the torch
    reference otherwise. Gradient flows to `logp` only; metrics are means over this call's tokens.
    """
    n = logp.shape[0]
    if logp.dim() != 1 or old_logp.shape != logp.shape or loss_mask.shape != logp.shape:
        raise ValueError(
            f"packed inputs must be 1-D of one length: logp {tuple(logp.shape)}, "
            f"old_logp {tuple(old_logp.shape)}, loss_mask {tuple(loss_mask.shape)}"
        )
    if token_weights is not None and token_weights.shape != logp.shape:
        raise ValueError(f"token_weights {tuple(token_weights.shape)} != logp {tuple(logp.shape)}")
    if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != n:
        raise ValueError(f"cu_seqlens must start at 0 and end at N={n}; got {cu_seqlens.tolist()[:8]}...")
    if advantages.shape != (cu_seqlens.numel() - 1,):
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must have one entry per sequence ({cu_seqlens.numel() - 1})"
        )
    if not _use_triton(logp, use_triton):
        return gspo_loss_reference(
            logp,
            old_logp,
            advantages,
            loss_mask,
            cu_seqlens,
            token_weights=token_weights,
            clip_low=clip_low,
            clip_high=clip_high,
            agg=agg,
            horizon=horizon,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
    sequence_coefficients(torch.ones(1), agg, num_tokens, num_seqs, horizon)  # validate agg before launching
    weights = None if token_weights is None else token_weights.detach().to(torch.float32).contiguous()
    loss, m = _FusedGSPO.apply(
        logp.contiguous(),
        old_logp.detach().contiguous(),
        weights,
        loss_mask.to(logp.dtype).contiguous(),
        advantages.detach().to(torch.float32).contiguous(),
        cu_seqlens.to(torch.int64).contiguous(),
        (clip_low, clip_high),
        agg,
        horizon,
        (num_tokens, num_seqs),
        block,
    )
    return loss, dict(zip(METRIC_NAMES, m.unbind(0), strict=True))
