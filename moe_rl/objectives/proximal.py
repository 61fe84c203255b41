"""The proximal policy pi_prox of the decoupled objective without its recompute pass
(algorithm.prox_logp=loglinear; A-3PO, arXiv 2512.06547, AReaL's `prox_logp_method=loglinear`).

pi_prox is the actor before this step's update (version v_prox = the step index), pi_theta the actor
being optimized (v_theta = v_prox + 1, the version this step produces) and mu the engine version that
sampled (v_mu). Instead of a forward pass at v_prox, pi_prox is interpolated in log space:

  log pi_prox ~= log mu + alpha * (sg[log pi_theta] - log mu),
  alpha = clamp((v_prox - v_mu) / (v_theta - v_mu), 0, 1)

On-policy samples (v_mu = v_prox) get alpha = 0 (pi_prox = mu); a sample k versions stale gets
alpha = k / (k + 1). The interpolation is a constant (stop-gradient): the loss's ratio pi_theta / pi_prox
keeps its gradient through pi_theta only, as with a recomputed pi_prox.
"""

from __future__ import annotations

import torch


def loglinear_alpha(behaviour_version: torch.Tensor, prox_version: int) -> torch.Tensor:
    """[B] alpha per sample from the version that sampled it (`behaviour_version`, [B]) and the actor's
    version before the update (`prox_version`); v_theta = prox_version + 1."""
    v_mu = behaviour_version.to(torch.float64)
    if (v_mu > prox_version).any():
        bad = int(torch.nonzero(v_mu > prox_version)[0])
        raise ValueError(
            f"sample {bad} was sampled by policy version {int(v_mu[bad])}, newer than the actor's {prox_version}"
        )
    alpha = (prox_version - v_mu) / (prox_version + 1 - v_mu)
    return alpha.clamp(0.0, 1.0).to(torch.float32)


@torch.no_grad()
def loglinear_prox_logp(rollout_logp: torch.Tensor, logp: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """[B, T] log pi_prox ~= log mu + alpha_i (log pi_theta - log mu), detached; `alpha`: [B]."""
    if rollout_logp.shape != logp.shape or alpha.shape != logp.shape[:1]:
        raise ValueError(
            f"shape mismatch: rollout_logp {tuple(rollout_logp.shape)}, logp {tuple(logp.shape)} must be [B, T] "
            f"and alpha {tuple(alpha.shape)} [B]"
        )
    mu = rollout_logp.to(logp.dtype)
    return mu + alpha.to(logp.dtype)[:, None] * (logp.detach() - mu)
