"""What a recipe may put into generated shell: names, environment keys, Slurm directives.

A recipe is data someone may have sent you. Its values reach three generated scripts
(``command.sh``, ``sbatch.sh`` and the ``#SBATCH`` header) and the run directory's path,
so each value is either quoted with :func:`shlex.quote` where the script is written, or,
where quoting cannot help, rejected here before anything is written:

- the recipe ``name`` and the platform name become file names (run directory, golden-value
  path) and the Slurm job name: a safe character set, no path separators;
- ``launch.env`` keys are exported by name, so they must be shell identifiers;
- ``#SBATCH`` lines are comments to bash but would end at a line break, so no value placed
  on one may hold a line break or NUL.

Secrets: an environment variable whose name contains KEY, TOKEN, SECRET, PASSWORD, PASSWD or
CREDENTIAL, or has PAT, PASS, PWD or AUTH as one of its ``_``-separated words (e.g.
``WANDB_API_KEY``, ``MY_DB_PASSWD``, ``GH_PAT``; not ``PATH`` or the shell's ``PWD``) is never
written into a script, the resolved recipe or the summary
(:func:`redact_env`); the ranks get it through the launcher's environment, and a generated
script expects it in the environment it is run from (:func:`secret_check_line`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional

from megatron_ext.recipes.loader import LoadedRecipe
from megatron_ext.recipes.schema import Problem

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
SAFE_NAME_TEXT = "1-100 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
LINE_BREAKING = re.compile(r"[\n\r\x00\x0b\x0c\x85\u2028\u2029]")


SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Short words that name a secret only as a whole word: GH_PAT, DB_PASS, MY_PWD, HTTP_AUTH.
SECRET_WORDS = frozenset({"PAT", "PASS", "PWD", "AUTH", "PASSPHRASE", "PW"})
NOT_SECRET = frozenset({"PWD", "OLDPWD"})  # the shell's working directories
REDACTED = "<redacted>"


def is_secret(name: object) -> bool:
    text = str(name)
    if text.upper() in NOT_SECRET:
        return False
    words = set(re.split(r"[^A-Za-z0-9]+", text.upper()))
    return bool(SECRET_NAME.search(text)) or bool(words & SECRET_WORDS)


def _redact_tree(value: object) -> tuple[object, bool]:
    """``value`` with every mapping entry under a secret name redacted, and whether any was."""
    if isinstance(value, dict):
        out, hidden = {}, False
        for key, item in value.items():
            if is_secret(key):
                out[key], hidden = REDACTED, True
            else:
                out[key], inner = _redact_tree(item)
                hidden = hidden or inner
        return out, hidden
    if isinstance(value, list):
        items = [_redact_tree(item) for item in value]
        return [item for item, _ in items], any(h for _, h in items)
    return value, False


def redact_env(env: dict) -> dict:
    """``env`` with every secret's value replaced by :data:`REDACTED`."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def redact_override(override: str) -> str:
    """A KEY=VALUE override with the value hidden when the key names a secret."""
    key, sep, value = override.partition("=")
    if not sep:
        return override
    if is_secret(key.rsplit(".", 1)[-1]):
        return f"{key}={REDACTED}"
    if not any(is_secret(word) for word in re.split(r"[^A-Za-z0-9_]+", value)):
        return override  # no secret name inside: keep the user's text as written
    import yaml

    try:  # the mapping form, launch.env={HF_TOKEN: x} or launch={env: {HF_TOKEN: x}}
        parsed = yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError, ValueError):
        return f"{key}={REDACTED}"  # unreadable, and it names a secret: show none of it
    redacted, hidden = _redact_tree(parsed)
    if not hidden:
        return override
    return f"{key}={yaml.safe_dump(redacted, default_flow_style=True, width=10**6).strip()}"


def secret_check_line(name: str) -> str:
    """Shell: stop with a message when the secret ``name`` is not in the environment."""
    return f': "${{{name}:?is a secret and not written here; export {name} before running this}}"'


class UnsafeValueError(ValueError):
    """A value that cannot be placed into a generated script safely."""


def name_problem(where: str, value: str) -> Optional[Problem]:
    if SAFE_NAME.match(value or ""):
        return None
    return Problem(where, f"{value!r} is not a safe name: use {SAFE_NAME_TEXT}")


def directive_problem(where: str, value: object) -> Optional[Problem]:
    """A value for an ``#SBATCH`` line: anything but a line break (sbatch reads the line
    itself; bash must keep seeing one comment)."""
    if value is not None and LINE_BREAKING.search(str(value)):
        return Problem(
            where,
            f"{str(value)!r} holds a line break or NUL, which would end the "
            "#SBATCH line and run the rest as shell; remove it",
        )
    return None


def recipe_problems(loaded: LoadedRecipe) -> list[Problem]:
    """Every value of the recipe that no quoting can make safe."""
    recipe = loaded.recipe
    problems: list[Optional[Problem]] = [
        name_problem("name" if recipe.name else "name (from the file name)", loaded.name),
        name_problem("platform", loaded.platform),
    ]
    problems.append(golden_values_problem(loaded))
    for key in recipe.launch.env:
        if not ENV_KEY.match(str(key)):
            problems.append(
                Problem(
                    f"launch.env.{key}",
                    f"{str(key)!r} is not an environment "
                    "variable name: use letters, digits and _, not starting with a digit",
                )
            )
    slurm = recipe.launch.slurm
    for field_name in ("partition", "account", "time", "container_image"):
        problems.append(directive_problem(f"launch.slurm.{field_name}", getattr(slurm, field_name)))
    from megatron_ext.launch.slurm import time_problem

    if isinstance(slurm.time, str) and (problem := time_problem(slurm.time)):
        problems.append(Problem("launch.slurm.time", problem))
    for i, value in enumerate([*slurm.sbatch_args]):
        problems.append(directive_problem(f"launch.slurm.sbatch_args[{i}]", value))
    for i, value in enumerate([*slurm.container_mounts]):
        problems.append(directive_problem(f"launch.slurm.container_mounts[{i}]", value))
    return [p for p in problems if p is not None]


def golden_values_problem(loaded: LoadedRecipe) -> Optional[Problem]:
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
    return None


def golden_write_problem(loaded: LoadedRecipe) -> Optional[str]:
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
            data = json.loads(golden.read_text())
        except (OSError, ValueError, RecursionError):
            data = None
        if not isinstance(data, dict):
            return (
                f"test.golden_values {golden} exists and is not golden-value JSON; "
                "--write-golden will not overwrite it: move it away first"
            )
    return None


def check_directives(values: Iterable[tuple[str, object]]) -> None:
    """Raise :class:`UnsafeValueError` for the first value that would break an #SBATCH line."""
    for where, value in values:
        problem = directive_problem(where, value)
        if problem is not None:
            raise UnsafeValueError(str(problem))


def inside(root: Path, path: Path) -> bool:
    """Whether ``path`` resolves to ``root`` or below it (symlinks and '..' followed)."""
    root, path = Path(root).resolve(), Path(path).resolve()
    return path == root or root in path.parents


def comment(text: str) -> str:
    """Text for a ``#`` comment line of a script: line breaks and controls escaped."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )
