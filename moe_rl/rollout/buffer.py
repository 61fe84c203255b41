"""A replay buffer between rollout and training (buffer.enable): whole GRPO groups, each with its token
ids, mu per token, the policy version of every sample, its routes in their narrow dtype, rewards, the
advantages at insertion and its prompt id, drawn by priority.

Priorities per group g (buffer.priority; alpha = buffer.alpha, eps = buffer.eps):
  uniform    1
  recency    (1 + age_g)^-alpha, age_g = current version - the group's oldest sample version
  advantage  (mean_i |A_i|)^alpha + eps, A_i the advantages at insertion
  rarity     (1 / (1 + trained(prompt)) + |pass_rate(prompt) - 0.5|)^alpha + eps: prompts trained on
             rarely, and prompts the policy mostly fails or mostly solves (pass rate = the mean reward of
             every sample of the prompt inserted so far, rewards in [0, 1]), come first
  mixed      the mean of the recency, advantage and rarity distributions (each normalised to sum 1)
A batch draws without replacement: first ceil(buffer.fresh_fraction * k) groups among those never trained
(by priority), then the rest among all remaining ones (by priority).

No prioritized-replay importance weights (beta) are applied: the priorities are a curriculum, meant to
change what the policy learns from, and the decoupled correction already weighs every replayed token by
pi_prox / mu; PER's (N P_g)^-beta would undo the emphasis and multiply unboundedly into the IcePop/TIS
weights. Replayed samples reach the loss exactly as a fresh batch would (tests/unit/test_buffer.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moe_rl.common.batch import PaddedBatch, pad_right
from moe_rl.common.distributed import world_max
from moe_rl.rollout.config import PRIORITIES
from moe_rl.rollout.source import Rollout

SAMPLE_KEYS = ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "routes")


def fresh_count(fraction: float, k: int) -> int:
    """ceil(fraction * k) never-trained groups, without float noise (0.14 * 50 is 7, not 8)."""
    return math.ceil(round(fraction * k, 9))


@dataclass
class Group:
    """One prompt's samples, trimmed to the group's longest sample."""

    # SAMPLE_KEYS (and turn_index under multi-turn): [n, L(, layers, K)]; Rollout.SAMPLE_TENSORS and advantages: [n]
    tensors: dict[str, torch.Tensor]
    prompt: str  # the prompt's id (Prompt.source)
    inserted: int  # the step it entered the buffer
    trained: int = 0  # how many batches have trained it

    @property
    def version(self) -> int:
        """The oldest policy version among its samples (its age counts from there)."""
        return int(self.tensors["policy_version"].min())

    @property
    def zero_variance(self) -> bool:
        r = self.tensors["rewards"]
        return bool((r == r[0]).all())


@dataclass
class ReplayBuffer:
    capacity: int
    max_age: int
    priority: str = "uniform"
    alpha: float = 1.0
    eps: float = 1e-3
    fresh_fraction: float = 0.0
    seed: int = 0
    groups: list[Group] = field(default_factory=list)
    prompt_trained: dict[str, int] = field(default_factory=dict)
    prompt_rewards: dict[str, list[float]] = field(default_factory=dict)  # [sum, count]

    def __post_init__(self):
        if self.priority not in PRIORITIES:
            raise ValueError(f"buffer.priority={self.priority!r}: choose one of {', '.join(PRIORITIES)}")
        self.generator = torch.Generator().manual_seed(self.seed)

    # ---- filling -------------------------------------------------------------------------------
    def add(self, rollout: Rollout, advantages: torch.Tensor, group_size: int, step: int) -> list[Group]:
        """Split `rollout` (rewards set) into its groups of `group_size` consecutive samples and keep them."""
        if rollout.rewards is None:
            raise ValueError("buffer: a rollout enters the buffer with its rewards")
        b = rollout.padded.input_ids.shape[0]
        if b % group_size:
            raise ValueError(f"buffer: {b} samples are not whole groups of {group_size}")
        if advantages.shape != (b,):
            raise ValueError(f"buffer: advantages {tuple(advantages.shape)} must be one per sample ({b},)")
        added = []
        for g in range(b // group_size):
            rows = slice(g * group_size, (g + 1) * group_size)
            group = _take(rollout, rows, advantages[rows], step)
            stats = self.prompt_rewards.setdefault(group.prompt, [0.0, 0])
            stats[0] += float(group.tensors["rewards"].sum())
            stats[1] += group_size
            self.groups.append(group)
            added.append(group)
        return added

    def evict(self, version: int) -> int:
        """Drop groups older than max_age versions, then the oldest beyond capacity; returns how many went."""
        before = len(self.groups)
        self.groups = [g for g in self.groups if version - g.version <= self.max_age]
        if len(self.groups) > self.capacity:
            self.groups.sort(key=lambda g: (g.version, g.inserted))  # stable: insertion order within a version
            self.groups = self.groups[len(self.groups) - self.capacity :]
        return before - len(self.groups)

    # ---- drawing -------------------------------------------------------------------------------
    def priorities(self, version: int, groups: list[Group] | None = None) -> torch.Tensor:
        """[G] float64 sampling weights (not normalised) of `groups` (default: all) under buffer.priority."""
        groups = self.groups if groups is None else groups
        if not groups:
            return torch.zeros(0, dtype=torch.float64)
        kinds = {
            "uniform": lambda: torch.ones(len(groups), dtype=torch.float64),
            "recency": lambda: self._recency(groups, version),
            "advantage": lambda: self._advantage(groups),
            "rarity": lambda: self._rarity(groups),
        }
        if self.priority == "mixed":
            parts = [kinds[k]() for k in ("recency", "advantage", "rarity")]
            return sum(p / p.sum() for p in parts) / 3
        return kinds[self.priority]()

    def _recency(self, groups, version):
        ages = torch.tensor([version - g.version for g in groups], dtype=torch.float64)
        return (1.0 + ages) ** -self.alpha

    def _advantage(self, groups):
        adv = torch.stack([g.tensors["advantages"].abs().double().mean() for g in groups])
        return adv**self.alpha + self.eps

    def _rarity(self, groups):
        def score(g):
            total, count = self.prompt_rewards.get(g.prompt, (0.0, 0))
            rate = total / count if count else 0.5
            return 1.0 / (1 + self.prompt_trained.get(g.prompt, 0)) + abs(rate - 0.5)

        return torch.tensor([score(g) for g in groups], dtype=torch.float64) ** self.alpha + self.eps

    def sample(self, k: int, version: int) -> list[Group]:
        """k groups without replacement: at least ceil(fresh_fraction * k) never-trained ones where there are
        that many, the rest by priority. Marks them trained."""
        if k > len(self.groups):
            raise ValueError(f"buffer: {k} groups asked of {len(self.groups)}")
        fresh = [i for i, g in enumerate(self.groups) if g.trained == 0]
        first = self._draw(fresh, min(fresh_count(self.fresh_fraction, k), len(fresh)), version)
        rest = [i for i in range(len(self.groups)) if i not in set(first)]
        chosen = [self.groups[i] for i in first + self._draw(rest, k - len(first), version)]
        for g in chosen:
            g.trained += 1
            self.prompt_trained[g.prompt] = self.prompt_trained.get(g.prompt, 0) + 1
        return chosen

    def _draw(self, candidates: list[int], k: int, version: int) -> list[int]:
        if k <= 0:
            return []
        p = self.priorities(version, [self.groups[i] for i in candidates])
        picked = torch.multinomial(p, k, replacement=False, generator=self.generator)
        return [candidates[i] for i in picked.tolist()]

    # ---- reporting -----------------------------------------------------------------------------
    def metrics(self, version: int) -> dict[str, float]:
        """buffer/size (groups), buffer/age_mean (versions), buffer/route_bytes, buffer/priority_entropy
        (of the normalised priorities, nats; log(size) when uniform)."""
        p = self.priorities(version)
        p = p / p.sum() if len(p) else p
        routes = sum(g.tensors["routes"].nbytes for g in self.groups if "routes" in g.tensors)
        return {
            "buffer/size": float(len(self.groups)),
            "buffer/age_mean": sum(version - g.version for g in self.groups) / max(len(self.groups), 1),
            "buffer/route_bytes": float(routes),
            "buffer/priority_entropy": float(-(p * p.clamp_min(1e-300).log()).sum()),
        }

    # ---- checkpoints ---------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Every group's tensors, their bookkeeping and the draw generator's state in one safetensors file."""
        from safetensors.torch import save_file  # heavy: safetensors, imported on first use

        tensors = {f"{i}/{k}": v.contiguous() for i, g in enumerate(self.groups) for k, v in g.tensors.items()}
        tensors["generator"] = self.generator.get_state()
        meta = {
            "groups": [{"prompt": g.prompt, "inserted": g.inserted, "trained": g.trained} for g in self.groups],
            "prompt_trained": self.prompt_trained,
            "prompt_rewards": self.prompt_rewards,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), {"buffer": json.dumps(meta)})

    def load(self, path: Path) -> None:
        """Restore what `save` wrote (bit-exact)."""
        from safetensors import safe_open  # heavy: safetensors, imported on first use

        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: the checkpoint has no replay buffer state for this rank (saved without buffer.enable?); "
                "resume with buffer.enable=false or from a checkpoint of a buffered run"
            )
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["buffer"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        self.generator.set_state(tensors.pop("generator"))
        self.groups = []
        for i, g in enumerate(meta["groups"]):
            own = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.split("/", 1)[0] == str(i)}
            self.groups.append(Group(own, g["prompt"], g["inserted"], g["trained"]))
        self.prompt_trained = meta["prompt_trained"]
        self.prompt_rewards = meta["prompt_rewards"]


def _take(rollout: Rollout, rows: slice, advantages: torch.Tensor, step: int) -> Group:
    group = rollout.select(range(rows.start, rows.stop))
    length = int(group.padded.attention_mask.sum(-1).max())
    p = group.padded.trimmed(length)
    tensors = {k: getattr(p, k).clone() for k in SAMPLE_KEYS if getattr(p, k) is not None}
    tensors |= {k: getattr(group, k).clone() for k in Rollout.SAMPLE_TENSORS if getattr(group, k) is not None}
    if group.turn_index is not None:
        tensors["turn_index"] = group.turn_index[:, :length].clone()
    tensors |= {"rewards": tensors["rewards"].float(), "advantages": advantages.detach().clone().float()}
    known = group.prompt_index is not None and group.prompts
    prompt = group.prompts[0].source if known else f"step{step}:{rows.start}"
    return Group(tensors, prompt, step)


def assemble(groups: list[Group], pad_id: int, length: int, filler: torch.Tensor | None) -> Rollout:
    """The Rollout of `groups` in order (each group's samples consecutive), right-padded to `length`
    tokens; routes padded with `filler` ([layers, K], the contract's distinct valid ids)."""

    def rollout(t: dict[str, torch.Tensor]) -> Rollout:
        padded = PaddedBatch(**{k: t.get(k) for k in SAMPLE_KEYS}).padded_to(length, pad_id, filler)
        turns = t.get("turn_index")
        return Rollout(
            padded,
            turn_index=None if turns is None else pad_right(turns, length, -1),
            **{k: t.get(k) for k in Rollout.SAMPLE_TENSORS},
        )

    return Rollout.cat([rollout(g.tensors) for g in groups])


class BufferSource:
    """The RolloutSource of buffer.enable: each step the engine's batch (scored, filtered) enters the buffer
    and the step trains `prompts_per_step` groups drawn from it. Collective (ranks agree on how many
    generation batches run and how many groups train)."""

    phase = "rollout"
    live = True

    def __init__(
        self,
        inner,
        buffer: ReplayBuffer,
        cfg,
        score,
        advantages,
        group_size: int,
        prompts_per_step: int,
        mini_batches: int,
        pad_id: int,
        pad_multiple: int,
        filler: torch.Tensor | None,
        warn,
    ):
        """`inner`: the EngineSource; `cfg`: moe_rl.config.BufferConfig; `score(rollout, step)` -> [B] rewards;
        `advantages(rewards)` -> [B]; `warn(step, message)` (the run's logger)."""
        self.inner, self.buffer, self.cfg, self.score, self.advantages = inner, buffer, cfg, score, advantages
        self.group_size, self.prompts_per_step, self.mini_batches = group_size, prompts_per_step, mini_batches
        self.pad_id, self.pad_multiple, self.filler, self.warn = pad_id, pad_multiple, filler, warn
        self.groups = inner.groups

    def next(self, step: int) -> Rollout:
        want = self.prompts_per_step
        fresh_wanted = fresh_count(self.buffer.fresh_fraction, want)
        dropped = generated = 0
        fresh_rewards = []
        while True:
            rollout = self.inner.next(step)
            generated += 1
            rollout.rewards = self.score(rollout, step + 1)
            fresh_rewards.append(rollout.rewards)
            added = self.buffer.add(rollout, self.advantages(rollout.rewards), self.group_size, step)
            if self.cfg.filter_zero_variance:
                flat = {id(g) for g in added if g.zero_variance}
                self.buffer.groups = [g for g in self.buffer.groups if id(g) not in flat]
                dropped += len(flat)
            fresh = sum(g.trained == 0 for g in self.buffer.groups)
            short = len(self.buffer.groups) < want or fresh < fresh_wanted
            (more,) = world_max(int(short and generated < self.cfg.max_gen_batches))
            if not more:
                break
        evicted = self.buffer.evict(step)
        (neg,) = world_max(-min(want, len(self.buffer.groups)))
        k = -neg
        if k < want:
            k -= k % self.mini_batches
            if k == 0:
                raise RuntimeError(
                    f"step {step + 1}: the replay buffer has no group to train after {generated} generation batches "
                    f"(buffer.filter_zero_variance dropped {dropped} groups whose rewards were all equal); raise "
                    "buffer.max_gen_batches or set buffer.filter_zero_variance=false"
                )
            self.warn(
                step + 1,
                f"buffer: training {k} of {want} groups after {generated} generation batches "
                f"({dropped} zero-variance groups dropped; buffer.max_gen_batches={self.cfg.max_gen_batches})",
            )
        chosen = self.buffer.sample(k, step)
        (longest,) = world_max(max(g.tensors["input_ids"].shape[1] for g in chosen))  # EP ranks: one length
        longest += (-longest) % self.pad_multiple
        out = assemble(chosen, self.pad_id, longest, self.filler)
        out.metrics = self.buffer.metrics(step) | {
            "buffer/replay_ratio": sum(g.trained > 1 for g in chosen) / len(chosen),
            "buffer/zero_variance_dropped": float(dropped),
            "buffer/zero_variance_trained": float(sum(g.zero_variance for g in chosen)),
            "buffer/generation_batches": float(generated),
            "buffer/fresh_reward_mean": float(torch.cat(fresh_rewards).mean()),  # the current policy's samples
            "buffer/evicted": float(evicted),
        }
        return out

    @property
    def position(self) -> int:
        return self.inner.position

    def update_weights(self, sync, version: int) -> dict:
        return self.inner.update_weights(sync, version)

    def idle_times(self, rollout_s: float, step_s: float) -> dict[str, float]:
        return self.inner.idle_times(rollout_s, step_s)

    def close(self) -> None:
        self.inner.close()
