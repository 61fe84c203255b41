"""Name -> function registries, so a new loss, correction or advantage estimator is one
decorated function (plus, for losses and corrections, its config dataclass) selected by name.

The names and config dataclasses are also listed, torch-free, in moe_rl/objectives/config.py (the config schema's
view, `Choices`); a registry built on such a list refuses an entry that the list does not name alike."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from moe_rl.objectives.config import ADVANTAGE_NAMES, CORRECTION_NAMES, POLICY_LOSS_NAMES, Choices

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str, choices: Choices | None = None):
        """`choices`: the schema's list of this registry's names (objectives/config.py); None: any name."""
        self.kind = kind
        self.choices = choices
        self._fns: dict[str, F] = {}
        self._meta: dict[str, dict] = {}
        self._configs: dict[str, type] = {}

    def register(self, name: str, config: type | None = None, **meta) -> Callable[[F], F]:
        """`config`: the dataclass of the entry's settings (its fields' defaults are the entry's
        defaults; the config group `algorithm/<kind>` offers it by `name`). `meta`: facts config
        validation reads (e.g. an advantage estimator's `needs_groups`)."""

        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if config is not None and config in self._configs.values():
                raise ValueError(f"{self.kind} {name!r}: config {config.__name__} already belongs to another entry")
            self._check_choices(name, config, meta)
            self._fns[name] = fn
            self._meta[name] = meta
            if config is not None:
                self._configs[name] = config
            return fn

        return deco

    def _check_choices(self, name: str, config: type | None, meta: dict) -> None:
        """The entry is the one the schema's list names: same name, same config dataclass, same facts."""
        if self.choices is None:
            return
        where = f"moe_rl/objectives/config.py ({self.choices.kind} names)"
        if name not in self.choices:
            raise ValueError(f"{self.kind} {name!r} is not listed in {where}: add it there with its config")
        listed = self.choices.config_of(name)
        if config is not listed:
            got, want = getattr(config, "__name__", None), getattr(listed, "__name__", None)
            raise ValueError(f"{self.kind} {name!r}: registered with config {got}, but {where} lists {want}")
        facts = {key: value for key, value in meta.items() if key.startswith("needs_")}
        if facts != self.choices.facts(name):
            listed_facts = self.choices.facts(name)
            raise ValueError(f"{self.kind} {name!r}: registered with {facts}, but {where} lists {listed_facts}")

    def unregister(self, name: str) -> None:
        """Remove an entry (tests that register their own)."""
        self.get(name)
        for table in (self._fns, self._meta, self._configs):
            table.pop(name, None)

    def config_class(self, name: str) -> type:
        self.get(name)
        if name not in self._configs:
            raise ValueError(f"{self.kind} {name!r} was registered without a config dataclass")
        return self._configs[name]

    def configs(self) -> dict[str, type]:
        """name -> config dataclass of every entry that has one."""
        return dict(self._configs)

    def name_of(self, config: object) -> str:
        """The registered name whose config dataclass `config` is an instance of."""
        for name, cls in self._configs.items():
            if type(config) is cls:
                return name
        raise ValueError(
            f"{type(config).__name__} is not the config of any registered {self.kind} "
            f"(registered: {sorted(self._configs)})"
        )

    def get(self, name: str) -> F:
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {sorted(self._fns)}")
        return self._fns[name]

    def meta(self, name: str) -> dict:
        self.get(name)
        return self._meta[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: str) -> bool:
        return name in self._fns


POLICY_LOSSES: Registry = Registry("policy loss", POLICY_LOSS_NAMES)
CORRECTIONS: Registry = Registry("mismatch correction", CORRECTION_NAMES)
ADVANTAGES: Registry = Registry("advantage estimator", ADVANTAGE_NAMES)
