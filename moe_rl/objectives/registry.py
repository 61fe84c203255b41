"""Name -> function registries, so a new loss, correction or advantage estimator is one
decorated function selected by name from the config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, F] = {}
        self._meta: dict[str, dict] = {}

    def register(self, name: str, **meta) -> Callable[[F], F]:
        """`meta`: facts config validation reads (e.g. an advantage estimator's `needs_groups`)."""

        def deco(fn: F) -> F:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            self._meta[name] = meta
            return fn

        return deco

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
