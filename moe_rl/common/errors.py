"""Errors shared by the parts."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting that cannot run, found before anything is built: the message names the key. The launcher prints
    it as one line, without a traceback."""
