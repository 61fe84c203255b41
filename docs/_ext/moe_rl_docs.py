"""Reference pages generated at build time, so they cannot drift from the code.

A page asks for generated content with a MyST comment line, replaced when Sphinx reads the page:

    % moe-rl-docs: config-keys        every key of `moe_rl.config.describe_keys("")`: key, default, comment
    % moe-rl-docs: config-keys sft    the same for the SFT config (`SFTConfig`, launch/sft_moe.py)
    % moe-rl-docs: cli <name>         the `--help` output of a command in CLI_COMMANDS

The keys come from the dataclasses through `describe_keys` (what `launch/train_moe.py --keys` prints); the help
texts from running each command with `--help` in two subprocesses started with the build (none starts an
engine). Pages holding a marker, and the autodoc pages, are read again on every build.

Docstrings shown by autodoc are plain text in this code base, not reStructuredText: they are rendered as
preformatted blocks, so a `*` or an indented line in a docstring can never break the build.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^% moe-rl-docs: (?P<what>[a-z-]+)(?: (?P<arg>.+?))?\s*$", re.MULTILINE)

# name on the page -> how to run it with --help: a script run on its own, or a module's argparse main, all of which
# run in one helper process (one import of torch for all of them)
CLI_SCRIPTS: dict[str, list[str]] = {
    "train_moe": ["launch/train_moe.py", "--help"],
    "sft_moe": ["launch/sft_moe.py", "--help"],
}
CLI_MODULES: dict[str, list[str]] = {
    "moe-rl-diagnose": ["moe_rl.diagnostics", "--help"],
    "moe-rl-diagnose live": ["moe_rl.diagnostics", "live", "--help"],
    "moe-rl-diagnose offline": ["moe_rl.diagnostics", "offline", "--help"],
    "moe-rl-diagnose compare": ["moe_rl.diagnostics", "compare", "--help"],
    "moe-rl-tiny-model": ["moe_rl.tools.tiny_model", "--help"],
    "moe-rl-export-hf": ["moe_rl.tools.export_hf", "--help"],
    "moe-rl-plan": ["moe_rl.plan.cli", "--help"],
    "moe-rl-chaos": ["moe_rl.tools.chaos", "--help"],
    "logprobs": ["moe_rl.tools.logprobs", "--help"],
    "tasks": ["moe_rl.data.tasks", "--help"],
    "evaluate": ["moe_rl.tools.evaluate", "--help"],
    "moe-rl-sandbox run": ["moe_rl.sandbox.cli", "run", "--help"],
}
CLI_COMMANDS = [*CLI_SCRIPTS, *CLI_MODULES]

# Runs `python -m <module> <args>` for each entry of a JSON list in this one process and prints {name: stdout}.
_MODULE_HELPS = """
import contextlib, io, json, runpy, sys
out = {}
for name, (module, *args) in json.loads(sys.argv[1]).items():
    sys.argv, text = [module, *args], io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (0, None):
                raise
    out[name] = text.getvalue()
print(json.dumps(out))
"""

_MD_SPECIAL = set("\\`*_{}[]<>()#+-!|~$&")


def escape_markdown(text: str) -> str:
    """`text` as literal Markdown; spans between backtick pairs stay code spans."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans
        parts = [text]
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(code(part))
        else:
            out.append("".join("\\" + c if c in _MD_SPECIAL else c for c in part))
    return "".join(out)


def code(text: str) -> str:
    """A Markdown code span holding `text` exactly."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def default_text(value) -> str:
    """A default as it is written in an override: null, true/false, an Enum by its value, else repr."""
    if isinstance(value, Enum):
        return default_text(value.value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def config_keys_markdown(schema: str = "") -> str:
    """Every config key, by top-level section (the settings of each registered loss and correction under a
    heading of their own, `algorithm/loss=<name>`): the key and its default (as an override writes it), then its
    comment."""
    from moe_rl.config import SFTConfig, TrainConfig
    from moe_rl.config.describe import describe_keys

    sections: dict[str, dict[str, list[str]]] = {}  # section -> group choice ("" for none) -> lines
    for key, default, comment in describe_keys("", {"": TrainConfig, "sft": SFTConfig}[schema]):
        choice = ""
        label = re.match(r"\[([^\]]+)\] ", comment)
        if label:  # describe_keys names the group choice a key belongs to: "[algorithm/loss=gspo] ..."
            choice, comment = label.group(1), comment[label.end() :]
        lines = sections.setdefault(key.split(".")[0], {}).setdefault(choice, [])
        lines += [f"{code(key)} = {code(default_text(default))}", f": {escape_markdown(' '.join(comment.split()))}", ""]
    out = []
    for section, choices in sections.items():
        out += [f"## `{section}`", ""]
        for choice, lines in choices.items():
            out += [f"### `{choice}`", ""] if choice else []
            out += lines
    return "\n".join(out)


def _run(argv: list[str]) -> str:
    env = dict(os.environ, COLUMNS="100", PYTHONWARNINGS="ignore", VLLM_CONFIGURE_LOGGING="0")
    for _ in range(2):  # once more if a signal from outside ended it
        done = subprocess.run(
            [sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        if done.returncode >= 0:
            break
    if done.returncode != 0:
        raise RuntimeError(f"`python {' '.join(argv)[:200]}` failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


_pool: ThreadPoolExecutor | None = None
_futures: dict = {}


def start_help() -> None:
    """Start the `--help` subprocesses (two, concurrently, once per build) while Sphinx reads the pages."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(1 + len(CLI_SCRIPTS))
        _futures.update({name: _pool.submit(_run, argv) for name, argv in CLI_SCRIPTS.items()})
        _futures["modules"] = _pool.submit(_run, ["-c", _MODULE_HELPS, json.dumps(CLI_MODULES)])


def help_text(name: str) -> str:
    start_help()
    text = json.loads(_futures["modules"].result())[name] if name in CLI_MODULES else _futures[name].result()
    return text.rstrip() + "\n"


def cli_markdown(name: str) -> str:
    if name not in CLI_COMMANDS:
        raise ValueError(f"moe-rl-docs: cli {name!r}: not in CLI_COMMANDS ({', '.join(CLI_COMMANDS)})")
    text = help_text(name)
    fence = "`" * max(3, max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    return f"{fence}text\n{text}{fence}\n"


def _expand(app, docname: str, source: list[str]) -> None:
    if "% moe-rl-docs:" not in source[0] and ".. automodule::" not in source[0]:
        return
    # read again on every build: the code may have changed since
    app.env.moe_rl_generated = getattr(app.env, "moe_rl_generated", set()) | {docname}

    def replace(m: re.Match) -> str:
        what, arg = m.group("what"), m.group("arg")
        if what == "config-keys":
            return config_keys_markdown(arg or "")
        if what == "cli":
            return cli_markdown(arg or "")
        raise ValueError(f"{docname}: unknown generated content {what!r}")

    source[0] = MARKER.sub(replace, source[0])


def _always_outdated(app, env, added, changed, removed) -> list[str]:
    return sorted(getattr(env, "moe_rl_generated", set()) - set(removed))


def _start_help(app) -> None:
    if any(MARKER.search(p.read_text()) for p in Path(app.srcdir).rglob("*.md") if "_build" not in p.parts):
        start_help()


def _docstring_as_text(app, what, name, obj, options, lines: list[str]) -> None:
    if name.startswith("moe_rl") and any(line.strip() for line in lines):
        lines[:] = ["::", "", *(f"   {line}" if line.strip() else "" for line in lines), ""]


def setup(app):
    app.connect("builder-inited", _start_help)
    app.connect("source-read", _expand)
    app.connect("env-get-outdated", _always_outdated)
    app.connect("autodoc-process-docstring", _docstring_as_text)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
