"""Patches of upstream code live in moe_rl/compat/ only, where compat/versions.py lists each with the versions it was
tested for (docs/development/architecture.md, "Patches of upstream code"). Outside compat/, no module

(a) imports or reads a private name (a module or attribute starting with `_`; dunders such as `__version__` are
    public) of vLLM, megatron-core or transformers: such names change between releases without notice. torch is
    left out: setup.py pins it to one release (torch==2.13.0), so its private names
    (`torch._utils._flatten_dense_tensors` in actor/train_step.py, `torch.cpu._is_amx_tile_supported` in
    common/platform.py) cannot move under an install that keeps the pins;
(b) patches an object it does not own: assigns or deletes a method-named attribute (`forward`, `step`, any method of
    torch.nn.Module or torch.optim.Optimizer) or a function (lambda, nested def, functools.partial) on another object
    than `self`/`cls`, assigns to an attribute of an imported upstream module (vllm, megatron, transformers, torch),
    or calls `setattr` (whose target and name the check cannot see), but for the allow-list below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import moe_rl

ROOT = Path(moe_rl.__file__).parent
PRIVATE_UPSTREAM = ("vllm", "megatron", "transformers")
PATCHABLE_MODULES = (*PRIVATE_UPSTREAM, "torch")
METHOD_NAMES = (
    {"forward", "step", "generate", "__call__", "__init__"}
    | {n for n in dir(torch.nn.Module) if callable(getattr(torch.nn.Module, n))}
    | {n for n in dir(torch.optim.Optimizer) if callable(getattr(torch.optim.Optimizer, n))}
)
# setattr calls outside compat/ that set data fields of a config or namespace by a name held in a variable (none
# patches a method): (file, the call's first argument as written).
SETATTR_ALLOWED = {
    ("actor/model.py", "config"),  # megatron's TransformerConfig: the converter's YaRN fields, which GPTModel reads
    ("plan/search.py", "getattr(cfg, section)"),  # moe-rl's own config sections: one candidate layout's keys
    ("plan/layout.py", "cfg.algorithm"),  # moe-rl's own config: the config group the command line picked
    ("tools/tiny_model.py", "a"),  # the command line's argparse namespace: a size preset's defaults
}


def _outside_compat() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.relative_to(ROOT).parts[0] != "compat")


def _root(dotted: str) -> str:
    return dotted.split(".")[0]


def _upstream_names(tree: ast.AST, roots: tuple[str, ...]) -> set[str]:
    """Names the file binds to an import from one of `roots` (modules or their attributes)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or _root(a.name) for a in node.names if _root(a.name) in roots}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _root(node.module or "") in roots:
            names |= {a.asname or a.name for a in node.names}
    return names


def _chain_root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # __version__ is public


def _private_reads(tree: ast.AST, rel: str) -> list[str]:
    bad = []
    upstream = _upstream_names(tree, PRIVATE_UPSTREAM)
    for node in ast.walk(tree):
        found = None
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if _root(a.name) in PRIVATE_UPSTREAM]
            found = ", ".join(n for n in names if any(_private(part) for part in n.split("."))) or None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _root(node.module or "") in PRIVATE_UPSTREAM:
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found = f"from {node.module} import {', '.join(a.name for a in node.names)}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = _chain_root(node)
            if isinstance(root, ast.Name) and root.id in upstream:
                found = ast.unparse(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):  # importlib.import_module("vllm._C")
            parts = node.value.split(".")
            if parts[0] in PRIVATE_UPSTREAM and len(parts) > 1 and any(_private(p) for p in parts):
                found = repr(node.value)
        if found:
            bad.append(f"{rel}:{node.lineno}: {found}")
    return bad


def _patches(tree: ast.AST, rel: str) -> list[str]:
    bad = []
    modules = _upstream_names(tree, PATCHABLE_MODULES)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}

    def is_function(value: ast.expr | None) -> bool:
        if isinstance(value, ast.Lambda) or (isinstance(value, ast.Name) and value.id in functions):
            return True
        return isinstance(value, ast.Call) and ast.unparse(value.func) in ("functools.partial", "partial")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Delete):
            targets, value = node.targets, None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if (rel, ast.unparse(node.args[0])) not in SETATTR_ALLOWED:
                bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            continue
        else:
            continue
        for target in targets:
            for t in ast.walk(target):
                if not isinstance(t, ast.Attribute) or not isinstance(t.ctx, (ast.Store, ast.Del)):
                    continue
                root = _chain_root(t)
                if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    continue
                if t.attr in METHOD_NAMES or is_function(value) or (isinstance(root, ast.Name) and root.id in modules):
                    bad.append(f"{rel}:{node.lineno}: {ast.unparse(t)}")
    return bad


@pytest.mark.parametrize("check", [_private_reads, _patches], ids=["private-upstream-names", "patches"])
def test_upstream_internals_are_reached_from_compat_only(check):
    bad = []
    for path in _outside_compat():
        bad += check(ast.parse(path.read_text()), path.relative_to(ROOT).as_posix())
    assert not bad, "reach into upstream code from moe_rl/compat/ (listed in compat/versions.py):\n" + "\n".join(bad)


@pytest.mark.parametrize(
    "source",
    [
        "import vllm._custom_ops as ops",
        "from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias",
        "import vllm\nv = vllm.v1._private",
        "from megatron.core.tensor_parallel import random as r\nr._CUDA_RNG_STATE_TRACKER",
        "import importlib\nimportlib.import_module('vllm._C')",
    ],
)
def test_the_check_finds_private_upstream_names(source):
    assert _private_reads(ast.parse(source), "x.py")


@pytest.mark.parametrize(
    "source",
    [
        "def f(layer):\n    layer.forward = g",
        "def f(engine):\n    engine.step = g",
        "def f(rope):\n    del rope.forward",
        "def f(m):\n    m.helper = lambda: 0",
        "import torch\ntorch.cuda.current_device = f",
        "from megatron.core.transformer.moe import moe_utils\nmoe_utils.te_general_gemm = None",
        "setattr(obj, 'forward', f)",
    ],
)
def test_the_check_finds_patches(source):
    assert _patches(ast.parse(source), "x.py")


def test_the_check_leaves_own_state_and_data_fields_alone():
    source = "class A:\n    def f(self, batch):\n        self.step = 1\n        self.forward = 2\n        batch.m = 3"
    assert not _patches(ast.parse(source), "x.py")
