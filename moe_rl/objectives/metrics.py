"""Training-inference mismatch metrics between pi_old (trainer) and mu (rollout engine).

Same semantics as verl's rollout-correction metrics (`rollout_corr/*`):
  training_ppl      mean_i exp(-mean_t old)             training_log_ppl  mean_i (-mean_t old)
  rollout_ppl       mean_i exp(-mean_t rollout)          rollout_log_ppl   mean_i (-mean_t rollout)
  kl                mean_t (rollout - old)   (KL(mu || pi_old), k1 over tokens)
  k3_kl             mean_t (k - log k - 1),  k = pi_old / mu
  log_ppl_diff      mean_i d_i, d_i = mean_t rollout - mean_t old   (+ abs mean, max, min)
  ppl_ratio         mean_i exp(d_i)          (= training ppl / rollout ppl per sequence)
  chi2_token        mean_t k^2 - 1           chi2_seq   mean_i (prod_t k)^2 - 1
Token means run over all response tokens of the batch; sequence means over sequences with at
least one token. Log-ratios are clamped to +-20 before exp (verl's safety bound).
Added here: the fractions of tokens with k outside [0.5, 2] and outside the IcePop band, and
the effective sample size of the token ratios, ESS = (mean k)^2 / mean k^2 (1 = no mismatch).
Every metric is a ratio of sums (or a max/min), so a batch split over ranks gives the metrics of
the whole batch: `mismatch_sums` on each rank, sums added and maxima maxed, `mismatch_from_sums`.
"""

from __future__ import annotations

import math

import torch

from moe_rl.objectives.aggregation import masked_mean, masked_sum

SAFETY_BOUND = 20.0
MISMATCH_KEYS = (
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "kl",
    "k3_kl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "chi2_token",
    "chi2_seq",
    "k_outside_0.5_2_fraction",
    "k_outside_icepop_fraction",
    "ess",
    "exact_fraction",
    "logprob_abs_diff_max",
)


@torch.no_grad()
def mismatch_sums(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The additive statistics behind the mismatch metrics (sums over tokens or sequences, and
    maxima), so batches split over ranks combine exactly: add the sums, take the max of the
    maxima, then `mismatch_from_sums`."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: old_logp {tuple(old_logp.shape)}, rollout_logp "
            f"{tuple(rollout_logp.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.to(torch.float32)
    old, roll = old_logp.float(), rollout_logp.float()
    seq = (m.sum(-1) > 0).to(torch.float32)  # sequences that have tokens
    mean_old = masked_mean(old, m, dim=-1)
    mean_roll = masked_mean(roll, m, dim=-1)
    log_k = (old - roll).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k = log_k.exp()
    d = mean_roll - mean_old
    log_rho = masked_sum(old - roll, m, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    outside = (log_k < math.log(0.5)) | (log_k > math.log(2.0))
    outside_icepop = (log_k < math.log(icepop_low)) | (log_k > math.log(icepop_high))
    sums = {
        "tokens": m.sum(),
        "seqs": seq.sum(),
        "training_ppl": masked_sum((-mean_old).exp(), seq),
        "training_log_ppl": masked_sum(-mean_old, seq),
        "rollout_ppl": masked_sum((-mean_roll).exp(), seq),
        "rollout_log_ppl": masked_sum(-mean_roll, seq),
        "kl": masked_sum(roll - old, m),
        # expm1: in float32 exp(x) - 1 - x loses every digit of x^2 / 2 when x is small; between an fp32 engine and
        # actor (|log k| ~ 1e-5) that made the sum negative (-8e-11 instead of +7e-11)
        "k3_kl": masked_sum(torch.expm1(log_k) - log_k, m),
        "log_ppl_diff": masked_sum(d, seq),
        "log_ppl_abs_diff": masked_sum(d.abs(), seq),
        "ppl_ratio": masked_sum(d.exp(), seq),
        "k": masked_sum(k, m),
        "k2": masked_sum(k * k, m),
        "rho2": masked_sum((2.0 * log_rho).exp(), seq),
        "outside_0.5_2": masked_sum(outside.float(), m),
        "outside_icepop": masked_sum(outside_icepop.float(), m),
        # bitwise equal pi_old and mu (true on-policy's target): compared in float32, the precision both arrive in
        "exact": masked_sum((old == roll).float(), m),
    }
    big = torch.finfo(torch.float32).max
    maxima = {  # the min as the max of the negation
        "log_ppl_diff_max": torch.where(seq.bool(), d, torch.full_like(d, -big)).max(),
        "-log_ppl_diff_min": torch.where(seq.bool(), -d, torch.full_like(d, -big)).max(),
        "logprob_abs_diff_max": torch.where(mask.bool(), (old - roll).abs(), torch.zeros_like(old)).max(),
    }
    return sums, maxima


def mismatch_from_sums(sums: dict[str, torch.Tensor], maxima: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The metrics (keys: MISMATCH_KEYS) of the batch whose statistics these are."""
    if float(sums["tokens"]) == 0:
        raise ValueError("mismatch_metrics: the mask has no response tokens")
    tokens, seqs = sums["tokens"], sums["seqs"].clamp(min=1)
    k_mean, k2_mean = sums["k"] / tokens, sums["k2"] / tokens
    per_seq = ("training_ppl", "training_log_ppl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff")
    out = {key: sums[key] / seqs for key in per_seq}
    out.update(
        {
            "kl": sums["kl"] / tokens,
            "k3_kl": sums["k3_kl"] / tokens,
            "log_ppl_abs_diff": sums["log_ppl_abs_diff"] / seqs,
            "log_ppl_diff_max": maxima["log_ppl_diff_max"],
            "log_ppl_diff_min": -maxima["-log_ppl_diff_min"],
            "ppl_ratio": sums["ppl_ratio"] / seqs,
            "chi2_token": k2_mean - 1.0,
            "chi2_seq": sums["rho2"] / seqs - 1.0,
            "k_outside_0.5_2_fraction": sums["outside_0.5_2"] / tokens,
            "k_outside_icepop_fraction": sums["outside_icepop"] / tokens,
            "ess": k_mean * k_mean / k2_mean,
            "exact_fraction": sums["exact"] / tokens,
            "logprob_abs_diff_max": maxima["logprob_abs_diff_max"],
        }
    )
    return {key: out[key] for key in MISMATCH_KEYS}


def mismatch_metrics(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
) -> dict[str, torch.Tensor]:
    """Mismatch metrics of one batch as detached 0-d tensors (keys: MISMATCH_KEYS)."""
    return mismatch_from_sums(*mismatch_sums(old_logp, rollout_logp, mask, icepop_low, icepop_high))
