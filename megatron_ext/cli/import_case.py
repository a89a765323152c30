"""``megatron-ext import PATH/model_config.yaml [-o RECIPE.yaml]``: a Megatron-LM test case as a
recipe (``run`` and ``validate`` also take such a file directly)."""

from __future__ import annotations

import argparse
import sys

NAME = "import"
HELP = "write a Megatron-LM test case (model_config.yaml) as a recipe"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("test_case", help="PATH/model_config.yaml (or its directory)")
    parser.add_argument("-o", "--output", help="recipe file to write (default: print it)")


def main(args: argparse.Namespace) -> int:
    """A Megatron-LM test case (model_config.yaml) as a megatron-ext recipe YAML."""
    import os
    from pathlib import Path

    import yaml

    from megatron_ext.recipes import upstream
    from megatron_ext.recipes.loader import parse_document, yaml_error_line

    source = Path(args.test_case)
    if source.is_dir():
        source = source / upstream.TEST_CASE_FILE
    try:
        raw, duplicates = parse_document(source.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        print(f"megatron-ext import: cannot read {source}: {yaml_error_line(exc)}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        print(f"megatron-ext import: cannot read {source}: {exc}", file=sys.stderr)
        return 2
    if not upstream.is_test_case(raw):
        print(
            f"megatron-ext import: {source} is not a Megatron-LM test case (no MODEL_ARGS)",
            file=sys.stderr,
        )
        return 2
    conversion = upstream.convert(raw, source.resolve().parent, duplicates=tuple(duplicates))
    # A recipe file has no placeholders: one the environment cannot fill would be written
    # literally and fail on the GPU machine, so it is an error here.
    conversion.problems += [
        upstream.Problem(
            f"MODEL_ARGS.{flag}",
            f"${{{name}}} is not set; export {name} (the directory Megatron-LM's CI mounts its "
            "data at) and import again, or run the test case file itself (its cpu platform "
            "needs no data)",
        )
        for name, flag in conversion.unresolved.items()
    ]
    for problem in conversion.problems:
        print(f"{source}: {problem}", file=sys.stderr)
    if conversion.problems:
        return 2
    recipe = conversion.recipe
    out = Path(args.output) if args.output else None
    # Golden files stay beside the test case: their paths are relative to the recipe written
    # with -o, absolute when it is printed (where it will be saved is unknown).
    case_dir = source.resolve().parent
    base = os.path.relpath(case_dir, out.resolve().parent) if out is not None else str(case_dir)
    recipe["test"]["golden_values"] = os.path.join(base, recipe["test"]["golden_values"])
    for overlay in recipe["platforms"].values():
        overlay["test"]["golden_values"] = os.path.join(base, overlay["test"]["golden_values"])
    notes = [*conversion.notes.get("mapping", []), *conversion.notes.get("cpu", [])]
    text = "\n".join([f"# Imported by megatron-ext from {source}", *[f"# {n}" for n in notes]])
    text += "\n" + yaml.safe_dump(recipe, sort_keys=False, width=100)
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)
        print(f"wrote {out} ({len(notes)} note(s); `megatron-ext validate {out}`)")
    return 0
