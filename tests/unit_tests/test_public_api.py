"""The stable API (docs/registry.md, "Stable API"): each public package's ``__all__`` names what it
exports, every listed name resolves, and docs/registry.md lists the same packages."""

import importlib
import re
from pathlib import Path

import pytest

import megatron_ext

PUBLIC = (
    "megatron_ext",
    "megatron_ext.config",
    "megatron_ext.models.gpt",
    "megatron_ext.models.hybrid",
    "megatron_ext.mhc",
    "megatron_ext.runtime",
    "megatron_ext.guards",
    "megatron_ext.recipes",
    "megatron_ext.multimodule",
    "megatron_ext.checkpoint",
    "megatron_ext.testing",
)
REPO = Path(__file__).resolve().parents[2]
STABLE_API_PAGE = REPO / "docs" / "registry.md"


@pytest.mark.parametrize("name", PUBLIC)
def test_every_exported_name_resolves(name):
    module = importlib.import_module(name)
    assert module.__all__, f"{name} declares no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ lists names it does not have: {missing}"


def test_the_top_level_api():
    assert megatron_ext.__all__ == [
        "MegatronExtError",
        "Problem",
        "__version__",
        "install",
        "installed",
        "uninstall",
    ]
    from megatron_ext.recipes import Problem, RecipeError

    assert Problem is megatron_ext.Problem
    assert issubclass(RecipeError, megatron_ext.MegatronExtError)
    assert issubclass(RecipeError, ValueError)


def test_the_guide_lists_exactly_the_public_packages():
    text = STABLE_API_PAGE.read_text()
    section = text.split("## Stable API", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `(megatron_ext[\w.]*)` \|", section, re.M)
    assert listed == list(PUBLIC)


def test_py_typed_ships_with_the_package():
    assert (Path(megatron_ext.__file__).parent / "py.typed").is_file()
    assert '"py.typed"' in (REPO / "setup.py").read_text()


def _error_classes() -> dict[str, list[str]]:
    """Every Exception class megatron_ext defines (by AST: no module is imported; BaseExceptions
    such as the launcher's Interrupted are signals, not errors), with the
    names of its bases."""
    import ast
    import builtins

    builtin_errors = {
        n
        for n in dir(builtins)
        if isinstance(getattr(builtins, n), type) and issubclass(getattr(builtins, n), Exception)
    }
    classes: dict[str, list[str]] = {}
    for path in sorted(Path(megatron_ext.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                classes[f"{path.stem}.{node.name}"] = bases
    errors: dict[str, list[str]] = {}
    names = {key.rsplit(".", 1)[1] for key in classes}
    changed = True
    while changed:
        changed = False
        for key, bases in classes.items():
            if key not in errors and any(
                b in builtin_errors or (b in names and any(k.endswith("." + b) for k in errors))
                for b in bases
            ):
                errors[key] = bases
                changed = True
    return errors


def test_every_error_derives_from_the_root():
    errors = _error_classes()
    assert "schema.RecipeError" in errors and "errors.MegatronExtError" in errors
    roots = {key.rsplit(".", 1)[1] for key in errors} - {"MegatronExtError"}
    strays = [
        key
        for key, bases in errors.items()
        if key != "errors.MegatronExtError"
        and "MegatronExtError" not in bases
        and not any(b in roots for b in bases)
    ]
    assert not strays, f"errors that do not derive from MegatronExtError: {strays}"
