"""Name -> function registries, so a new loss, correction or advantage estimator is one
decorated function (plus, for losses and corrections, its config dataclass) selected by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
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
            self._fns[name] = fn
            self._meta[name] = meta
            if config is not None:
                self._configs[name] = config
            return fn

        return deco

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


POLICY_LOSSES: Registry = Registry("policy loss")
CORRECTIONS: Registry = Registry("mismatch correction")
ADVANTAGES: Registry = Registry("advantage estimator")
