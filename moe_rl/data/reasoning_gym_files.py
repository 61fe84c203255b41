"""`python -m moe_rl.data.tasks reasoning_gym ...`: a draw of reasoning-gym datasets (moe_rl/data/reasoning_gym.py)
written as a verl-format parquet file (RL: data.task=file data.format=verl) or as SFT conversations (`--format sft`:
TRL's `messages` rows, the answer as the assistant's turn), with pyarrow.

examples:
  python -m moe_rl.data.tasks reasoning_gym --datasets basic_arithmetic,chain_sum:2 --split train --n 5000 \\
      --settings '{"basic_arithmetic": {"max_terms": 2, "max_digits": 2}}' --out train.parquet
  python -m moe_rl.data.tasks reasoning_gym --datasets basic_arithmetic --split test --n 500 --seed 0 \\
      --exclude train.parquet --out test.parquet   # drops the test questions that are also train questions
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_rl.common.errors import ConfigError
from moe_rl.data.reasoning_gym import (
    RESPONSES,
    SPLIT_STARTS,
    DatasetSpec,
    generate,
    parse_datasets,
    seed_range,
    sft_row,
)


def write_parquet(rows: list[dict], path: str | Path) -> None:
    """`rows` as one parquet file (pyarrow infers the nested schema: prompt a list of structs, reward_model and
    extra_info structs)."""
    # heavy: pyarrow, imported on first use
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))


def questions_of(path: str | Path) -> set[str]:
    """The questions of a parquet file this CLI wrote (verl rows or SFT conversations): what --exclude drops."""
    # heavy: pyarrow, imported on first use
    import pyarrow.parquet as pq

    out = set()
    for row in pq.read_table(str(path)).to_pylist():
        messages = row.get("prompt") if "prompt" in row else row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"--exclude {path}: a row without 'prompt' or 'messages' chat messages: {row!r:.80}")
        out.add(next(m["content"] for m in messages if m["role"] == "user"))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_rl.data.tasks reasoning_gym",
        description=__doc__.split("\n\nexamples:")[0],
        epilog="examples:" + __doc__.split("examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--datasets", required=True, help="reasoning-gym datasets as name[:weight],... (weight 1)")
    p.add_argument("--settings", default="{}", help="JSON {dataset: {config key: value}} (the datasets' configs)")
    p.add_argument("--split", choices=sorted(SPLIT_STARTS), default="train")
    p.add_argument("--n", type=int, default=1000, help="rows to write (distinct questions)")
    p.add_argument("--seed", type=int, default=0, help="which stream of the split the entries come from")
    p.add_argument("--exclude", action="append", default=[], help="parquet file(s) whose questions are left out")
    p.add_argument("--format", choices=["verl", "sft"], default="verl", help="verl RL rows, or SFT conversations")
    p.add_argument(
        "--response",
        choices=list(RESPONSES),
        default="answer",
        help="--format sft: the assistant's turn, the bare answer or a worked step ending in it (64+20=84)",
    )
    p.add_argument("--out", required=True, help="parquet file to write")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        datasets = parse_datasets(a.datasets)
        settings = json.loads(a.settings)
        if not isinstance(settings, dict) or set(settings) - set(datasets):
            raise ConfigError(f"--settings {a.settings}: a JSON object keyed by datasets of --datasets")
        for name, value in settings.items():
            datasets[name] = DatasetSpec(datasets[name].weight, dict(value))
        exclude = set().union(*(questions_of(f) for f in a.exclude))
        rows = generate(datasets, a.split, a.n, a.seed, exclude)
    except (ConfigError, json.JSONDecodeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.format == "sft":
        rows = [sft_row(r, a.response) for r in rows]
    write_parquet(rows, a.out)
    start, end = seed_range(a.split, a.seed)
    print(
        f"wrote {len(rows)} {a.split} rows of {sorted(datasets)} to {a.out} (entries from seeds [{start}, {end}); "
        f"{len(exclude)} excluded questions)",
        file=sys.stderr,
    )
    return 0
