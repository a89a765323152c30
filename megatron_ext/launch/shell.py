"""What may go into a generated shell script, and what never does: quoting rules and secrets.

Every script megatron-ext writes (a recipe's ``command.sh``, a Slurm ``sbatch.sh`` and its
``#SBATCH`` header) follows these rules. A value is either quoted with :func:`shlex.quote`
where the script is written, or, where quoting cannot help, refused first:

- environment keys are exported by name, so they must be shell identifiers (:data:`ENV_KEY`);
- ``#SBATCH`` lines are comments to bash but would end at a line break, so no value placed on
  one may hold a line break or NUL (:func:`directive_problem`, :func:`check_directives`);
- text in a ``#`` comment line has its line breaks and controls escaped (:func:`comment`).

Secrets: an environment variable whose name contains KEY, TOKEN, SECRET or PASSWORD (e.g.
``WANDB_API_KEY``) is never written into a script, a resolved recipe or a summary
(:func:`redact_env`, :func:`redact_override`); the ranks get it through the launcher's
environment, and a generated script expects it in the environment it is run from
(:func:`secret_check_line`).

Nothing here imports anything but :mod:`megatron_ext.errors`; recipes' own rules (safe names,
the run directory) are :mod:`megatron_ext.recipes.safety`'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from megatron_ext.errors import MegatronExtError, Problem

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


class UnsafeValueError(MegatronExtError, ValueError):
    """A value that cannot be placed into a generated script safely."""


def directive_problem(where: str, value: object) -> Problem | None:
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


def comment(text: str) -> str:
    """Text for a ``#`` comment line of a script: line breaks and controls escaped."""
    return "".join(
        ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text
    )
