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
    from megatron_ext.cli._common import add_allow_env

    add_allow_env(parser)


MAX_TEST_CASE_BYTES = 1 << 20


def _output_problem(out, source) -> str | None:
    """Checked before reading: where the recipe goes must be a file in an existing directory,
    and never the test case itself."""
    if out.is_dir():
        return "is a directory; give a file name such as recipe.yaml"
    if not out.parent.is_dir():
        return f"directory {out.parent} does not exist; create it first"
    if out.exists() and source.exists() and out.resolve() == source.resolve():
        return "is the test case itself; give another file name"
    return None


def _flag_words(recipe: dict) -> list[str]:
    """Every flag and value the recipe's extra_args (and its platforms') put on the command
    line."""
    words: list[str] = []
    for section in [recipe, *recipe.get("platforms", {}).values()]:
        for flag, value in (section.get("extra_args") or {}).items():
            if value is not None and value is not False:
                words += [str(flag), *map(str, value if isinstance(value, list) else [value])]
    return words


def _without_secrets(recipe: dict) -> list[str]:
    """Drop every secret of the case's ENV_VARS from the recipe written or printed (a recipe
    file is shared and shown; the ranks inherit the variable from the environment they are
    started in), one note each."""
    from megatron_ext.launch.shell import is_secret

    notes = []
    for section in [recipe, *recipe.get("platforms", {}).values()]:
        env = section.get("launch", {}).get("env") or {}
        for key in [k for k in env if is_secret(k)]:
            del env[key]
            notes.append(
                f"ENV_VARS.{key} is a secret: not written into the recipe; export {key} where "
                "you run it (the ranks inherit it)"
            )
    return notes


def main(args: argparse.Namespace) -> int:
    """A Megatron-LM test case (model_config.yaml) as a megatron-ext recipe YAML."""
    import os
    from pathlib import Path

    import yaml

    from megatron_ext.recipes.loader import parse_document, yaml_error_line
    from megatron_ext.recipes.schema import Recipe
    from megatron_ext.upstream_cases import model_config as upstream

    source = Path(args.test_case)
    if source.is_dir():
        source = source / upstream.TEST_CASE_FILE
    out = Path(args.output) if args.output else None
    if out is not None and (problem := _output_problem(out, source)):
        print(f"megatron-ext import: -o {out}: {problem}", file=sys.stderr)
        return 2
    try:
        from megatron_ext import files

        # bounded by the bytes read, not the size claimed (/dev/zero claims 0; issue 40)
        text = files.read_text_bounded(source, MAX_TEST_CASE_BYTES, "test case")
        raw, duplicates = parse_document(text)
    except yaml.YAMLError as exc:
        print(f"megatron-ext import: cannot read {source}: {yaml_error_line(exc)}", file=sys.stderr)
        return 2
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        one_line = " ".join(str(reason).split())[:300]
        print(f"megatron-ext import: cannot read {source}: {one_line}", file=sys.stderr)
        return 2
    except RecursionError:
        print(f"megatron-ext import: cannot read {source}: nested too deeply", file=sys.stderr)
        return 2
    if not upstream.is_test_case(raw):
        print(
            f"megatron-ext import: {source} is not a Megatron-LM test case (no MODEL_ARGS)",
            file=sys.stderr,
        )
        return 2
    conversion = upstream.convert(
        raw, source.resolve().parent, duplicates=tuple(duplicates), defaults=Recipe().to_dict()
    )
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
    from megatron_ext.launch.env_policy import env_problems, remote_code_problems

    conversion.problems += env_problems(
        conversion.recipe.get("launch", {}).get("env", {}), args.allow_env, "ENV_VARS"
    )
    conversion.problems += remote_code_problems(
        _flag_words(conversion.recipe), args.allow_env, "MODEL_ARGS"
    )
    for found in conversion.problems:
        print(f"{source}: {found}", file=sys.stderr)
    if conversion.problems:
        return 2
    recipe = conversion.recipe
    # Golden files stay beside the test case: their paths are relative to the recipe written
    # with -o, absolute when it is printed (where it will be saved is unknown).
    case_dir = source.resolve().parent
    base = os.path.relpath(case_dir, out.resolve().parent) if out is not None else str(case_dir)
    recipe["test"]["golden_values"] = os.path.join(base, recipe["test"]["golden_values"])
    for overlay in recipe["platforms"].values():
        overlay["test"]["golden_values"] = os.path.join(base, overlay["test"]["golden_values"])
    notes = [*conversion.notes.get("mapping", []), *conversion.notes.get("cpu", [])]
    notes += _without_secrets(recipe)
    text = "\n".join([f"# Imported by megatron-ext from {source}", *[f"# {n}" for n in notes]])
    text += "\n" + yaml.safe_dump(recipe, sort_keys=False, width=100)
    if out is None:
        print(text, end="")
    else:
        try:
            out.write_text(text)
        except OSError as exc:
            print(f"megatron-ext import: cannot write {out}: {exc.strerror}", file=sys.stderr)
            return 2
        print(f"wrote {out} ({len(notes)} note(s); `megatron-ext validate {out}`)")
    return 0
