"""What may go into a generated shell script, and what never does: quoting rules and secrets.

Every script megatron-ext writes (a recipe's ``command.sh``, a Slurm ``sbatch.sh`` and its
``#SBATCH`` header) follows these rules. A value is either quoted with :func:`shlex.quote`
where the script is written, or, where quoting cannot help, refused first:

- environment keys are exported by name, so they must be shell identifiers (:data:`ENV_KEY`);
- ``#SBATCH`` lines are comments to bash but would end at a line break, so no value placed on
  one may hold a line break or NUL (:func:`directive_problem`, :func:`check_directives`);
- text in a ``#`` comment line has its line breaks and controls escaped (:func:`comment`).

Secrets: an environment variable one of whose words (split at ``_`` and other separators, and
between camelCase words) is KEY, TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, CREDENTIAL(S),
PAT, PASS, PW, PWD or AUTH, or such a word run together with its kind (APIKEY, AUTHTOKEN),
e.g. ``WANDB_API_KEY``, ``MY_DB_PASSWD``, ``GH_PAT``; not ``PATH``, the shell's ``PWD``,
``TOKENIZERS_PARALLELISM``; is never written into a script, a resolved recipe or a summary,
whatever the override's form
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

SECRET_WORDS = frozenset(
    {
        "TOKEN",
        "SECRET",
        "SECRETS",
        "PASSWORD",
        "PASSWORDS",
        "PASSWD",
        "PASSPHRASE",
        "CREDENTIAL",
        "CREDENTIALS",
        "CREDS",
        "KEY",
        "KEYS",
        "PAT",
        "PASS",
        "PWD",
        "PW",
        "AUTH",
    }
)
"""Words that name a secret as a whole part of a name (HF_TOKEN, WANDB_API_KEY, GH_PAT, DB_PASS),
never as a piece of another word (TOKENIZERS_PARALLELISM, MONKEY, PASSES, NCCL_IB_PKEY)."""
SECRET_COMPOUND = re.compile(
    r"(?:API|ACCESS|AUTH|SECRET|PRIVATE|SESSION|BEARER|REFRESH|CLIENT|SIGNING|ENCRYPTION|HF|GH)"
    r"(?:KEY|TOKEN|SECRET)S?|[A-Z0-9]*(?:PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?)"
)
"""A part that runs two words together: APIKEY, AUTHTOKEN, HFTOKEN, DBPASSWORD."""
NOT_SECRET = frozenset({"PWD", "OLDPWD"})  # the shell's working directories
REDACTED = "<redacted>"


def name_parts(name: object) -> list[str]:
    """The words of a name, upper case: split at anything not a letter or digit and where a
    lower-case letter meets an upper-case one (``hfToken`` -> HF, TOKEN)."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name))
    return [p for p in re.split(r"[^A-Za-z0-9]+", text.upper()) if p]


def is_secret(name: object) -> bool:
    """Whether an environment variable called ``name`` holds a secret: one of its whole parts
    is a secret word (:data:`SECRET_WORDS`, :data:`SECRET_COMPOUND`)."""
    if str(name).upper() in NOT_SECRET:
        return False
    return any(p in SECRET_WORDS or SECRET_COMPOUND.fullmatch(p) for p in name_parts(name))


def secret_path(parts: list[str]) -> bool:
    """Whether a recipe path (``launch.env.HF_TOKEN``, ``platforms.gpu.launch.env.X``) is, or is
    inside, an environment variable that holds a secret. Only ``launch.env`` names variables:
    a schema field (``model.mhc.single_pass``) or a Megatron flag is never judged a secret by
    its name (issue 41, item 8)."""
    for i in range(len(parts) - 2):
        if parts[i] == "launch" and parts[i + 1] == "env" and is_secret(parts[i + 2]):
            return True
    return False


def _may_hold_env(parts: list[str]) -> bool:
    """Whether a value at this recipe path can hold a ``launch.env`` mapping (or is one)."""
    while len(parts) >= 2 and parts[0] == "platforms":
        parts = parts[2:]
    return parts in ([], ["launch"]) or parts[:2] == ["launch", "env"] or parts[:1] == ["platforms"]


def _redact_tree(value: object, path: list[str]) -> tuple[object, bool]:
    """``value`` (found at recipe ``path``) with every secret environment variable in it
    redacted, and whether any was."""
    if isinstance(value, dict):
        out: dict[object, object] = {}
        hidden = False
        for key, item in value.items():
            if secret_path([*path, str(key)]):
                out[key], hidden = REDACTED, True
            else:
                out[key], inner = _redact_tree(item, [*path, str(key)])
                hidden = hidden or inner
        return out, hidden
    if isinstance(value, list):
        items = [_redact_tree(item, path) for item in value]
        return [item for item, _ in items], any(h for _, h in items)
    return value, False


def redact_env(env: dict) -> dict:
    """``env`` with every secret's value replaced by :data:`REDACTED`."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


def _override_path(key: str) -> list[str]:
    """An override's key as recipe path parts (``+launch.env.X`` -> launch, env, X)."""
    return [part.strip('"') for part in key.lstrip("+~").split(".")]


def redact_override(override: str) -> str:
    """A KEY=VALUE override with the value hidden when it sets a secret environment variable.

    The value is judged as YAML reads it, not as typed: ``{"HF_\\x54OKEN": x}`` names
    HF_TOKEN once unescaped, so every value that may hold a mapping is parsed and redacted on
    its parsed keys (issue 34, item 7). Only ``launch.env`` holds variables, so an override of
    any other field is shown as given (``model.mhc.single_pass=false``)."""
    key, sep, value = override.partition("=")
    if not sep:
        return override
    path = _override_path(key)
    if secret_path(path):
        return f"{key}={REDACTED}"
    if not _may_hold_env(path) or not any(ch in value for ch in "{[:\\\"'!&*"):
        return override  # no variable's name can hide in it
    import yaml

    try:  # the mapping form, launch.env={HF_TOKEN: x} or launch={env: {HF_TOKEN: x}}
        parsed = yaml.safe_load(value)
    except (yaml.YAMLError, RecursionError, ValueError):
        if not any(is_secret(word) for word in re.split(r"[^A-Za-z0-9_]+", value)) and (
            "\\" not in value
        ):
            return override
        return f"{key}={REDACTED}"  # unreadable, and it may name a secret: show none of it
    redacted, hidden = _redact_tree(parsed, path)
    if not hidden:
        return override
    return f"{key}={yaml.safe_dump(redacted, default_flow_style=True, width=10**6).strip()}"


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


DIRECTIVE_WORD_BREAKING = re.compile(r"[\s\"'\\]")


def directive_word_problem(where: str, value: object) -> Problem | None:
    """A value that must stay one option on an ``#SBATCH`` line (a path after ``--output=``
    or ``--chdir=``): sbatch splits the line at whitespace, so ``/shared/a --wrap=x`` would
    add an option and a plain ``my runs`` breaks the header; quoting there is not read the
    same by every Slurm version, so such values are refused (issue 34, item 10)."""
    problem = directive_problem(where, value)
    if problem is not None or value is None:
        return problem
    if DIRECTIVE_WORD_BREAKING.search(str(value)):
        return Problem(
            where,
            f"{str(value)!r} holds whitespace, a quote or a backslash, which would split the "
            "#SBATCH line into other options; use a path without them",
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
