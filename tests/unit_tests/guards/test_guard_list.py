"""megatron_ext.guards.GUARDS is the one list of guards: every entry resolves to the code that
enforces it, and every function in the package that rejects a combination
(NotImplementedError / UnsupportedCombinationError) is in the list."""

import ast
import importlib
import pathlib
import types

import pytest

from megatron_ext import guards

PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "megatron_ext"
# Harness code, not product guards.
NOT_GUARDS = {"megatron_ext.testing"}
REJECTING = {"NotImplementedError", "UnsupportedCombinationError"}


def _rejecting_functions() -> set[str]:
    """``module:qualname`` of every function whose own body raises a rejecting error."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        text = path.read_text()
        if any(module.startswith(prefix) for prefix in NOT_GUARDS) or not any(
            name in text for name in REJECTING
        ):
            continue

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    raises = {
                        getattr(r.exc.func, "attr", getattr(r.exc.func, "id", None))
                        for r in ast.walk(child)
                        if isinstance(r, ast.Raise) and isinstance(r.exc, ast.Call)
                    }
                    if raises & REJECTING:
                        # visit() runs within this loop iteration, so module is the current one.
                        found.add(f"{module}:{prefix}{child.name}")  # noqa: B023

        visit(ast.parse(text), "")
    return found


def _resolve(target: str):
    module, qualname = target.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_guard_resolves_and_is_listed_once():
    checks = [g.check for g in guards.GUARDS]
    assert len(checks) == len(set(checks))
    for guard in guards.GUARDS:
        assert callable(_resolve(guard.check)), guard
        assert guard.stage in ("config", "recipe", "spec", "build", "forward", "load", "inference")


def test_every_rejecting_function_is_a_listed_guard():
    missing = _rejecting_functions() - {g.check for g in guards.GUARDS}
    assert not missing, f"add these to megatron_ext.guards.GUARDS: {sorted(missing)}"


def test_cuda_graphs_are_refused_once_at_every_pipeline_size():
    # (moved here from check_mhc_pipeline, which checked it again for PP > 1)
    config = types.SimpleNamespace(
        enable_mhc_connections=True,
        cuda_graph_impl="local",
        enable_cuda_graph=False,
        external_cuda_graph=False,
        offload_modules=None,
        fine_grained_activation_offloading=False,
        mlp_chunks_for_training=1,
    )
    with pytest.raises(guards.UnsupportedCombinationError, match="cuda_graph_impl"):
        guards.check_mhc_layer_features(config)
    guards.check_mhc_layer_features(
        types.SimpleNamespace(**{**vars(config), "enable_mhc_connections": False})
    )
