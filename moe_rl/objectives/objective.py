"""The RL objective of a run, built once from `algorithm`: advantages, the mismatch correction
and the policy loss, each a registered function with its own typed config, plus the KL to the
reference policy and the entropy bonus."""

from __future__ import annotations

import torch

from moe_rl.objectives import advantages, value  # noqa: F401  the estimators register themselves on import
from moe_rl.objectives.aggregation import masked_mean
from moe_rl.objectives.config import PROX_LOGP, IcePopConfig
from moe_rl.objectives.corrections import Correction
from moe_rl.objectives.kl import kl_penalty
from moe_rl.objectives.policy_loss import LossInputs
from moe_rl.objectives.proximal import loglinear_prox_logp
from moe_rl.objectives.registry import ADVANTAGES, CORRECTIONS, POLICY_LOSSES


class Objective:
    def __init__(self, algorithm, group_size: int):
        """`algorithm`: moe_rl.config.AlgorithmConfig; `group_size`: samples per prompt (GRPO group)."""
        self.loss_name = POLICY_LOSSES.name_of(algorithm.loss)
        self.correction_name = CORRECTIONS.name_of(algorithm.correction)
        self.loss_cfg, self.correction_cfg = algorithm.loss, algorithm.correction
        self._loss = POLICY_LOSSES.get(self.loss_name)
        # algorithm.fused_loss: the registered loss's fused kernel where it has one
        fused = POLICY_LOSSES.meta(self.loss_name).get("fused")
        self.fused = algorithm.fused_loss and fused is not None
        self.fused_note = None  # why a requested fused loss is not used (printed once by the trainer)
        if algorithm.fused_loss and fused is None:
            has = sorted(n for n in POLICY_LOSSES.names() if POLICY_LOSSES.meta(n).get("fused"))
            self.fused_note = (
                f"algorithm.fused_loss: loss {self.loss_name!r} has no fused kernel (fused: {has}); "
                "it runs as the torch loss"
            )
        if self.fused:
            self._loss = fused
        self._correction = CORRECTIONS.get(self.correction_name)
        self._advantages = ADVANTAGES.get(algorithm.advantage)
        # gae: token-level advantages from the critic's values too (token_advantages), not from rewards alone
        self.needs_values = bool(ADVANTAGES.meta(algorithm.advantage).get("needs_values"))
        self.gamma, self.lam = algorithm.gamma, algorithm.lam
        self.group_size = group_size
        # the band mismatch/k_outside_icepop_fraction reports: the run's own under IcePop
        self.icepop_band = self.correction_cfg if isinstance(self.correction_cfg, IcePopConfig) else IcePopConfig()
        self.kl_coef, self.kl_type, self.kl_in_reward = algorithm.kl_coef, algorithm.kl_type, algorithm.kl_in_reward
        self.entropy_coef = algorithm.entropy_coef
        if algorithm.prox_logp not in PROX_LOGP:
            raise ValueError(f"algorithm.prox_logp={algorithm.prox_logp!r}: choose one of {', '.join(PROX_LOGP)}")
        self.prox_logp = algorithm.prox_logp

    @property
    def needs_reference(self) -> bool:
        """Whether the run computes log-probs of the reference policy (the frozen initial weights)."""
        return self.kl_coef > 0

    @torch.no_grad()
    def reward_kl(self, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B] kl_coef * sum_t KL_t(pi_old || ref) over each response (algorithm.kl_in_reward): the total
        that classic token-level KL shaping (-kl_coef * KL_t on every response token) takes from an outcome
        reward."""
        return self.kl_coef * (kl_penalty(logp, ref_logp, self.kl_type) * mask).sum(-1)

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """[B] one advantage per sample, from the rewards [B] (group-relative estimators)."""
        if self.needs_values:
            raise ValueError("this advantage estimator needs the critic's values: use token_advantages")
        return self._advantages(rewards, self.group_size)

    def token_advantages(
        self, rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns), [B, T], of an estimator that needs the critic's values (gae)."""
        return self._advantages(rewards, self.group_size, mask=mask, values=values, gamma=self.gamma, lam=self.lam)

    def correct(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Correction:
        """Token weights and mask that correct pi_old against the rollout engine's mu."""
        return self._correction(old_logp, rollout_logp, mask, self.correction_cfg)

    def loss(self, logp: torch.Tensor, mb: dict, num_tokens: float, num_seqs: float):
        """The loss of one micro-batch (`mb`: its per-token tensors, see Actor.train): the policy loss,
        plus kl_coef * KL(pi_theta || ref) and minus entropy_coef * entropy, both token means over the
        mini-batch's `num_tokens` (so their share does not depend on the micro-batch split).

        pi_prox is `mb["old_logprobs"]` with the correction's `weights` and mask already applied, or, when
        `mb` carries `prox_alpha` (algorithm.prox_logp=loglinear), interpolated here from mu and pi_theta
        and corrected here; the correction's metrics then come back with the loss's. `mb["packed"]` (PackedRows):
        the packed row the forward ran as, for a loss over sequences."""
        old, mask, weights, extra = mb.get("old_logprobs"), mb["loss_mask"], mb.get("weights"), {}
        if "prox_alpha" in mb:
            old = loglinear_prox_logp(mb["rollout_logprobs"], logp, mb["prox_alpha"])
            corr = self.correct(old, mb["rollout_logprobs"].to(old.dtype), mask.to(old.dtype))
            mask, weights = corr.mask, corr.weights
            extra = {f"{self.correction_name}/{k}": v for k, v in corr.metrics.items()}
        x = LossInputs(
            logp=logp,
            old_logp=old,
            rollout_logp=mb["rollout_logprobs"],
            advantages=mb["advantages"],
            mask=mask,
            weights=weights,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
            packed=mb.get("packed"),
        )
        loss, metrics = self._loss(x, self.loss_cfg)
        metrics |= extra
        m = x.mask.to(logp.dtype)
        if "ref_logprobs" in mb:
            kl = kl_penalty(logp, mb["ref_logprobs"], self.kl_type)
            metrics["kl_ref"] = masked_mean(kl, m).detach()
            if not self.kl_in_reward:
                loss = loss + self.kl_coef * (kl * m).sum() / max(num_tokens, 1.0)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * (mb["entropy"] * m).sum() / max(num_tokens, 1.0)
        return loss, metrics
