"""The typed batch a rollout produces, and its padded form for the actor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

from moe_rl.routing.layout import layer_columns
from moe_rl.routing.records import filler_row, route_dtype


@dataclass
class RolloutBatch:
    """B samples (n per prompt, contiguous per prompt) with their behaviour-policy data.

    Per sample i, T_i = len(prompt_ids[i]) + len(response_ids[i]):
      rollout_logprobs[i]: [len(response)] float32, log mu of each response token (vLLM sampler)
      routes[i]:           [T_i, L_moe, K] (contract dtype), row T_i - 1 filled with 0..K-1

    Multi-turn rollouts (rollout/multi_turn/) put every token after the first prompt in `response_ids` (the
    model's turns and the observations between them) and say which the model sampled:
      response_masks[i]:   [len(response)] float32, 1 on sampled tokens, 0 on observation tokens
      turn_index[i]:       [len(response)] int, the turn (0-based) that sampled each token, -1 on observations
      rewards:             [B] the environment's rewards (the reward plugin is not called)
      info:                per-sample arrays ([B]) the step's multi_turn/* and routes/* metrics come from

    In-flight rollouts (rollout/inflight.py) say which weights sampled each token:
      versions[i]:         [len(response)] int64, the policy version (weight sync count) that sampled each token
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[np.ndarray]
    finish_reasons: list[str]
    prompt_index: np.ndarray
    sample_index: np.ndarray
    routes: list[np.ndarray] | None
    moe_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    topk: int = 0
    response_masks: list[np.ndarray] | None = None
    turn_index: list[np.ndarray] | None = None
    rewards: np.ndarray | None = None
    info: dict[str, np.ndarray] = field(default_factory=dict)
    versions: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, rows: Sequence[int]) -> RolloutBatch:
        """The samples `rows`, in that order (prompt indices as they are)."""

        def pick(values):
            return None if values is None else [values[i] for i in rows]

        idx = np.asarray(rows, dtype=np.int64)
        return replace(
            self,
            prompt_ids=pick(self.prompt_ids),
            response_ids=pick(self.response_ids),
            rollout_logprobs=pick(self.rollout_logprobs),
            finish_reasons=pick(self.finish_reasons),
            prompt_index=self.prompt_index[idx],
            sample_index=self.sample_index[idx],
            routes=pick(self.routes),
            response_masks=pick(self.response_masks),
            turn_index=pick(self.turn_index),
            rewards=None if self.rewards is None else self.rewards[idx],
            info={k: v[idx] for k, v in self.info.items()},
            versions=pick(self.versions),
        )

    @staticmethod
    def cat(parts: Sequence[RolloutBatch]) -> RolloutBatch:
        """The parts' samples back to back, prompt indices as they are (one engine's batches: same layers)."""

        def join(name):
            values = [getattr(p, name) for p in parts]
            return None if values[0] is None else [x for v in values for x in v]

        first = parts[0]
        lists = ("prompt_ids", "response_ids", "rollout_logprobs", "finish_reasons", "routes", "response_masks")
        return replace(
            first,
            **{k: join(k) for k in (*lists, "turn_index", "versions")},
            prompt_index=np.concatenate([p.prompt_index for p in parts]),
            sample_index=np.concatenate([p.sample_index for p in parts]),
            rewards=None if first.rewards is None else np.concatenate([p.rewards for p in parts]),
            info={k: np.concatenate([p.info[k] for p in parts]) for k in first.info},
        )

    def split_by_prompt(self, prompts_per_part: int) -> list[RolloutBatch]:
        """Consecutive parts of `prompts_per_part` prompts each (prompt indices re-based to each part):
        one engine's batch back to the data-parallel ranks whose prompts it sampled."""
        parts = int(self.prompt_index.max()) // prompts_per_part + 1 if len(self) else 0
        out = []
        for p in range(parts):
            part = self.select(np.nonzero(self.prompt_index // prompts_per_part == p)[0].tolist())
            out.append(replace(part, prompt_index=part.prompt_index - p * prompts_per_part))
        return out

    def only_layers(self, layers: list[int]) -> RolloutBatch:
        """The batch with the routes of `layers` only (a pipeline stage's MoE layers, in route-column order)."""
        if self.routes is None or list(layers) == list(self.moe_layers):
            return self
        cols = layer_columns(layers, self.moe_layers)
        return replace(self, routes=[r[:, cols] for r in self.routes], moe_layers=list(layers))

    def routes_held_elsewhere(self) -> RolloutBatch:
        """The batch with zero-length routes in place of each sample's: for a rank whose routes another rank of
        its tensor/context-parallel group holds and cuts for it (actor/replay.py). Padded, they stay zero-width."""
        if self.routes is None:
            return self
        return replace(self, routes=[r[:0] for r in self.routes])

    def to_padded(self, pad_id: int = 0, pad_to_multiple: int = 1, min_length: int = 0) -> PaddedBatch:
        """Right-padded tensors; log-probs and routes aligned to token positions.

        `min_length` lets all ranks of an expert-parallel group use one sequence length (their
        token dispatchers exchange equal-sized blocks).
        """
        b = len(self)
        lengths = [len(p) + len(r) for p, r in zip(self.prompt_ids, self.response_ids, strict=True)]
        t = max(max(lengths), min_length)
        t += (-t) % pad_to_multiple
        ids = torch.full((b, t), pad_id, dtype=torch.long)
        attn = torch.zeros(b, t, dtype=torch.long)
        loss_mask = torch.zeros(b, t, dtype=torch.float32)
        roll = torch.zeros(b, t, dtype=torch.float32)
        routes = None
        elsewhere = self.routes is not None and b > 0 and all(len(r) == 0 for r in self.routes)
        if self.routes is not None:
            dtype = route_dtype(self.num_experts)
            routes = np.empty((b, 0 if elsewhere else t, len(self.moe_layers), self.topk), dtype=dtype)
            routes[:] = filler_row(len(self.moe_layers), self.topk, dtype)
        for i, (p, r) in enumerate(zip(self.prompt_ids, self.response_ids, strict=True)):
            n = len(p) + len(r)
            ids[i, :n] = torch.tensor(p + r)
            attn[i, :n] = 1
            loss_mask[i, len(p) : n] = 1 if self.response_masks is None else torch.from_numpy(self.response_masks[i])
            roll[i, len(p) : n] = torch.from_numpy(np.asarray(self.rollout_logprobs[i], dtype=np.float32))
            if routes is not None and not elsewhere:
                routes[i, :n] = self.routes[i]
        return PaddedBatch(ids, attn, loss_mask, roll, None if routes is None else torch.from_numpy(routes))


@dataclass
class ProxPolicy:
    """pi_prox of a step per token, the policy the update's ratio and the mismatch correction are taken against:
    the old-log-prob pass's pi_old (`logprobs`, `entropy`; under R2 the `routes` it recorded), or under
    algorithm.prox_logp=loglinear only each sample's interpolation weight `alpha` (objectives/proximal.py), the
    update forming pi_prox itself; after that update its own pi_theta fills `logprobs` and `entropy` for the
    step's metrics (`Actor.update_policy`)."""

    logprobs: torch.Tensor | None = None  # [B, T]
    entropy: torch.Tensor | None = None  # [B, T]
    routes: torch.Tensor | None = None  # [B, T, L_moe, K] the routes the old pass recorded (R2)
    alpha: torch.Tensor | None = None  # [B] loglinear: no old pass

    @property
    def interpolated(self) -> bool:
        """algorithm.prox_logp=loglinear: pi_prox is formed inside the update."""
        return self.alpha is not None


@dataclass
class PaddedBatch:
    """[B, T] tensors; entry t of a log-prob tensor scores token t given tokens < t."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor  # 1 on response tokens
    rollout_logprobs: torch.Tensor
    routes: torch.Tensor | None  # [B, T, L_moe, K] uint8 / int16; [B, 0, L_moe, K] where another rank holds them

    def select(self, rows: Sequence[int] | torch.Tensor) -> PaddedBatch:
        """The samples `rows`, in that order."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        return PaddedBatch(**{k: None if v is None else v[idx] for k, v in self._fields().items()})

    @staticmethod
    def cat(parts: Sequence[PaddedBatch]) -> PaddedBatch:
        """The parts' samples back to back (padded to one length)."""
        lengths = {p.input_ids.shape[1] for p in parts}
        if len(lengths) > 1:
            raise ValueError(f"batches padded to different lengths {sorted(lengths)} do not concatenate")
        return PaddedBatch(**{k: cat_or_none([p._fields()[k] for p in parts]) for k in parts[0]._fields()})

    def trimmed(self, length: int) -> PaddedBatch:
        """The first `length` positions (routes held by another rank stay zero-width)."""
        return PaddedBatch(**{k: None if v is None else v[:, :length] for k, v in self._fields().items()})

    def padded_to(self, length: int, pad_id: int, filler: torch.Tensor | None) -> PaddedBatch:
        """Right-padded to `length` positions: `pad_id` tokens, zero masks and log-probs, routes with `filler`
        ([layers, K], the contract's distinct valid ids; zero-width routes stay zero-width)."""
        extra = length - self.input_ids.shape[1]
        routes = self.routes
        if routes is not None and routes.shape[1] > 0:
            routes = torch.cat([routes, filler.to(routes.dtype).expand(routes.shape[0], extra, *filler.shape)], 1)
        return PaddedBatch(
            pad_right(self.input_ids, length, pad_id),
            pad_right(self.attention_mask, length, 0),
            pad_right(self.loss_mask, length, 0),
            pad_right(self.rollout_logprobs, length, 0),
            routes,
        )

    def _fields(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def cat_or_none(values: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """torch.cat of per-part tensors of one field, None where the parts have none."""
    return None if values[0] is None else torch.cat(list(values))


def pad_right(t: torch.Tensor, length: int, value) -> torch.Tensor:
    """[B, T, ...] -> [B, length, ...], the new positions set to `value`."""
    tail = torch.full((t.shape[0], length - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([t, tail], dim=1)
