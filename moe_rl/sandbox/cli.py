"""`moe-rl-sandbox run PROGRAM.py`: run one program in the sandbox by hand and print how it ended as one JSON line
(exit status 0 iff the program passed). Imports no torch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from moe_rl.sandbox.config import MIB, Limits
from moe_rl.sandbox.runner import SandboxUnavailable, check_available, run_program

EXAMPLES = """\
examples:
  moe-rl-sandbox run solution.py
  moe-rl-sandbox run solution.py --stdin input.txt --timeout 5 --memory-mib 512
  moe-rl-sandbox run solution.py --show-output          # the program's stdout and stderr on this stderr

The JSON line: {"status": "passed|failed|timeout|crashed|oom", "exit_code": ..., "seconds": ...,
"stdout_bytes": ..., ...}; --timeout is the wall time of the whole command (and the program's CPU seconds).
The program sees no network, no file of this machine but /usr, and a private /tmp (its cwd): docs/guides/sandbox.md.
"""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-rl-sandbox",
        description="Run an untrusted Python program in moe-rl's bubblewrap sandbox.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one program", epilog=EXAMPLES, formatter_class=p.formatter_class)
    run.add_argument("program", type=Path, help="the Python file to run (as /tmp/main.py in the sandbox)")
    run.add_argument("--stdin", type=Path, help="a file given to the program as its stdin (default: empty)")
    run.add_argument("--timeout", type=float, default=Limits.wall_s, help="wall and CPU seconds (default %(default)s)")
    run.add_argument("--memory-mib", type=int, default=Limits.memory_mib, help="address space (default %(default)s)")
    run.add_argument("--processes", type=int, default=Limits.processes, help="processes (default %(default)s)")
    run.add_argument("--output-mib", type=int, default=Limits.output_bytes // MIB, help="kept stdout/stderr MiB")
    run.add_argument("--python", default="/usr/bin/python3", help="the interpreter, under /usr (%(default)s)")
    run.add_argument("--show-output", action="store_true", help="write the program's stdout and stderr to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()  # --timeout bounds the whole command, the availability check included
    args = parser().parse_args(argv)
    try:
        source = args.program.read_text()
        stdin = args.stdin.read_bytes() if args.stdin else b""
    except OSError as e:
        print(f"moe-rl-sandbox: {e}", file=sys.stderr)
        return 2
    limits = Limits(
        wall_s=args.timeout,
        cpu_s=args.timeout,
        memory_mib=args.memory_mib,
        processes=args.processes,
        output_bytes=args.output_mib * MIB,
    )
    try:
        limits.check(prefix="--")
        check_available()
    except (ValueError, SandboxUnavailable) as e:
        print(f"moe-rl-sandbox: {e}", file=sys.stderr)
        return 2
    limits = replace(limits, wall_s=max(0.001, args.timeout - (time.monotonic() - start)))
    result = run_program(source, stdin, limits, args.python)
    if args.show_output:
        sys.stderr.buffer.write(result.stdout + result.stderr)
        sys.stderr.flush()
    print(json.dumps(result.as_json()), flush=True)
    return 0 if result.status == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
