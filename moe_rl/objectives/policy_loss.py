"""Policy-gradient losses: sequence-level GSPO and token-level PPO.

Tensors are padded `[B, T]`; `mask` is 1 on response tokens; `advantages` is `[B]` (one per
sequence, broadcast) or `[B, T]`. `weights` (IcePop/TIS, `[B, T]`) multiply the per-token
loss and are treated as constants. Every loss returns `(loss, metrics)` with detached
0-d tensors in `metrics` (no host sync here).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from moe_rl.objectives.aggregation import aggregate, masked_mean
from moe_rl.objectives.config import GSPOConfig, PPOConfig
from moe_rl.objectives.registry import POLICY_LOSSES

MAX_LOG_RATIO = 10.0  # GSPO clamps log s_{i,t} at 10 (as verl) so exp() stays finite


def _broadcast_adv(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != like.shape[0]:
            raise ValueError(f"advantages has {advantages.shape[0]} rows, log-probs have {like.shape[0]}")
        return advantages[:, None].expand_as(like)
    if advantages.shape != like.shape:
        raise ValueError(f"advantages shape {tuple(advantages.shape)} != log-probs shape {tuple(like.shape)}")
    return advantages


def _check(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, "
            f"mask {tuple(mask.shape)} must all be [B, T]"
        )
    return mask.to(logp.dtype)


def _weighted_loss(pg, weights, mask, agg, agg_kwargs) -> torch.Tensor:
    """Per-token loss times the (constant) correction weights, aggregated."""
    if weights is not None:
        pg = pg * weights.detach()
    return aggregate(pg, mask, agg, **agg_kwargs)


@torch.no_grad()
def _ratio_metrics(pg1, pg2, logp, old_logp, mask) -> dict[str, torch.Tensor]:
    return {"clipfrac": masked_mean((pg2 > pg1).to(logp.dtype), mask), "ppo_kl": masked_mean(old_logp - logp, mask)}


def gspo_sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = sum_t mask (logp - old) / sum_t mask  ->  [B] (0 for an empty response)."""
    return masked_mean(logp - old_logp, mask, dim=-1)


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    weights: torch.Tensor | None = None,
    agg: str = "seq-mean-token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al., 2025), token form.

    log s_{i,t} = sg[log s_i] + logp_t - sg[logp_t]   (value s_i, gradient s_i * grad logp_t)
    loss_{i,t}  = max(-A_i s_{i,t}, -A_i clip(s_{i,t}, 1 - clip_low, 1 + clip_high)) * w_{i,t}
    With the default seq-mean-token-mean aggregation this equals the sequence form
    mean_i max(-A_i s_i, -A_i clip(s_i)) in value and gradient.
    """
    m = _check(logp, old_logp, mask)
    adv = _broadcast_adv(advantages, logp)
    seq_log_ratio = gspo_sequence_log_ratio(logp, old_logp, m)
    log_s = seq_log_ratio.detach()[:, None] + logp - logp.detach()
    log_s = log_s.clamp(max=MAX_LOG_RATIO)
    s = log_s.exp()
    pg1 = -adv * s
    pg2 = -adv * s.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    loss = _weighted_loss(pg, weights, m, agg, agg_kwargs)
    metrics = _ratio_metrics(pg1, pg2, logp, old_logp, m)
    metrics["seq_ratio_mean"] = masked_mean(seq_log_ratio.exp(), (m.sum(-1) > 0).to(logp.dtype)).detach()
    return loss, metrics


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
    agg: str = "token-mean",
    **agg_kwargs,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped PPO; `dual_clip=c` (> 1) bounds the loss at -A*c for A < 0 (Ye et al., 2020).

    r_t = exp(logp_t - old_t) (log-ratio clamped to +-20), loss = max(-A r, -A clip(r, 1-l, 1+h)).
    """
    m = _check(logp, old_logp, mask)
    adv = _broadcast_adv(advantages, logp)
    log_r = (logp - old_logp).clamp(-20.0, 20.0)
    r = log_r.exp()
    pg1 = -adv * r
    pg2 = -adv * r.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg1, pg2)
    dual_frac = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip={dual_clip} must be > 1")
        pg3 = -adv * dual_clip
        use3 = (adv < 0) & (pg3 < pg)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
        dual_frac = masked_mean(use3.to(logp.dtype), m).detach()
    loss = _weighted_loss(pg, weights, m, agg, agg_kwargs)
    metrics = _ratio_metrics(pg1, pg2, logp, old_logp, m)
    metrics["dual_clipfrac"] = dual_frac
    return loss, metrics


# ---- registered losses: (LossInputs, their config) -> (loss, metrics) -------------------------


@dataclass
class PackedRows:
    """Where a micro-batch's sample tokens sit in the packed row its forward ran as (actor.packing): a loss over
    sequences runs over those packed tokens with the row's own `cu_seqlens` instead of the padded rows."""

    gather: torch.Tensor  # [n, T] packed position of each sample token (0 where not `valid`)
    valid: torch.Tensor  # [n, T] bool: the sample has a token there
    cu_seqlens: torch.Tensor  # [segments + 1] int32: each sample with tokens, then the row's tail padding
    length: int  # the packed row's length

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[n, T] per sample token -> [length] in packed order (0 on the padding); differentiable."""
        valid = self.valid[:, : x.shape[1]].to(x.device)
        where = self.gather[:, : x.shape[1]].to(x.device)[valid]
        return x.new_zeros(self.length).index_put((where,), x[valid])

    def per_segment(self, x: torch.Tensor) -> torch.Tensor:
        """[n] per sample -> [segments]: the samples with tokens, in order, then 0 for the tail padding."""
        kept = x[self.valid.any(-1).to(x.device)]
        return torch.cat([kept, x.new_zeros(self.cu_seqlens.numel() - 1 - kept.shape[0])])


@dataclass
class LossInputs:
    """One mini- or micro-batch on its way to a loss: [b, T] tensors aligned to token positions (entry t scores
    token t), from the batch types (PaddedBatch, ProxPolicy) through the actor's micro-batching to the loss.

    The actor builds one per mini-batch; the forward splits it per micro-batch (fields that are tensors with a
    leading batch dimension) and hands the loss its micro-batch with `entropy` and `packed` filled in; the loss
    gets log pi_theta (or the critic's values) beside it. `num_tokens` / `num_seqs` count the whole mini-batch over
    every data-parallel rank, so a loss aggregated with them is the same whatever the micro-batch and DP split.
    A field a loss does not use stays None."""

    logp: torch.Tensor | None = None  # log pi_theta (with gradient), set by the loss from the forward's output
    old_logp: torch.Tensor | None = None  # log pi_prox: the actor before this step's updates (None: interpolated)
    rollout_logp: torch.Tensor | None = None  # log mu: the rollout engine that sampled the tokens
    advantages: torch.Tensor | None = None  # [b] or [b, T]
    mask: torch.Tensor | None = None  # response tokens (kept by the correction, once it ran)
    weights: torch.Tensor | None = None  # the correction's per-token weights (constants)
    num_tokens: float = 0.0
    num_seqs: float = 0.0
    packed: PackedRows | None = None  # the packed row the forward ran as (actor.packing), else None
    # the forward's inputs (never reach the loss: train_minibatch sets them to None in the micro-batch it hands over)
    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [b, T, L_moe, K] replayed by the actor's hooks (R3 / R2)
    # the modes' inputs, present only where they apply (decided once, where the actor builds the batch)
    prox_alpha: torch.Tensor | None = None  # [b] algorithm.prox_logp=loglinear: pi_prox interpolated in the loss
    exact_logp: torch.Tensor | None = None  # trainer.true_on_policy, first mini-batch: the engine-op values of logp
    ref_logp: torch.Tensor | None = None  # log pi_ref for the KL term (algorithm.kl_coef > 0)
    entropy: torch.Tensor | None = None  # pi_theta's per-token entropy (differentiable), when the loss needs it
    old_values: torch.Tensor | None = None  # the critic: its values pass before the update
    returns: torch.Tensor | None = None  # the critic: the value targets

    def rows(self, rows: slice, num_tokens: float, num_seqs: float) -> LossInputs:
        """The samples `rows` of every per-sample tensor, with the counts of that mini-batch."""
        sliced = {f.name: v[rows] for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}
        return replace(self, **sliced, num_tokens=num_tokens, num_seqs=num_seqs)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The per-sample tensor fields that are set, but the forward's token inputs."""
        skip = ("input_ids", "attention_mask")
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}


def gspo_fused(x: LossInputs, cfg: GSPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`gspo` through the fused kernel (moe_rl.kernels.gspo_loss; Triton on CUDA, its packed torch
    form on CPU), the correction's weights riding along: over the packed row's tokens and `cu_seqlens` when the
    forward ran packed (`x.packed`), else each padded row is one sequence."""
    from moe_rl.kernels.gspo_loss import fused_gspo_loss  # optional: Triton (moe_rl.kernels)

    b, t = x.logp.shape
    if x.advantages.shape != (b,):
        raise ValueError(
            f"the fused GSPO loss takes one advantage per sequence ([{b}]), got {tuple(x.advantages.shape)}"
        )
    if x.packed is None:
        flat, cu_seqlens, advantages = (lambda v: v.reshape(-1)), torch.arange(0, (b + 1) * t, t), x.advantages
    else:
        flat, cu_seqlens, advantages = x.packed.pack, x.packed.cu_seqlens, x.packed.per_segment(x.advantages)
    loss, m = fused_gspo_loss(
        flat(x.logp),
        flat(x.old_logp),
        advantages,
        flat(x.mask),
        cu_seqlens.to(x.logp.device),
        token_weights=None if x.weights is None else flat(x.weights),
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        agg=cfg.agg,
        horizon=t,
        num_tokens=x.num_tokens,
        num_seqs=x.num_seqs,
        use_triton=x.logp.is_cuda,
    )
    return loss, {k: m[k] for k in ("clipfrac", "ppo_kl", "seq_ratio_mean")}


@POLICY_LOSSES.register("gspo", config=GSPOConfig, fused=gspo_fused)
def gspo(x: LossInputs, cfg: GSPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    counts = {"num_tokens": x.num_tokens, "num_seqs": x.num_seqs}
    return gspo_loss(
        x.logp, x.old_logp, x.advantages, x.mask, cfg.clip_low, cfg.clip_high, x.weights, cfg.agg, **counts
    )


@POLICY_LOSSES.register("ppo", config=PPOConfig)
def ppo(x: LossInputs, cfg: PPOConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    counts = {"num_tokens": x.num_tokens, "num_seqs": x.num_seqs}
    return ppo_loss(
        x.logp,
        x.old_logp,
        x.advantages,
        x.mask,
        cfg.clip_low,
        cfg.clip_high,
        cfg.dual_clip,
        x.weights,
        cfg.agg,
        **counts,
    )
