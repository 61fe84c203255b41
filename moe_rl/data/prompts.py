"""Prompt sources: the built-in toy prompts, or jsonl/parquet files read with `datasets` offline."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Prompt:
    text: str
    answer: str | None = None


TOY_WORDS = [
    "count",
    "the",
    "numbers",
    "one",
    "two",
    "three",
    "quick",
    "brown",
    "fox",
    "experts",
    "route",
    "tokens",
    "answer",
    "question",
    "what",
    "is",
    "reward",
    "learning",
]


class PromptSource:
    """Endless shuffled prompts; each data-parallel rank reads its own disjoint stream."""

    def __init__(
        self,
        task: str,
        path: str = "",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if task == "toy":
            rng = random.Random(seed)
            self.items = [Prompt(" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(2, 8)))) for _ in range(512)]
        else:
            self.items = _read_file(path, prompt_key, answer_key)
        if len(self.items) < dp_size:
            raise ValueError(f"{len(self.items)} prompts cannot feed {dp_size} data-parallel ranks")
        self.items = self.items[dp_rank::dp_size]
        self.rng = random.Random(seed + 1000 * dp_rank)
        self.order: list[int] = []
        self.position = 0  # prompts consumed (saved in checkpoints to resume the stream)

    def skip(self, count: int) -> None:
        """Fast-forward `count` prompts: a resumed run continues the same stream."""
        self.next(count)

    def next(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            if not self.order:
                self.order = list(range(len(self.items)))
                self.rng.shuffle(self.order)
            out.append(self.items[self.order.pop()])
            self.position += 1
        return out


def _read_file(path: str, prompt_key: str, answer_key: str) -> list[Prompt]:
    import os

    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.path={path!r} does not exist")
    from datasets import load_dataset

    kind = "parquet" if path.endswith(".parquet") else "json"
    ds = load_dataset(kind, data_files=path, split="train")
    if prompt_key not in ds.column_names:
        raise ValueError(f"data.prompt_key={prompt_key!r} is not a column of {path} (columns: {ds.column_names})")
    answers = ds[answer_key] if answer_key in ds.column_names else [None] * len(ds)
    return [Prompt(str(p), None if a is None else str(a)) for p, a in zip(ds[prompt_key], answers, strict=True)]
