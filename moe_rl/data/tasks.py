"""Built-in verifiable tasks: problems generated from a seed, each with a short worked solution (for SFT) and its
integer answer (for RL rewards and evaluation).

A problem's split (train / val / test) is a function of the problem's own text (a SHA-256 of it), so no seed
can put one problem in two splits; the seed only picks which problems of a split are drawn, each at most once.
Rows are `{"prompt", "response", "answer"}`: the prompt is the expression and "=", the response works it out
one operation per step and ends with the result (`12+34=46;46-5=41`), so the last integer in a response is its
answer (`moe_rl.data.rewards:numeric_answer_reward` scores it).

    python -m moe_rl.data.tasks arithmetic --split test --n 500 --seed 7 --out test.jsonl

`python -m moe_rl.data.tasks reasoning_gym ...` writes reasoning-gym datasets as verl parquet
(moe_rl/data/reasoning_gym_files.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from moe_rl.common.errors import ConfigError
from moe_rl.data import reasoning_gym_files
from moe_rl.data.config import SPLIT_SHARES, ArithmeticConfig, Split, check_count


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
    count = rng.choice(cfg.counts()) if cfg.max_operands else cfg.operands  # one draw fewer: the same problems
    numbers = [rng.randrange(10**cfg.digits) for _ in range(count)]
    ops = [rng.choice(cfg.operators) for _ in range(count - 1)]
    prompt = "".join(f"{n}{op}" for n, op in zip(numbers, ops, strict=False)) + f"{numbers[-1]}="
    response, answer = solve(numbers, ops)
    return Problem(prompt, response, answer)


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
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["reasoning_gym"]:  # its own options (datasets, settings, verl parquet): reasoning_gym_files.py
        return reasoning_gym_files.main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m moe_rl.data.tasks",
        description="Write a split of a built-in task as jsonl rows {prompt, response, answer}.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python -m moe_rl.data.tasks arithmetic --split test --n 500 --seed 7 --out test.jsonl\n"
        "  python -m moe_rl.data.tasks arithmetic --split train --n 20000 --operands 3 --digits 2 "
        "--operators '+-*' --out train.jsonl\n"
        "  python -m moe_rl.data.tasks reasoning_gym --help   # reasoning-gym datasets as verl parquet",
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
