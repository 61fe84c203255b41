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
)


@torch.no_grad()
def mismatch_metrics(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    icepop_low: float = 0.5,
    icepop_high: float = 5.0,
) -> dict[str, torch.Tensor]:
    """Mismatch metrics of one batch as detached 0-d tensors (keys: MISMATCH_KEYS)."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(
            f"shape mismatch: old_logp {tuple(old_logp.shape)}, rollout_logp "
            f"{tuple(rollout_logp.shape)}, mask {tuple(mask.shape)}"
        )
    m = mask.to(torch.float32)
    if m.sum() == 0:
        raise ValueError("mismatch_metrics: the mask has no response tokens")
    old, roll = old_logp.float(), rollout_logp.float()
    seq = (m.sum(-1) > 0).to(torch.float32)  # sequences that have tokens

    def seq_mean(x: torch.Tensor) -> torch.Tensor:
        return masked_mean(x, seq)

    mean_old = masked_mean(old, m, dim=-1)
    mean_roll = masked_mean(roll, m, dim=-1)
    log_k = (old - roll).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k = log_k.exp()
    d = mean_roll - mean_old
    big = torch.finfo(torch.float32).max
    log_rho = masked_sum(old - roll, m, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    k_mean = masked_mean(k, m)
    k2_mean = masked_mean(k * k, m)
    return {
        "training_ppl": seq_mean((-mean_old).exp()),
        "training_log_ppl": seq_mean(-mean_old),
        "rollout_ppl": seq_mean((-mean_roll).exp()),
        "rollout_log_ppl": seq_mean(-mean_roll),
        "kl": masked_mean(roll - old, m),
        "k3_kl": masked_mean(k - log_k - 1.0, m),
        "log_ppl_diff": seq_mean(d),
        "log_ppl_abs_diff": seq_mean(d.abs()),
        "log_ppl_diff_max": torch.where(seq.bool(), d, torch.full_like(d, -big)).max(),
        "log_ppl_diff_min": torch.where(seq.bool(), d, torch.full_like(d, big)).min(),
        "ppl_ratio": seq_mean(d.exp()),
        "chi2_token": k2_mean - 1.0,
        "chi2_seq": seq_mean((2.0 * log_rho).exp()) - 1.0,
        "k_outside_0.5_2_fraction": masked_mean(((log_k < math.log(0.5)) | (log_k > math.log(2.0))).float(), m),
        "k_outside_icepop_fraction": masked_mean(
            ((log_k < math.log(icepop_low)) | (log_k > math.log(icepop_high))).float(), m
        ),
        "ess": k_mean * k_mean / k2_mean,
    }
