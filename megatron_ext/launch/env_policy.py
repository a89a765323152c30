"""Which environment variables a recipe may hand to the ranks.

A recipe (or a Megatron-LM test case's ``ENV_VARS``) is data someone may have sent you; its
``launch.env`` reaches every rank's environment. Some variables make a process load code from
where they point before anything of ours runs: ``PYTHONPATH=DIR`` with a ``sitecustomize.py``
in DIR runs it in every rank, ``LD_PRELOAD`` loads a shared library into it (issue 34, item 5).
Those keys (:func:`loads_code`) are refused in a recipe unless the user names each one on the
command line with ``--allow-env KEY`` (:func:`env_problems`); the caller's own environment is
theirs and passes unchanged. A value holding a NUL cannot be placed into an environment at all
and is refused too (item 11), naming the key but never echoing the value (it may be a secret).

Sources for the list: Python's command-line and environment documentation (PYTHON* variables
that import, run or relocate code), ld.so(8) (LD_* and the audit/preload interfaces), bash(1)
(BASH_ENV, ENV), and the equivalents of other interpreters a rank may start.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from megatron_ext.errors import Problem

CODE_LOADING = frozenset(
    {
        # Python: a module path, a start-up script, a different stdlib, an imported hook
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "PYTHONPLATLIBDIR",
        "PYTHONEXECUTABLE",
        "PYTHONBREAKPOINT",
        "PYTHONWARNINGS",  # a warning category names a module, which is imported
        # shells started by a rank or a launcher
        "BASH_ENV",
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PROMPT_COMMAND",
        "PATH",  # which executable a plain command name runs
        # other interpreters and tools a rank may start
        "PERL5LIB",
        "PERL5OPT",
        "PERLLIB",
        "RUBYLIB",
        "RUBYOPT",
        "NODE_OPTIONS",
        "NODE_PATH",
        "GCONV_PATH",
        "GIT_EXEC_PATH",
        "GIT_SSH",
        "GIT_SSH_COMMAND",
        "GIT_CONFIG_GLOBAL",
        "TORCHINDUCTOR_CACHE_DIR",  # compiled kernels are loaded from it
        "TRITON_CACHE_DIR",
    }
)
CODE_LOADING_PREFIXES = ("LD_", "DYLD_")
ALLOW_FLAG = "--allow-env"


def loads_code(key: object) -> bool:
    """Whether setting ``key`` can make a process load or run code from where it points."""
    name = str(key).upper()
    return name in CODE_LOADING or name.startswith(CODE_LOADING_PREFIXES)


def env_problems(
    env: Mapping[Any, Any], allowed: Iterable[str] = (), where: str = "launch.env"
) -> list[Problem]:
    """A problem for each key of ``env`` that loads code and was not allowed with
    ``--allow-env KEY``, and for each key or value holding a NUL."""
    allowed_keys = {str(k) for k in allowed}
    problems = []
    for key, value in env.items():
        if "\x00" in str(key) or (value is not None and "\x00" in str(value)):
            problems.append(
                Problem(
                    f"{where}.{key}",
                    "holds a NUL character, which no environment can carry; remove it",
                )
            )
        elif loads_code(key) and str(key) not in allowed_keys:
            problems.append(
                Problem(
                    f"{where}.{key}",
                    f"{key} makes every rank load code from where it points, so a recipe may "
                    f"not set it; if you trust this value, pass {ALLOW_FLAG} {key} on the "
                    "command line (or export it yourself instead)",
                )
            )
    return problems


def restore_secrets(env: Mapping[str, object], environ: Mapping[str, str]) -> dict[str, object]:
    """``env`` of a run directory's recipe with each redacted secret taken from ``environ``
    (the caller's environment), as the first start got it from its recipe or overrides.

    A resolved recipe never holds a secret's value (:func:`~megatron_ext.launch.shell.redact_env`),
    so a resume that passed it on would hand every rank the literal ``<redacted>``. A secret
    missing from ``environ`` raises :class:`ValueError` (one line naming it and the fix)."""
    from megatron_ext.launch.shell import REDACTED, is_secret

    restored = dict(env)
    missing = [k for k, v in env.items() if is_secret(k) and v == REDACTED and k not in environ]
    if missing:
        names = ", ".join(missing)
        raise ValueError(
            f"launch.env.{missing[0]} is a secret, not kept in the run directory; export "
            f"{names} before megatron-ext run --resume"
        )
    for key, value in env.items():
        if is_secret(key) and value == REDACTED:
            restored[key] = environ[key]
    return restored
