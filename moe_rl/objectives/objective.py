"""The RL objective of a run, built once from `algorithm`: advantages, the mismatch correction
and the policy loss, each a registered function with its own typed config."""

from __future__ import annotations

import torch

from moe_rl.objectives.corrections import Correction, IcePopConfig
from moe_rl.objectives.policy_loss import LossInputs
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
        self.group_size = group_size
        # the band mismatch/k_outside_icepop_fraction reports: the run's own under IcePop
        self.icepop_band = self.correction_cfg if isinstance(self.correction_cfg, IcePopConfig) else IcePopConfig()

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        return self._advantages(rewards, self.group_size)

    def correct(self, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Correction:
        """Token weights and mask that correct pi_old against the rollout engine's mu."""
        return self._correction(old_logp, rollout_logp, mask, self.correction_cfg)

    def loss(self, logp: torch.Tensor, mb: dict, num_tokens: float, num_seqs: float):
        """The policy loss of one micro-batch (`mb`: its per-token tensors, see Actor.train)."""
        x = LossInputs(
            logp=logp,
            old_logp=mb["old_logprobs"],
            rollout_logp=mb["rollout_logprobs"],
            advantages=mb["advantages"],
            mask=mb["loss_mask"],
            weights=mb["weights"],
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        return self._loss(x, self.loss_cfg)
