"""Built-in verifiable tasks: problems generated from a seed, each with a short worked solution (for SFT) and its
integer answer (for RL rewards and evaluation).

A problem's split (train / val / test) is a function of the problem's own text (a SHA-256 of it), so no seed
can put one problem in two splits; the seed only picks which problems of a split are drawn, each at most once.
Rows are `{"prompt", "response", "answer"}`: the prompt is the expression and "=", the response works it out
one operation per step and ends with the result (`12+34=46;46-5=41`), so the last integer in a response is its
answer (`moe_rl.data.rewards:numeric_answer_reward` scores it).

    python -m moe_rl.data.tasks arithmetic --split test --n 500 --seed 7 --out test.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

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
    digits: int = 2
    """Largest number of digits of an operand (1..6): operands are drawn uniformly from 0 .. 10^digits - 1."""
    operators: str = "+-"
    """Operators to draw from, any of `+-*` (e.g. "+-*")."""

    def check(self, prefix: str = "config data.arithmetic.") -> None:
        """Refuse a setting no problem can be built from, naming the key (`prefix` + its name)."""
        if self.operands < 2:
            raise ConfigError(f"{prefix}operands: {self.operands}: a problem needs at least 2 operands")
        if not 1 <= self.digits <= MAX_DIGITS:
            raise ConfigError(f"{prefix}digits: {self.digits}: choose 1 to {MAX_DIGITS}")
        unknown = sorted(set(self.operators) - set(OPERATORS))
        if unknown or not self.operators:
            raise ConfigError(
                f"{prefix}operators: {self.operators!r}: choose one or more of {OPERATORS!r}"
                + (f" ({''.join(unknown)!r} is not one)" if unknown else "")
            )

    def space(self) -> int:
        """How many distinct problems the settings allow."""
        return (10**self.digits) ** self.operands * len(set(self.operators)) ** (self.operands - 1)


@dataclass(frozen=True)
class Problem:
    prompt: str
    response: str
    answer: int

    def row(self) -> dict:
        return {"prompt": self.prompt, "response": self.response, "answer": str(self.answer)}


def split_of(text: str) -> Split:
    """The split a problem belongs to, from its text alone."""
    u = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for split, share in SPLIT_SHARES.items():
        edge += share
        if u < edge:
            return split
    return Split.test


def solve(numbers: list[int], ops: list[str]) -> tuple[str, int]:
    """The worked solution (one operation per step: products first, then sums and differences left to right)
    and the value."""
    numbers, ops, steps = list(numbers), list(ops), []
    for kinds in ("*", "+-"):
        i = 0
        while i < len(ops):
            if ops[i] in kinds:
                a, b, op = numbers[i], numbers[i + 1], ops[i]
                value = a * b if op == "*" else a + b if op == "+" else a - b
                steps.append(f"{a}{op}{b}={value}")
                numbers[i : i + 2] = [value]
                del ops[i]
            else:
                i += 1
    return ";".join(steps), numbers[0]  # no spaces: the byte-level tokenizer keeps every digit a token


def arithmetic_problem(rng: random.Random, cfg: ArithmeticConfig) -> Problem:
    numbers = [rng.randrange(10**cfg.digits) for _ in range(cfg.operands)]
    ops = [rng.choice(cfg.operators) for _ in range(cfg.operands - 1)]
    prompt = "".join(f"{n}{op}" for n, op in zip(numbers, ops, strict=False)) + f"{numbers[-1]}="
    response, answer = solve(numbers, ops)
    return Problem(prompt, response, answer)


def check_count(cfg: ArithmeticConfig, split: Split | str, n: int) -> None:
    """Refuse `n` problems of `split` when the split holds too few (with a margin: drawing the last few of a small
    split by rejection would take long)."""
    available = int(cfg.space() * SPLIT_SHARES[Split(split)])
    if n > available // 2:
        raise ConfigError(
            f"{n} {split} problems asked of about {available} distinct ones with operands={cfg.operands}, "
            f"digits={cfg.digits}, operators={cfg.operators!r}: ask for at most {available // 2}, or widen the task"
        )


def generate(cfg: ArithmeticConfig, split: Split | str, n: int, seed: int) -> list[Problem]:
    """`n` distinct problems of `split`, drawn with `seed`."""
    cfg.check()
    split = Split(split)
    check_count(cfg, split, n)
    rng = random.Random(f"arithmetic:{split}:{seed}")
    seen: set[str] = set()
    out = []
    while len(out) < n:
        p = arithmetic_problem(rng, cfg)
        if p.prompt not in seen and split_of(p.prompt) == split:
            seen.add(p.prompt)
            out.append(p)
    return out


TASKS = {"arithmetic": ArithmeticConfig}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_rl.data.tasks",
        description="Write a split of a built-in task as jsonl rows {prompt, response, answer}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python -m moe_rl.data.tasks arithmetic --split test --n 500 --seed 7 --out test.jsonl\n"
        "  python -m moe_rl.data.tasks arithmetic --split train --n 20000 --operands 3 --digits 2 "
        "--operators '+-*' --out train.jsonl",
    )
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--split", choices=[s.value for s in Split], default="train")
    parser.add_argument("--n", type=int, default=1000, help="problems to write (distinct)")
    parser.add_argument("--seed", type=int, default=0, help="which problems of the split are drawn")
    parser.add_argument("--out", default="-", help="jsonl file, or - for standard output")
    for name, value in asdict(ArithmeticConfig()).items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    args = parser.parse_args(argv)
    cfg = ArithmeticConfig(**{k: getattr(args, k) for k in asdict(ArithmeticConfig())})
    try:
        cfg.check(prefix="--")
        problems = generate(cfg, args.split, args.n, args.seed)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = "".join(json.dumps(p.row()) + "\n" for p in problems)
    if args.out == "-":
        sys.stdout.write(lines)
    else:
        Path(args.out).write_text(lines)
        print(f"wrote {len(problems)} {args.split} problems to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
