"""The schema as the command line sees it: every key with its default and comment (`describe_keys`, what
`--keys` and `--help` print; `field_comments` reads a field's comment, the docstring under it, from the source),
and the check of command-line keys and values before Hydra composes (`check_overrides`: a typo fails with the
closest valid key)."""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
import typing
from dataclasses import fields, is_dataclass
from enum import Enum
from typing import Any

from moe_rl.common.errors import ConfigError
from moe_rl.config.schema import TrainConfig
from moe_rl.config.store import GROUPS


class ConfigKeyError(ConfigError):
    """A command-line key that is not in the schema."""


def _choices(node: Any, prefix: str = "") -> dict[str, tuple[type[Enum], bool]]:
    """{dotted key: (its Enum type, whether null is allowed)} of every key of a fixed set of values."""
    out = {}
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        value, hint = getattr(node, f.name), hints[f.name]
        if is_dataclass(value):
            out |= _choices(value, f"{prefix}{f.name}.")
            continue
        args = typing.get_args(hint) or (hint,)
        enums = [a for a in args if isinstance(a, type) and issubclass(a, Enum)]
        if enums:
            out[f"{prefix}{f.name}"] = enums[0], type(None) in args
    return out


def _schema_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of a config dataclass (instance), nested ones included."""
    keys = []
    for f in fields(node):
        key = f"{prefix}{f.name}"
        keys.append(key)
        value = getattr(node, f.name)
        if is_dataclass(value):
            keys += _schema_keys(value, key + ".")
    return keys


def field_comments(cls: type) -> dict[str, str]:
    """{field: the docstring under it} of a config dataclass (its comment: the one place a key is documented)."""
    out = {}
    for klass in reversed(cls.__mro__[:-1]):  # a subclass's comment wins
        try:
            body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        except (OSError, TypeError):
            continue
        for node, after in zip(body, body[1:], strict=False):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                    out[node.target.id] = " ".join(str(after.value.value).split())
    return out


SLOTS = {g.replace("/", ".") for g in GROUPS}
"""The dataclass-valued keys a group option fills (algorithm.loss, algorithm.correction)."""


def describe_keys(prefix: str = "", schema: type = TrainConfig) -> list[tuple[str, Any, str]]:
    """(key, default, comment) of every settable key that starts with `prefix` (`rollout`, `algorithm.loss`, ...),
    the settings of every registered loss and correction included (under algorithm.loss.* / algorithm.correction.*,
    named by option). What `launch/train_moe.py --keys` prints."""

    def walk(node: Any, at: str, label: str = "") -> list[tuple[str, Any, str]]:
        rows, comments = [], field_comments(type(node))
        for f in fields(node):
            value = getattr(node, f.name)
            if is_dataclass(value):
                continue
            shown = value.value if isinstance(value, Enum) else value  # as typed in an override
            rows.append((f"{at}{f.name}", shown, label + comments.get(f.name, "")))
        for f in fields(node):
            value = getattr(node, f.name)
            if is_dataclass(value) and f"{at}{f.name}" not in SLOTS:
                rows += walk(value, f"{at}{f.name}.")
        return rows

    rows = walk(schema(), "")
    for group, registry in GROUPS.items() if schema is TrainConfig else ():
        slot = group.replace("/", ".")
        for name, cls in sorted(registry.configs().items()):
            rows += walk(cls(), f"{slot}.", f"[{group}={name}] ")
    return [r for r in rows if r[0].startswith(prefix)]


REMOVED = {"algorithm.policy_loss": "choose the loss with the group, algorithm/loss=<name> (gspo, ppo)"}
"""Keys that were removed, with what replaces them."""


def check_overrides(overrides: list[str], schema: type = TrainConfig) -> None:
    """Refuse a command-line key that no config has, naming the closest valid one, before Hydra
    composes anything (Hydra's own message lists no alternative). Group choices
    (`algorithm=ppo_tis`, `algorithm/loss=ppo`) and `hydra.*` / `+key` / `~key` pass through."""
    known = set(_schema_keys(schema()))
    choices = _choices(schema())
    for registry_group, registry in GROUPS.items() if schema is TrainConfig else ():  # every loss's and correction's
        slot = registry_group.replace("/", ".")
        for cls in registry.configs().values():
            known |= {f"{slot}.{k}" for k in _schema_keys(cls())}
    for arg in overrides:
        if "=" not in arg or arg[0] in "+~" or arg.startswith("hydra"):
            continue
        key, value = arg.split("=", 1)
        if key in REMOVED:
            raise ConfigKeyError(f"config: {key} is gone; {REMOVED[key]}")
        if key in choices:
            enum, nullable = choices[key]
            allowed = [m.value for m in enum] + (["null"] if nullable else [])
            if value not in allowed:
                raise ConfigError(f"config {key}={value!r}: choose one of {', '.join(allowed)}")
        if "/" in key or key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ConfigKeyError(f"config: unknown key {key!r} (in {arg!r}){hint} (`--help` lists every key)")
