"""The RL objective of a run, built once from `algorithm`: advantages, the mismatch correction
and the policy loss, each a registered function with its own typed config, plus the KL to the
reference policy and the entropy bonus."""

from __future__ import annotations

from dataclasses import replace

import torch

import moe_rl.objectives.advantages  # noqa: F401  the estimators register themselves on import
import moe_rl.objectives.value  # noqa: F401
from moe_rl.objectives.aggregation import masked_mean
from moe_rl.objectives.config import PROX_LOGP, IcePopConfig
from moe_rl.objectives.corrections import Correction
from moe_rl.objectives.kl import kl_penalty
from moe_rl.objectives.policy_loss import LossInputs
from moe_rl.objectives.proximal import loglinear_alpha, loglinear_prox_logp
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
        # how the loss gets pi_prox: chosen here, once
        self._pi_prox = self._interpolated_prox if self.prox_logp == "loglinear" else self._recomputed_prox

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

    def prox_alpha(self, behaviour_version: torch.Tensor, step: int) -> torch.Tensor | None:
        """[B] each sample's interpolation weight under algorithm.prox_logp=loglinear (pi_prox is formed in the
        loss: no old-log-prob pass); None when the old-log-prob pass computes pi_prox."""
        return loglinear_alpha(behaviour_version, step) if self.prox_logp == "loglinear" else None

    def loss_inputs(
        self, padded, old, advantages: torch.Tensor, ref_logprobs: torch.Tensor | None = None
    ) -> tuple[LossInputs, dict[str, float], dict[str, float]]:
        """The update's batch of every sample (`padded`: the step's PaddedBatch; `old`: its ProxPolicy), and the
        correction's metrics of this rank with their weights (its tokens, or its sequences for `*_seq_*` shares) for
        the mean over ranks. A recomputed pi_prox is corrected here, once for the step; an interpolated one
        (algorithm.prox_logp=loglinear) carries each sample's weight to the loss, which corrects it."""
        x = LossInputs(
            input_ids=padded.input_ids,
            attention_mask=padded.attention_mask,
            rollout_logp=padded.rollout_logprobs,
            advantages=advantages,
            ref_logp=ref_logprobs,
        )
        if self.prox_logp == "loglinear":
            return replace(x, mask=padded.loss_mask, prox_alpha=old.alpha), {}, {}
        corr = self.correct(old.logprobs, padded.rollout_logprobs, padded.loss_mask)
        tokens, seqs = float(padded.loss_mask.sum()), float((padded.loss_mask.sum(-1) > 0).sum())
        name = self.correction_name
        metrics = {f"{name}/{k}": float(v) for k, v in corr.metrics.items()}
        weights = {f"{name}/{k}": seqs if "_seq_" in k else tokens for k in corr.metrics}
        token_weights = corr.weights if corr.weights is not None else torch.ones_like(corr.mask)
        return replace(x, mask=corr.mask, old_logp=old.logprobs, weights=token_weights), metrics, weights

    def loss(self, logp: torch.Tensor, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of one micro-batch `x` (its per-token tensors and its mini-batch's counts) at log pi_theta
        `logp`: the policy loss, plus kl_coef * KL(pi_theta || ref) and minus entropy_coef * entropy, both token
        means over the mini-batch's `num_tokens` (so their share does not depend on the micro-batch split).

        pi_prox is `x.old_logp` with the correction's weights and mask already applied (Objective.correct, once per
        step), or under algorithm.prox_logp=loglinear interpolated here from mu and pi_theta with `x.prox_alpha` and
        corrected here; the correction's metrics then come back with the loss's. `x.packed` (PackedRows): the packed
        row the forward ran as, for a loss over sequences."""
        x, extra = self._pi_prox(replace(x, logp=logp))
        loss, metrics = self._loss(x, self.loss_cfg)
        metrics |= extra
        m = x.mask.to(logp.dtype)
        if x.ref_logp is not None:
            kl = kl_penalty(logp, x.ref_logp, self.kl_type)
            metrics["kl_ref"] = masked_mean(kl, m).detach()
            if not self.kl_in_reward:
                loss = loss + self.kl_coef * (kl * m).sum() / max(x.num_tokens, 1.0)
        if self.entropy_coef:
            loss = loss - self.entropy_coef * (x.entropy * m).sum() / max(x.num_tokens, 1.0)
        return loss, metrics

    @staticmethod
    def _recomputed_prox(x: LossInputs) -> tuple[LossInputs, dict[str, torch.Tensor]]:
        """pi_prox as the old-log-prob pass computed it, corrected before the update: `x` as it is."""
        return x, {}

    def _interpolated_prox(self, x: LossInputs) -> tuple[LossInputs, dict[str, torch.Tensor]]:
        """algorithm.prox_logp=loglinear: pi_prox from mu and pi_theta (objectives/proximal.py), corrected here; the
        correction's metrics."""
        old = loglinear_prox_logp(x.rollout_logp, x.logp, x.prox_alpha)
        corr = self.correct(old, x.rollout_logp.to(old.dtype), x.mask.to(old.dtype))
        extra = {f"{self.correction_name}/{k}": v for k, v in corr.metrics.items()}
        return replace(x, old_logp=old, mask=corr.mask, weights=corr.weights), extra
