"""Every module of the package imports in the environment made from setup.py alone.

CI builds that environment fresh (.ci/run), so a run-time import that setup.py does not declare
fails here instead of on a user's machine.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import moe_rl
from moe_rl import kernels  # installed from the top-level kernels/ folder

MODULES = sorted(
    {"moe_rl.kernels"}
    | {m.name for m in pkgutil.walk_packages(moe_rl.__path__, prefix="moe_rl.")}
    | {m.name for m in pkgutil.walk_packages(kernels.__path__, prefix="moe_rl.kernels.")}
)


def test_the_package_has_its_parts():
    for part in ("moe_rl.kernels", "moe_rl.trainer.loop", "moe_rl.rollout.engine", "moe_rl.data.prompts"):
        assert part in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name):
    importlib.import_module(name)
