"""Prompt sources: the built-in toy prompts, or jsonl/parquet files.

Files are read here line by line (jsonl) or with pyarrow (parquet) so that every bad row is
reported with its file and line; nothing is skipped silently. Prompts that do not fit the
engine's context (prompt tokens + sampling.max_tokens > max_model_len) are an error naming
the line, or are dropped with a count when `data.overlong_prompts=drop`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class DataError(ValueError):
    """A prompt file that cannot be used as it is; the message names the file and line."""


@dataclass
class Prompt:
    text: str
    answer: str | None = None
    source: str = ""
    """Where the prompt came from (`file:line`, or `toy:i`), for error messages."""


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

OVERLONG_POLICIES = ("error", "drop")


class PromptSource:
    """Endless shuffled prompts; each data-parallel rank reads its own disjoint stream.

    tokenize + max_prompt_tokens: prompts longer than that many tokens are an error naming their
    line (overlong="error") or are dropped before sharding, so every rank drops the same rows.
    """

    def __init__(
        self,
        task: str,
        path: str = "",
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        seed: int = 0,
        dp_rank: int = 0,
        dp_size: int = 1,
        *,
        tokenize: Callable[[list[str]], list[list[int]]] | None = None,
        max_prompt_tokens: int | None = None,
        overlong: str = "error",
    ):
        if task == "toy":
            rng = random.Random(seed)
            words = [" ".join(rng.choice(TOY_WORDS) for _ in range(rng.randint(2, 8))) for _ in range(512)]
            self.items = [Prompt(w, source=f"toy:{i}") for i, w in enumerate(words)]
        else:
            self.items = read_prompt_file(path, prompt_key, answer_key)
        self.dropped = 0
        if tokenize is not None and max_prompt_tokens is not None:
            self.items, self.dropped = _check_lengths(self.items, tokenize, max_prompt_tokens, overlong)
        if len(self.items) < dp_size:
            raise DataError(f"{len(self.items)} prompts cannot feed {dp_size} data-parallel ranks")
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


def _check_lengths(items: list[Prompt], tokenize, limit: int, policy: str) -> tuple[list[Prompt], int]:
    if policy not in OVERLONG_POLICIES:
        raise ValueError(f"data.overlong_prompts={policy!r}: choose one of {OVERLONG_POLICIES}")
    lengths = [len(ids) for ids in tokenize([p.text for p in items])]
    kept = [p for p, n in zip(items, lengths, strict=True) if n <= limit]
    if len(kept) < len(items) and policy == "error":
        first = next(i for i, n in enumerate(lengths) if n > limit)
        raise DataError(
            f"{items[first].source}: the prompt has {lengths[first]} tokens, more than the {limit} that fit the "
            f"engine's context with sampling.max_tokens ({len(items) - len(kept)} of {len(items)} prompts are too "
            "long). Shorten them, raise rollout.max_model_len, or set data.overlong_prompts=drop."
        )
    if not kept:
        raise DataError(f"every one of the {len(items)} prompts is longer than {limit} tokens")
    return kept, len(items) - len(kept)


def read_prompt_file(path: str, prompt_key: str, answer_key: str) -> list[Prompt]:
    """Prompts of a jsonl or parquet file; a DataError names the file and line of any bad row."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data.path={path!r} does not exist")
    rows = _parquet_rows(p) if p.suffix == ".parquet" else _jsonl_rows(p)
    items = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        if prompt_key not in row:
            raise DataError(f"{where}: no key data.prompt_key={prompt_key!r} (keys: {sorted(row)})")
        text = row[prompt_key]
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where}: {prompt_key!r} must be a non-empty string, got {text!r:.80}")
        answer = row.get(answer_key)
        items.append(Prompt(text, None if answer is None else str(answer), where))
    if not items:
        raise DataError(f"{path}: holds no prompts (empty file)")
    return items


def _jsonl_rows(path: Path):
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None


def _parquet_rows(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    for number, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}:row {number}", row
