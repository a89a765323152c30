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

Secrets: an environment variable whose name contains KEY, TOKEN, SECRET or PASSWORD (e.g.
``WANDB_API_KEY``) is never written into a script, the resolved recipe or the summary
(:func:`redact_env`); the ranks get it through the launcher's environment, and a generated
script expects it in the environment it is run from (:func:`secret_check_line`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional

from megatron_ext.recipes.schema import Problem

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
SAFE_NAME_TEXT = "1-100 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
LINE_BREAKING = re.compile(r"[\n\r\x00\x0b\x0c\x85\u2028\u2029]")


SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD", re.IGNORECASE)
REDACTED = "<redacted>"


def is_secret(name: object) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact_env(env: dict) -> dict:
    """``env`` with every secret's value replaced by :data:`REDACTED`."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def redact_override(override: str) -> str:
    """A KEY=VALUE override with the value hidden when the key names a secret."""
    key, sep, _ = override.partition("=")
    return f"{key}={REDACTED}" if sep and is_secret(key.rsplit(".", 1)[-1]) else override


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
