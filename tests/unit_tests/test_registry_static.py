"""The registry tells the whole truth: a static check over megatron_ext/ (registry.py aside).

Product code must not
- assign an attribute on a megatron/torch module or object it imported (``setattr`` included),
  nor adopt an instance by ``obj.__class__ = ...`` (``registry.adopt`` does that);
- import a private (underscore) megatron/torch symbol (``registry.private`` hands those out);
- read a private attribute that megatron-ext does not define itself unless the registry
  declares it as a seam;
- override a private method of a megatron/torch base class that the registry does not declare.

``test_planted_violations_are_caught`` shows each rule failing on a planted file.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib

import pytest

from megatron_ext import registry

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "megatron_ext"
FOREIGN = ("megatron", "torch")
# Underscore names that are documented public API (os._exit, namedtuple's methods).
PUBLIC_UNDERSCORE = {"_exit", "_replace", "_asdict", "_fields", "_make", "_get_ident"}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _foreign_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted megatron/torch path, for every import of the file (any scope)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in FOREIGN:
                for alias in node.names:
                    names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FOREIGN:
                    local = alias.asname or alias.name.split(".")[0]
                    names[local] = alias.name if alias.asname else local
    return names


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


@functools.lru_cache(maxsize=1)
def _defined_names() -> frozenset[str]:
    """Every name megatron-ext defines itself: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for tree in map(ast.parse, _package_sources().values()):
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return frozenset(names)


def _declared_seam_names() -> set[str]:
    """Every name on a declared seam's path (``_world`` and ``pg_map`` of ``_world.pg_map``)."""
    return {
        part.removesuffix("()")
        for seam in registry.seams()
        for part in seam.target.split(":", 1)[1].split(".")
    }


def violations(path: str, source: str, defined: set[str]) -> tuple[list[str], list[tuple]]:
    """(violations, private-method overrides of foreign bases as (where, base path, name))."""
    tree = ast.parse(source)
    foreign = _foreign_names(tree)
    declared = _declared_seam_names()
    found: list[str] = []
    overrides: list[tuple] = []
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in FOREIGN
        ):
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{where}: imports private {node.module}.{alias.name}")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                if target.attr == "__class__":
                    found.append(f"{where}: assigns __class__ (use registry.adopt)")
                root = _root(target)
                if isinstance(root, ast.Name) and root.id in foreign:
                    found.append(f"{where}: assigns {ast.unparse(target)} on {foreign[root.id]}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("setattr", "delattr")
            and node.args
        ):
            root = _root(node.args[0])
            if isinstance(root, ast.Name) and root.id in foreign:
                found.append(f"{where}: {node.func.id} on {foreign[root.id]}")
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and _is_private(node.attr)
        ):
            value = node.value
            ours = isinstance(value, ast.Name) and value.id in ("self", "cls")
            ours = ours or (
                isinstance(value, ast.Call) and getattr(value.func, "id", "") == "super"
            )
            if not ours and node.attr not in defined | declared | PUBLIC_UNDERSCORE:
                found.append(f"{where}: reads undeclared private {ast.unparse(node)}")
        if isinstance(node, ast.ClassDef):
            bases = [
                foreign[_root(b).id]
                + ("." + ast.unparse(b).split(".", 1)[1] if isinstance(b, ast.Attribute) else "")
                for b in node.bases
                if isinstance(_root(b), ast.Name) and _root(b).id in foreign
            ]
            methods = [
                item.name
                for item in node.body
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _is_private(item.name)
            ]
            overrides += [
                (f"{path}:{node.lineno} {node.name}", base, m) for base in bases for m in methods
            ]
    return found, overrides


def _import_path(dotted: str):
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def undeclared_overrides(overrides: list[tuple]) -> list[str]:
    """The private methods that a foreign base defines, overridden without a declared seam."""
    declared = []
    for seam in registry.seams("private_method_override"):
        owner, name = seam.target.rsplit(".", 1)
        declared.append((registry._resolve(owner), name))
    problems = []
    for where, base_path, name in overrides:
        base = _import_path(base_path)
        if not hasattr(base, name):
            continue  # our own private method
        if not any(name == d_name and d_owner in base.__mro__ for d_owner, d_name in declared):
            problems.append(f"{where}: overrides undeclared private {base_path}.{name}")
    return problems


@functools.lru_cache(maxsize=1)
def _package_sources() -> dict[str, str]:
    return {
        str(path.relative_to(PACKAGE.parent)): path.read_text()
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "registry.py" or path.parent != PACKAGE
    }


def test_product_code_goes_through_the_registry():
    defined = _defined_names()
    found, overrides = [], []
    for path, source in _package_sources().items():
        v, o = violations(path, source, defined)
        found += v
        overrides += o
    found += undeclared_overrides(overrides)
    assert not found, "declare these in megatron_ext/declarations.py:\n" + "\n".join(found)


PLANTED = '''
import megatron.core.parallel_state as ps
from megatron.core.tensor_parallel.random import _fork_rng
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed import distributed_c10d

ps.get_global_memory_buffer = lambda: None
setattr(ps, "x", 1)

def f(block, cls):
    block.__class__ = cls
    return distributed_c10d._world.pg_map, ps._GLOBAL_MEMORY_BUFFER

class Layer(TransformerLayer):
    def _forward_attention(self, *args):
        pass
    def _get_layer_offset(self):
        pass
    def _ours(self):
        pass
'''


def test_planted_violations_are_caught():
    found, overrides = violations("planted.py", PLANTED, _defined_names())
    problems = found + undeclared_overrides(overrides)
    text = "\n".join(problems)
    assert "imports private megatron.core.tensor_parallel.random._fork_rng" in text
    assert "assigns ps.get_global_memory_buffer on megatron.core.parallel_state" in text
    assert "setattr on megatron.core.parallel_state" in text
    assert "assigns __class__" in text
    assert "reads undeclared private ps._GLOBAL_MEMORY_BUFFER" in text
    assert "overrides undeclared private" in text and "TransformerLayer._get_layer_offset" in text
    # Declared ones pass: _world/pg_map (private_attribute), _forward_attention (override),
    # and our own private method.
    assert "_world" not in text and "_forward_attention" not in text and "_ours" not in text
    assert len(problems) == 6, text


def test_private_gives_declared_symbols_only():
    from megatron.core.tensor_parallel import random as tp_random

    assert registry.private("megatron.core.tensor_parallel.random:_fork_rng") is tp_random._fork_rng
    with pytest.raises(KeyError, match="not a declared seam"):
        registry.private("megatron.core.tensor_parallel.random:_set_cuda_rng_state")


def test_a_changed_seam_fails_loudly_naming_target_and_version(monkeypatch):
    seam = registry.Seam(
        "megatron.core.tensor_parallel.random:_fork_rng", "private_function", "test", ("device",)
    )
    monkeypatch.setitem(registry._SEAMS, seam.target, seam)
    monkeypatch.delenv(registry.ALLOW_UNVERIFIED_ENV, raising=False)
    with pytest.raises(
        registry.SeamMismatchError, match=r"_fork_rng takes \(\), written for \(device\)"
    ) as info:
        registry.verify_seams(force=True)
    assert f"found {registry.megatron_core_version()}" in str(info.value)
    monkeypatch.setenv(registry.ALLOW_UNVERIFIED_ENV, "1")
    with pytest.warns(UserWarning, match="_fork_rng"):
        registry.verify_seams(force=True)
    monkeypatch.setitem(
        registry._SEAMS, seam.target, registry.Seam(seam.target, seam.kind, "t", ())
    )
    registry.verify_seams(force=True)  # the real signature passes


def test_every_declared_seam_holds():
    assert [registry.seam_problem(s) for s in registry.seams()] == [None] * len(registry.seams())


def test_adopt_takes_only_exact_declared_classes():
    class Plain:
        pass

    with pytest.raises(TypeError, match="adopts no declared class_adoption seam"):
        registry.adopt(Plain(), type("Sub", (Plain,), {}))
    from megatron.core.transformer.transformer_block import TransformerBlock

    with pytest.raises(
        TypeError, match="only a plain megatron-core TransformerBlock can be adopted"
    ):
        registry.adopt(Plain(), type("Adopter", (TransformerBlock,), {}))
