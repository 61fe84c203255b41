"""Errors shared by the parts."""

from __future__ import annotations

from typing import NoReturn


class ConfigError(ValueError):
    """A setting that cannot run, found before anything is built: the message names the key. The launcher prints
    it as one line, without a traceback."""


def refuse(key: str, message: str) -> NoReturn:
    """Raise the ConfigError of setting `key`: `config <key>: <message>`."""
    raise ConfigError(f"config {key}: {message}")
