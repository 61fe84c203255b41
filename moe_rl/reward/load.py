"""A reward spec (`module:function` or `path/to/reward.py:function`) -> the function and the form it is written in,
told from its signature without calling it.

The forms (docs/guides/reward-functions.md):
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict` (per sample; a dict
  holds "score" and extra metrics);
- TRL: `f(prompts, completions, completion_ids, **columns) -> list[float | None]` (batched; None: not scored);
- moe-rl batched: `f(responses, answers, response_ids) -> list[float]`, and per sample, marked `@per_sample`:
  `f(response, answer, response_ids) -> float`; either may take an optional `samples=` (batched) / `sample=`
  (per sample) keyword to see the whole Sample.

A URL (`http://HOST:PORT`, `https://...`) names a reward service (moe-rl-reward-server, moe_rl/reward/service): its
form is the server's business, so nothing is inspected here (its health is checked when the RewardSet starts).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    """The form a reward function is written in."""

    verl = "verl"  # compute_score(data_source, solution_str, ground_truth, extra_info=None), per sample
    trl = "trl"  # f(prompts, completions, completion_ids, **columns), batched
    batched = "batched"  # moe-rl's f(responses, answers, response_ids)
    per_sample = "per_sample"  # moe-rl's @per_sample f(response, answer, response_ids)
    remote = "remote"  # a reward service at http(s)://HOST:PORT, scored by moe_rl.reward.service.client


FORMS = (
    "  verl:    def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict\n"
    "  TRL:     def reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]\n"
    "  moe-rl:  def reward(responses, answers, response_ids) -> list[float]   (or @per_sample "
    "def reward(response, answer, response_ids) -> float)"
)
"""The three signatures, as an error shows them."""

VERL_PARAMS = ("data_source", "solution_str", "ground_truth")
TRL_PARAMS = ("prompts", "completions", "completion_ids")


class RewardLoadError(ValueError):
    """A reward spec that does not name a usable function (the message names the spec and what is wrong)."""


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function and how to call it."""

    spec: str  # as loaded: a file path made absolute, so a worker process loads the same file
    fn: Callable
    kind: Kind
    is_async: bool
    takes_samples: bool  # moe-rl forms: the optional samples= / sample= keyword
    accepts: frozenset[str] | None  # TRL form: the keywords it takes (None: any, it has **kwargs)

    @property
    def name(self) -> str:
        if self.kind is Kind.remote:  # its functions' own names come back with the server's metrics
            return self.spec
        return getattr(self.fn, "__name__", None) or self.spec.rsplit(":", 1)[-1]

    @property
    def per_sample(self) -> bool:
        """Called once per sample (verl, @per_sample), not once per batch."""
        return self.kind in (Kind.verl, Kind.per_sample)

    @property
    def in_pool(self) -> bool:
        """Runs in the worker processes: synchronous and per sample."""
        return self.per_sample and not self.is_async


def load_function(spec: str) -> Callable:
    """`module:function` or `path/to/file.py:function` -> the function (RewardLoadError naming what is missing)."""
    if ":" not in spec:
        raise RewardLoadError(f"{spec!r} must look like 'module:function' or 'path/to/reward.py:function'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        module = _file_module(spec, where)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise RewardLoadError(f"{spec!r} cannot be loaded: {e}") from e
    if not hasattr(module, name):
        raise RewardLoadError(f"{spec!r}: {where} has no function {name!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardLoadError(f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn


def _file_module(spec: str, path: str):
    """The module of a reward file, imported once per process under a name of its own (its path's hash)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise RewardLoadError(f"{spec!r}: reward file {path} does not exist")
    name = f"moe_rl_reward_file_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look the module up by name
    try:
        loader_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardLoadError(f"{spec!r}: reward file {path} failed to import: {type(e).__name__}: {e}") from e
    return module


def absolute_spec(spec: str) -> str:
    """`spec` with a file path made absolute (a worker process, or a later chdir, loads the same file)."""
    where, _, name = spec.rpartition(":")
    if where.endswith(".py") or os.sep in where:
        return f"{os.path.abspath(where)}:{name}"
    return spec


def is_remote(spec: str) -> bool:
    """Whether `spec` names a reward service (an http:// or https:// URL) rather than a function."""
    return spec.startswith(("http://", "https://"))


def service_url(spec: str) -> str:
    """A reward service's URL as the client uses it (no trailing slash), or RewardLoadError saying what is wrong."""
    url = urllib.parse.urlsplit(spec)
    try:
        url.port  # noqa: B018 -- raises ValueError on a port that is no number
    except ValueError as e:
        raise RewardLoadError(f"{spec!r}: {e}; a reward service is named as http://HOST:PORT") from None
    if not url.hostname or url.query or url.fragment:
        raise RewardLoadError(f"{spec!r}: a reward service is named as http://HOST:PORT (or https://HOST:PORT)")
    return spec.rstrip("/")


def remote_marker(*args, **kwargs):
    """The `fn` of a reward service's RewardFunction: never called (the RewardSet sends its samples to the URL)."""
    raise RuntimeError("a reward service is scored through moe_rl.reward.service.client, not called")


def load(spec: str) -> RewardFunction:
    """Load `spec` and tell its form from its signature (the function is not called); a signature that matches
    none of the three forms is refused, showing them. A URL is a reward service (Kind.remote), not loaded."""
    if is_remote(spec):
        return RewardFunction(service_url(spec), remote_marker, Kind.remote, False, False, None)
    spec = absolute_spec(spec)
    fn = load_function(spec)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise RewardLoadError(f"{spec!r}: its signature cannot be read ({e}); write it in one of:\n{FORMS}") from e
    kind, takes_samples, accepts = signature_kind(fn, sig)
    if kind is None:
        raise RewardLoadError(
            f"{spec!r}: the signature {fn.__name__}{sig} matches none of the reward forms; write it as one of:\n{FORMS}"
        )
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    return RewardFunction(spec, fn, kind, is_async, takes_samples, accepts)


def signature_kind(fn: Callable, sig: inspect.Signature) -> tuple[Kind | None, bool, frozenset[str] | None]:
    """(the form `fn` is written in or None, whether it takes samples=/sample=, the TRL keywords it takes)."""
    params = sig.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if getattr(fn, "reward_per_sample", False):
        return (Kind.per_sample if _binds(sig, 3) else None), "sample" in params, None
    if all(name in params for name in VERL_PARAMS):
        verl = {name: None for name in VERL_PARAMS}
        return (Kind.verl if _binds(sig, 0, verl) else None), False, None
    if "completions" in params:
        accepts = None if var_kw else frozenset(params)
        trl = {name: None for name in TRL_PARAMS if var_kw or name in params}
        return (Kind.trl if _binds(sig, 0, trl) else None), False, accepts
    if _binds(sig, 3):
        return Kind.batched, "samples" in params, None
    return None, False, None


def _binds(sig: inspect.Signature, positional: int, keywords: dict | None = None) -> bool:
    """Whether a call with `positional` arguments and `keywords` fits `sig` (nothing else required)."""
    try:
        sig.bind(*([None] * positional), **(keywords or {}))
    except TypeError:
        return False
    return True
