"""Corrections for the training-inference mismatch that remains after routing replay.

Per token k_t = pi_old / mu = exp(old_logp - rollout_logp). All ratios are formed in log space
(no overflow for huge log-ratios); every returned tensor is detached and zero off the mask.

  icepop     k_t if low <= k_t <= high else 0        (token weight; mask unchanged)
  tis        min(k_t, cap)                             (token weight)
  seq-tis    min(rho_i, cap), rho_i = prod_t k_t       (sequence weight on every token)
  seq-mask   drop sequence i unless low <= rho_i <= high          (new mask)
  geo-mask   drop sequence i unless low <= exp(mean_t log k_t) <= high  (new mask)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe_rl.objectives.aggregation import masked_mean, masked_sum
from moe_rl.objectives.config import (
    GeoMaskConfig,
    IcePopConfig,
    NoCorrectionConfig,
    SeqMaskConfig,
    SeqTISConfig,
    TISConfig,
)
from moe_rl.objectives.registry import CORRECTIONS


@dataclass
class Correction:
    """What a correction does to the loss: token weights and (possibly reduced) response mask."""

    weights: torch.Tensor | None  # [B, T] or None for no reweighting
    mask: torch.Tensor  # [B, T]
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


def _log_k(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: old_logp {tuple(old_logp.shape)}, rollout_logp "
            f"{tuple(rollout_logp.shape)}, mask {tuple(mask.shape)} must all be [B, T]"
        )
    return ((old_logp - rollout_logp) * mask).detach()


def _check_band(low: float, high: float) -> None:
    if not 0 < low <= high:
        raise ValueError(f"band [{low}, {high}] must satisfy 0 < low <= high")


@torch.no_grad()
def icepop_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, low: float = 0.5, high: float = 5.0
) -> torch.Tensor:
    """IcePop: k_t inside [low, high], 0 outside (no gradient through that token). [B, T]"""
    _check_band(low, high)
    log_k = _log_k(old_logp, rollout_logp, mask)
    keep = (log_k >= math.log(low)) & (log_k <= math.log(high)) & mask.bool()
    return torch.where(keep, log_k.clamp(max=math.log(high)).exp(), torch.zeros_like(log_k))


@torch.no_grad()
def tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance sampling: min(k_t, cap). [B, T]"""
    if cap <= 0:
        raise ValueError(f"cap={cap} must be > 0")
    log_k = _log_k(old_logp, rollout_logp, mask)
    return log_k.clamp(max=math.log(cap)).exp() * mask


@torch.no_grad()
def sequence_log_ratio(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, geometric: bool = False
) -> torch.Tensor:
    """log rho_i = sum_t mask (old - rollout); geometric: its mean over the response. [B]"""
    log_k = _log_k(old_logp, rollout_logp, mask)
    return masked_mean(log_k, mask, dim=-1) if geometric else masked_sum(log_k, mask, dim=-1)


@torch.no_grad()
def seq_tis_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Sequence-level truncated IS: min(rho_i, cap) on every response token of sequence i. [B, T]"""
    if cap <= 0:
        raise ValueError(f"cap={cap} must be > 0")
    log_rho = sequence_log_ratio(old_logp, rollout_logp, mask)
    return log_rho.clamp(max=math.log(cap)).exp()[:, None] * mask


@torch.no_grad()
def seq_reject_mask(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
    geometric: bool = False,
) -> torch.Tensor:
    """The response mask with every sequence whose ratio (or geometric mean) leaves [low, high] dropped."""
    _check_band(low, high)
    stat = sequence_log_ratio(old_logp, rollout_logp, mask, geometric=geometric)
    keep = (stat >= math.log(low)) & (stat <= math.log(high))
    return mask * keep[:, None].to(mask.dtype)


# ---- registered corrections: (old_logp, rollout_logp, mask, their config) -> Correction --------


def _token_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    m = mask.to(weights.dtype)
    return {"weight_mean": masked_mean(weights, m), "zeroed_fraction": masked_mean((weights == 0).to(m.dtype), m)}


@CORRECTIONS.register("none", config=NoCorrectionConfig)
def no_correction(old_logp, rollout_logp, mask, cfg: NoCorrectionConfig) -> Correction:
    return Correction(None, mask)


@CORRECTIONS.register("icepop", config=IcePopConfig)
def icepop(old_logp, rollout_logp, mask, cfg: IcePopConfig) -> Correction:
    w = icepop_weights(old_logp, rollout_logp, mask, cfg.low, cfg.high)
    metrics = _token_metrics(w, mask)
    metrics["masked_fraction"] = metrics.pop("zeroed_fraction")
    return Correction(w, mask, metrics)


@CORRECTIONS.register("tis", config=TISConfig)
def tis(old_logp, rollout_logp, mask, cfg: TISConfig) -> Correction:
    w = tis_weights(old_logp, rollout_logp, mask, cfg.cap)
    m = mask.to(w.dtype)
    return Correction(
        w, mask, {"weight_mean": masked_mean(w, m), "capped_fraction": masked_mean((w >= cfg.cap).to(m.dtype), m)}
    )


@CORRECTIONS.register("seq-tis", config=SeqTISConfig)
def seq_tis(old_logp, rollout_logp, mask, cfg: SeqTISConfig) -> Correction:
    w = seq_tis_weights(old_logp, rollout_logp, mask, cfg.cap)
    return Correction(w, mask, {"weight_mean": masked_mean(w, mask.to(w.dtype))})


def _reject(old_logp, rollout_logp, mask, low, high, geometric) -> Correction:
    new_mask = seq_reject_mask(old_logp, rollout_logp, mask, low, high, geometric)
    had = (mask.sum(-1) > 0).to(old_logp.dtype)
    dropped = had * (new_mask.sum(-1) == 0).to(old_logp.dtype)
    return Correction(None, new_mask, {"rejected_seq_fraction": dropped.sum() / had.sum().clamp(min=1)})


@CORRECTIONS.register("seq-mask", config=SeqMaskConfig)
def seq_mask(old_logp, rollout_logp, mask, cfg: SeqMaskConfig) -> Correction:
    return _reject(old_logp, rollout_logp, mask, cfg.low, cfg.high, geometric=False)


@CORRECTIONS.register("geo-mask", config=GeoMaskConfig)
def geo_mask(old_logp, rollout_logp, mask, cfg: GeoMaskConfig) -> Correction:
    return _reject(old_logp, rollout_logp, mask, cfg.low, cfg.high, geometric=True)
