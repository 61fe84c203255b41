"""Validation during training: the engines sample the validation prompts with the current weights
(after the step's weight sync); no update, no routes kept.

The prompts are split over the engines in contiguous shares and prompt i (in file order) samples
with seed `val.seed + i`, so the result does not depend on the engine layout, and the training
streams (their own data order and per-step seeds) are the same with or without validation.
Several validation sets (data.val_path as a list or a mapping) are sampled one after another, each
reported under its own name (val/<name>/...); a single set keeps the plain val/... names.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from moe_rl.common import progress
from moe_rl.reward import RewardSet, samples_of

VAL_SUMS = ("prompts", "samples", "reward", "length", "passed", "correct", "stopped")


class Validator:
    def __init__(self, prompts: list, groups, engine, tokenizer, rewards: RewardSet, val_cfg, sampling, may_stop):
        """`prompts`: every validation Prompt (with token ids), the same list on every rank; `groups`:
        EngineGroups; `engine`: this rank's engine (leaders) or None; `rewards`: the run's RewardSet (each engine
        leader scores its own share, so every sample once); `val_cfg`: config.ValConfig; `sampling`: the training
        SamplingConfig (its stop strings are kept); `may_stop`: as EngineSource's."""
        e, engines = groups.leaders.index(groups.leader), len(groups.leaders)
        self.first = e * len(prompts) // engines
        share = prompts[self.first : (e + 1) * len(prompts) // engines]
        self.share = share if groups.is_leader else []
        self.engine, self.tokenizer, self.rewards, self.may_stop = engine, tokenizer, rewards, may_stop
        self.cfg = val_cfg
        self.sampling = replace(
            sampling,
            n=val_cfg.n,
            temperature=val_cfg.temperature,
            top_p=val_cfg.top_p,
            max_tokens=val_cfg.max_tokens or sampling.max_tokens,
            seed=val_cfg.seed + self.first,
        )

    def __call__(self, step: int, prefix: str = "val/") -> dict[str, float]:
        """`prefix`* metrics over every engine's prompts (collective: every rank calls it); {} when a stop
        signal took an engine."""
        progress.mark("validation")
        sums = torch.zeros(len(VAL_SUMS), dtype=torch.float64)
        if self.share:
            sums += self._score(step)
        if dist.get_world_size() > 1:
            dist.all_reduce(sums)
        s = dict(zip(VAL_SUMS, sums.tolist(), strict=True))
        if s["stopped"] or not s["prompts"]:
            return {}
        return {
            f"{prefix}reward_mean": s["reward"] / s["samples"],
            f"{prefix}pass@k": s["passed"] / s["prompts"],
            f"{prefix}pass@1": s["correct"] / s["samples"],
            f"{prefix}length_mean": s["length"] / s["samples"],
            f"{prefix}prompts": s["prompts"],
        }

    def _score(self, step: int) -> torch.Tensor:
        batch = None
        with self.may_stop():
            batch = self.engine.generate([p.ids for p in self.share], self.sampling)
        if batch is None:
            return torch.tensor([0, 0, 0, 0, 0, 0, 1], dtype=torch.float64)
        texts = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        samples = samples_of(self.share, batch.prompt_index, texts, batch.response_ids)
        rank = f" (rank {dist.get_rank()})" if dist.get_world_size() > 1 else ""
        r = torch.tensor(self.rewards.score(samples, step, phase=f"validation{rank}").rewards, dtype=torch.float64)
        correct = (r >= self.cfg.pass_threshold).double()
        passed = torch.zeros(len(self.share), dtype=torch.float64).index_add_(
            0, torch.as_tensor(batch.prompt_index), correct
        )
        lengths = sum(len(x) for x in batch.response_ids)
        return torch.tensor(
            [len(self.share), len(r), r.sum(), lengths, (passed > 0).sum(), correct.sum(), 0], dtype=torch.float64
        )


class ValidationSets:
    """Every validation set's Validator, run in order: one set's metrics are val/..., several sets' are
    val/<name>/... each (collective, as Validator)."""

    def __init__(self, validators: dict[str, Validator]):
        self.validators = validators

    def __call__(self, step: int) -> dict[str, float]:
        """The metrics of every set; {} when a stop signal took an engine during any of them."""
        single = len(self.validators) == 1
        out: dict[str, float] = {}
        for name, validator in self.validators.items():
            metrics = validator(step, "val/" if single else f"val/{name}/")
            if not metrics:
                return {}
            out |= metrics
        return out
