"""Where a recipe's golden values may be read and written: ``test.golden_values`` is a ``.json``
pattern with only {name} and {platform}, and ``--write-golden`` writes only below the recipe's
own directory, never over a file that is not golden-value JSON (a recipe someone sent could
point it at any file of yours)."""

from __future__ import annotations

from megatron_ext.errors import Problem
from megatron_ext.files import inside, irregular_kind, read_text_bounded
from megatron_ext.launch.shell import LINE_BREAKING
from megatron_ext.recipes.loader import LoadedRecipe

MAX_GOLDEN_BYTES = 256 << 20
"""Golden values are read whole; a file far beyond a run's metrics is not golden values."""


def golden_values_problem(loaded: LoadedRecipe) -> Problem | None:
    """``test.golden_values``: a ``.json`` pattern with no placeholder but {name} and {platform}."""
    pattern = loaded.recipe.test.golden_values
    if not pattern:
        return None
    try:
        text = pattern.format(name=loaded.name, platform=loaded.platform)
    except (KeyError, IndexError, ValueError, AttributeError):
        return Problem(
            "test.golden_values",
            f"{pattern!r} may hold only the placeholders {{name}} and {{platform}}; "
            "escape other braces as {{ and }}",
        )
    if not text.endswith(".json") or LINE_BREAKING.search(text):
        return Problem(
            "test.golden_values",
            f"{text!r} is not a golden-value file: give a path ending in .json, "
            "e.g. golden/{name}/golden_values_{platform}.json",
        )
    return _not_regular_problem(loaded)


def _not_regular_problem(loaded: LoadedRecipe) -> Problem | None:
    """Golden values that exist but are a FIFO, device or socket: the comparison at the end of
    the run would block on them or never end (refused before anything starts)."""
    golden = loaded.golden_path()  # absent: a note says the run is not compared
    kind = irregular_kind(golden) if golden is not None else None
    if kind is None:
        return None
    return Problem(
        "test.golden_values", f"{golden} is {kind}, not a regular file; give golden-value JSON"
    )


def golden_write_problem(loaded: LoadedRecipe) -> str | None:
    """Why ``--write-golden`` may not write the recipe's golden values: only below the recipe's
    own directory, and never over a file that is not golden-value JSON (a recipe someone sent
    could point test.golden_values at any file of yours)."""
    import json

    golden = loaded.golden_path()
    if golden is None:
        return "test.golden_values is null: set it to a .json path beside the recipe"
    if not inside(loaded.base_dir, golden):
        return (
            f"test.golden_values {golden} is outside the recipe's directory {loaded.base_dir}; "
            "--write-golden writes only below it (e.g. golden/{name}/golden_values_{platform}.json)"
        )
    if golden.is_symlink() or (golden.exists() and not golden.is_file()):
        return (
            f"test.golden_values {golden} is not a regular file; --write-golden will not replace it"
        )
    if golden.exists():
        try:
            data = json.loads(read_text_bounded(golden, MAX_GOLDEN_BYTES, "golden values"))
        except (OSError, ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            return (
                f"test.golden_values {golden} exists and is not golden-value JSON; "
                "--write-golden will not overwrite it: move it away first"
            )
    return None
