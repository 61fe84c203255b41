"""Every module of the package imports in the environment made from setup.py alone, and the
package's module boundaries hold.

CI builds that environment fresh (.ci/run), so a run-time import that setup.py does not declare
fails here instead of on a user's machine.
"""

from __future__ import annotations

import ast
import importlib
import io
import pkgutil
import tokenize
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

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


def _package_imports() -> dict[str, list[tuple[str, str]]]:
    """{module: [(imported moe_rl module, imported name or "")]}, function-level imports included."""
    root = Path(moe_rl.__file__).parent
    out: dict[str, list[tuple[str, str]]] = {}
    for path in root.rglob("*.py"):
        name = ".".join(("moe_rl", *path.relative_to(root).with_suffix("").parts)).removesuffix(".__init__")
        found = out.setdefault(name, [])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("moe_rl"):
                found += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(a.name, "") for a in node.names if a.name.startswith("moe_rl")]
    return out


def test_module_imports_form_no_cycle():
    imports = _package_imports()
    graph = {}
    for name, found in imports.items():
        targets = {f"{mod}.{attr}" if f"{mod}.{attr}" in imports else mod for mod, attr in found}
        graph[name] = {t for t in targets if t in imports and t != name and not name.startswith(t + ".")}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        pytest.fail(f"moe_rl modules import each other: {' -> '.join(e.args[1])}")


def test_no_private_name_is_imported_from_another_module():
    imports = _package_imports()
    bad = [
        f"{name}: from {mod} import {attr}"
        for name, found in imports.items()
        for mod, attr in found
        if attr.startswith("_") and f"{mod}.{attr}" not in imports
    ]
    assert not bad, "make these public in a shared module, or do not share them: " + "; ".join(bad)


def test_tools_are_leaves():
    """moe_rl/tools holds command lines; the package never depends on them."""
    bad = [
        f"{name} imports {mod}"
        for name, found in _package_imports().items()
        if not name.startswith("moe_rl.tools")
        for mod, attr in found
        if mod.startswith("moe_rl.tools") or (mod == "moe_rl" and attr == "tools")
    ]
    assert not bad, "; ".join(bad)


# The units of moe_rl (each subpackage, and each top-level module) from the bottom up: a unit imports units of
# lower layers only, function-level imports included, so no two units import each other (design.md, "Which part
# may know which"). The data flow reads upwards: rollout -> routes -> actor -> objectives -> update -> weight sync.
LAYERS = [
    {"kernels", "routing"},  # torch (and Triton) only: the fused kernels, the route contract
    {"common"},  # batch types and collective helpers every part uses
    {"sandbox"},  # runs untrusted programs in bubblewrap (torch-free); the code rewards use it
    {"reward"},  # reward functions users write, loaded by spec, run on whole samples (torch-free)
    {"objectives", "compat", "data", "models"},  # losses and corrections; reaches into megatron/vLLM; prompts
    {"actor", "rollout"},  # the Megatron actor; the vLLM engines and rollout sources (neither knows the other)
    {"weight_sync", "critic", "diagnostics"},  # actor -> engines; the value model; step hooks and the CLI
    {"config"},  # composes every part's config section (SCHEMA) and checks them together
    {"plan"},  # sizes a run from its config (moe-rl-plan, the trainer's preflight); builds nothing
    {"trainer"},  # the loop: builds the parts from the config
    {"tools"},  # command lines
]


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else module


def test_units_import_only_lower_layers():
    layer = {unit: i for i, units in enumerate(LAYERS) for unit in units}
    found = {_unit(m) for m in _package_imports() if m != "moe_rl"}
    assert found <= set(layer), f"units without a layer in LAYERS: {sorted(found - set(layer))}"
    bad = [
        f"{name} imports {mod} ({_unit(name)}, layer {layer[_unit(name)]} -> {_unit(mod)}, layer {layer[_unit(mod)]})"
        for name, imported in _package_imports().items()
        if name != "moe_rl"
        for mod, attr in imported
        for mod in [f"{mod}.{attr}" if mod == "moe_rl" else mod]
        if _unit(mod) != _unit(name) and layer[_unit(mod)] >= layer[_unit(name)]
    ]
    assert not bad, "imports against the layers (a unit imports lower layers only):\n" + "\n".join(bad)


SCHEMA = {
    "moe_rl.actor.config",
    "moe_rl.data.config",
    "moe_rl.models.config",
    "moe_rl.objectives.config",
    "moe_rl.rollout.config",
    "moe_rl.rollout.multi_turn.config",
    "moe_rl.sandbox.config",
    "moe_rl.config",
    "moe_rl.config.schema",
    "moe_rl.config.store",
    "moe_rl.config.describe",
}
"""The config schema as data: each part's section beside it (its config.py) and what moe_rl.config composes and
describes of them. They sit at the bottom of their units: they import one another and the error type only, never
the part's implementation (so `import moe_rl.config` loads no torch: tests/unit/test_config_schema.py)."""


def test_schema_modules_import_no_part():
    imports = _package_imports()
    assert SCHEMA <= set(imports), f"not modules: {sorted(SCHEMA - set(imports))}"
    allowed = SCHEMA | {"moe_rl.common.errors"}
    bad = [
        f"{name} imports {mod}"
        for name in sorted(SCHEMA)
        for mod, attr in imports[name]
        if mod not in allowed and f"{mod}.{attr}" not in allowed
    ]
    assert not bad, "the schema imports implementation modules:\n" + "\n".join(bad)


def _function_level_import_blocks(node: ast.AST, in_function: bool = False):
    """Runs of consecutive import statements inside functions (nested blocks and functions included)."""
    in_function = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    for _, value in ast.iter_fields(node):
        if in_function and isinstance(value, list):
            run = []
            for stmt in [*value, None]:
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    run.append(stmt)
                elif run:
                    yield run
                    run = []
    for child in ast.iter_child_nodes(node):
        yield from _function_level_import_blocks(child, in_function)


def _comments(source: str) -> dict[int, bool]:
    """{line: whether the comment on it is the whole line (else it trails code)}."""
    return {
        tok.start[0]: not tok.line[: tok.start[1]].strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }


def test_function_level_imports_say_why():
    """A cheap import goes at the top of its module. One inside a function stays there for a reason (a heavy or
    optional library, an import cycle or the layers, a point it must run at) that a comment says: a trailing
    comment, or a comment line directly above its block of imports."""
    root = Path(moe_rl.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        source, name = path.read_text(), path.relative_to(root.parent).as_posix()
        comments = _comments(source)
        for block in _function_level_import_blocks(ast.parse(source)):
            explained = comments.get(block[0].lineno - 1) is True
            for stmt in block:
                trailing = any(line in comments for line in range(stmt.lineno, stmt.end_lineno + 1))
                if not (explained or trailing):
                    bad.append(f"{name}:{stmt.lineno}: {ast.unparse(stmt)}")
    assert not bad, (
        "function-level imports without a comment saying why (heavy, optional, a cycle or the layers, a point it "
        "must run at; else move it to the top of the module):\n" + "\n".join(bad)
    )
