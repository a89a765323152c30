"""What a recipe may hand to the ranks without the command line's consent: environment keys and
remote code.

A recipe (or a Megatron-LM test case's ``ENV_VARS`` and ``MODEL_ARGS``) is data someone may have
sent you; its ``launch.env`` reaches every rank's environment and its ``extra_args`` their
command line. Countless variables make a process load or run code from where they point
(``PYTHONPATH``, ``LD_PRELOAD``, ``PYTHONPYCACHEPREFIX`` with a crafted ``.pyc``,
``OPENSSL_CONF``/``OPENSSL_MODULES``, ``NCCL_NET_PLUGIN``, ``CUDA_INJECTION64_PATH``,
``OMP_TOOL_LIBRARIES``, ``JAVA_TOOL_OPTIONS``, ``HOME`` with its dot files) or lift a safety
(``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` makes ``torch.load`` unpickle anything); a list of those
can never be complete (issue 40, item 4). So the rule is the other way round: a key reaches the
ranks from a recipe only when it is on the allow-list (:func:`allowed_reason`): tuning knobs of
the libraries a Megatron rank uses, each named with the reason it is harmless, and credentials,
which are values and never written anywhere (:func:`megatron_ext.launch.shell.is_secret`). A
pattern (``NCCL_*``, ``NVTE_*`` ...) never admits a name that points at a place
(:data:`PLACE_WORDS`: a file, directory, library, plugin, module, configuration, cache...),
since a place is where code or settings are loaded from. Every other key needs ``--allow-env
KEY`` on the command line (:func:`env_problems`); the caller's own exported environment is
theirs and passes unchanged. A value holding a NUL cannot be placed into an environment at all
and is refused too, naming the key but never echoing the value (it may be a secret).

Remote code: ``--trust-remote-code`` makes Megatron's HuggingFace tokenizer import the Python of
the tokenizer directory (its ``auto_map``) on every rank. It reaches the ranks only when the
person starting the run gives ``--trust-remote-code`` on the command line
(:func:`remote_code_problems`); a recipe, an override of it or a test case's ``MODEL_ARGS``
cannot turn it on alone (issue 40, item 3).

What the command line granted travels as one tuple of words, ``allowed_env`` of the loaded
recipe and the run request: the environment keys given with ``--allow-env`` and, when
``--trust-remote-code`` was given, :data:`REMOTE_CODE_FLAG` itself (no environment key starts
with ``--``, so the two never collide). A run directory never grants anything by itself:
``run --resume`` needs the same words again.

Sources: Python's command-line and environment documentation (PYTHON* variables), ld.so(8),
bash(1), NCCL's and PyTorch's environment-variable references, Transformer Engine's
(``NVTE_*``), OpenMP 5.2 (``OMP_*``, ``OMP_TOOL_LIBRARIES``), OpenSSL's config(5).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from megatron_ext.errors import EnvVariableError, Problem

ALLOW_FLAG = "--allow-env"
REMOTE_CODE_FLAG = "--trust-remote-code"
"""Megatron's flag (``TokenizerConfig.trust_remote_code``) and the command line's opt-in."""

ALLOWED_NAMES: dict[str, str] = {
    **dict.fromkeys(
        (
            "OMP_NUM_THREADS",
            "OMP_PROC_BIND",
            "OMP_PLACES",
            "OMP_SCHEDULE",
            "OMP_DYNAMIC",
            "OMP_WAIT_POLICY",
            "OMP_STACKSIZE",
            "OMP_MAX_ACTIVE_LEVELS",
            "OMP_DISPLAY_ENV",
            "MKL_NUM_THREADS",
            "MKL_DYNAMIC",
            "OPENBLAS_NUM_THREADS",
            "NUMEXPR_NUM_THREADS",
            "NUMEXPR_MAX_THREADS",
            "VECLIB_MAXIMUM_THREADS",
            "KMP_AFFINITY",
            "KMP_BLOCKTIME",
            "TOKENIZERS_PARALLELISM",
        ),
        "a thread count or threading policy (OpenMP, MKL, BLAS, HF tokenizers)",
    ),
    **dict.fromkeys(
        (
            "CUDA_DEVICE_MAX_CONNECTIONS",
            "CUDA_LAUNCH_BLOCKING",
            "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER",
            "CUDA_MODULE_LOADING",
            "CUBLAS_WORKSPACE_CONFIG",
            "NVIDIA_TF32_OVERRIDE",
            "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_NO_CUDA_MEMORY_CACHING",
        ),
        "a CUDA runtime, cuBLAS or caching-allocator setting (a value, not a place)",
    ),
    **dict.fromkeys(
        (
            "TORCH_DISTRIBUTED_DEBUG",
            "TORCH_CPP_LOG_LEVEL",
            "TORCH_SHOW_CPP_STACKTRACES",
            "TORCH_LOGS",
            "TORCH_USE_CUDA_DSA",
            "GLOO_SOCKET_IFNAME",
            "GLOO_DEVICE_TRANSPORT",
            "TP_SOCKET_IFNAME",
        ),
        "PyTorch's logging or its gloo/tensorpipe network interface",
    ),
    **dict.fromkeys(
        (
            "PYTHONUNBUFFERED",
            "PYTHONHASHSEED",
            "PYTHONFAULTHANDLER",
            "PYTHONDONTWRITEBYTECODE",
            "PYTHONIOENCODING",
            "PYTHONUTF8",
        ),
        "an interpreter switch that loads nothing (unlike PYTHONPATH, PYTHONPYCACHEPREFIX...)",
    ),
    **dict.fromkeys(
        (
            "HF_HUB_OFFLINE",
            "HF_DATASETS_OFFLINE",
            "TRANSFORMERS_OFFLINE",
            "HF_HUB_DISABLE_TELEMETRY",
            "TRANSFORMERS_VERBOSITY",
        ),
        "a HuggingFace hub switch (offline, telemetry, verbosity)",
    ),
    "MEGATRON_EXT_FAULT": "megatron-ext's fault injection: makes a rank fail, loads nothing",
    **dict.fromkeys(
        (
            "SKIP_PYTEST",
            "N_REPEAT",
            "ENABLE_LIGHTWEIGHT_MODE",
            "NON_DETERMINSTIC_RESULTS",  # upstream's spelling
            "NON_DETERMINISTIC_RESULTS",
            "ONE_LOGGER_JOB_CATEGORY",
            "RECORD_CHECKPOINTS",
            "GPUS_PER_NODE",
        ),
        "read by Megatron-LM's CI scripts only (a test case's ENV_VARS); inert in a rank",
    ),
}
"""Exact names a recipe may set, with why each is harmless."""

ALLOWED_PREFIXES: dict[str, str] = {
    "NCCL_": "an NCCL tuning knob (algorithm, protocol, channels, interface, timeout, debug level)",
    "TORCH_NCCL_": "a switch of PyTorch's NCCL process group (error handling, blocking wait)",
    "NVTE_": "a Transformer Engine feature switch (fused/flash attention, determinism)",
    "WANDB_": "a Weights & Biases setting (project, mode, entity)",
}
"""Families of knobs a recipe may set, except names holding a :data:`PLACE_WORDS` word."""

PLACE_WORDS = frozenset(
    {
        "FILE",
        "FILES",
        "PATH",
        "PATHS",
        "DIR",
        "DIRS",
        "DIRECTORY",
        "HOME",
        "ROOT",
        "PREFIX",
        "PLUGIN",
        "PLUGINS",
        "LIB",
        "LIBS",
        "LIBRARY",
        "LIBRARIES",
        "MODULE",
        "MODULES",
        "CONF",
        "CONFIG",
        "PRELOAD",
        "INJECTION",
        "INJECTION64",
        "HOOK",
        "HOOKS",
        "SCRIPT",
        "EXEC",
        "EXECUTABLE",
        "CMD",
        "COMMAND",
        "PROGRAM",
        "CACHE",
        "TOOL",
        "TOOLS",
        "SOCK",  # an agent's socket (SSH_AUTH_SOCK); not SOCKET (NCCL_SOCKET_IFNAME)
    }
)
"""Words of a name that point at a place to load or run something from: a pattern never
admits them (``NCCL_NET_PLUGIN``, ``NCCL_CONF_FILE``, ``NVTE_CUDA_INCLUDE_PATH``)."""

KNOWN_CODE_LOADING = frozenset(
    {
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "PYTHONUSERBASE",
        "PYTHONPYCACHEPREFIX",
        "PYTHONBREAKPOINT",
        "PYTHONWARNINGS",
        "BASH_ENV",
        "ENV",
        "PATH",
        "HOME",
        "OPENSSL_CONF",
        "OPENSSL_MODULES",
        "JAVA_TOOL_OPTIONS",
        "NODE_OPTIONS",
        "PERL5OPT",
        "NCCL_NET_PLUGIN",
        "CUDA_INJECTION64_PATH",
        "OMP_TOOL_LIBRARIES",
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
    }
)
"""Examples named in the refusal's reason (the decision is the allow-list's alone)."""


def _words(name: str) -> list[str]:
    return [w for w in re.split(r"[^A-Z0-9]+", name.upper()) if w]


def allowed_reason(key: object) -> str | None:
    """Why a recipe may set ``key`` without ``--allow-env`` (None: it may not)."""
    from megatron_ext.launch.shell import is_secret

    name = str(key)
    if name in ALLOWED_NAMES:
        return ALLOWED_NAMES[name]
    if PLACE_WORDS & set(_words(name)):
        return None
    for prefix, reason in ALLOWED_PREFIXES.items():
        if name.startswith(prefix) and len(name) > len(prefix):
            return reason
    if is_secret(name):
        return "a credential, read as a value; never written to a file or the console"
    return None


def loads_code(key: object) -> bool:
    """Whether ``key`` may not reach the ranks from a recipe without ``--allow-env``."""
    return allowed_reason(key) is None


def _refusal(key: object) -> str:
    name = str(key)
    if name in KNOWN_CODE_LOADING or name.upper().startswith(("LD_", "DYLD_", "PYTHON")):
        why = f"{name} makes every rank load code from where it points (or lifts a safety)"
    else:
        why = (
            f"{name} is not a tuning knob a recipe may set by itself (the allow-list: "
            "megatron_ext/launch/env_policy.py)"
        )
    return (
        f"{why}; if you trust this value, pass {ALLOW_FLAG} {name} on the command line "
        "(or export it yourself instead)"
    )


def env_problems(
    env: Mapping[Any, Any], allowed: Iterable[str] = (), where: str = "launch.env"
) -> list[Problem]:
    """A problem for each key of ``env`` that is not on the allow-list and was not allowed
    with ``--allow-env KEY``, and for each key or value holding a NUL."""
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
            problems.append(Problem(f"{where}.{key}", _refusal(key)))
    return problems


def _turns_on_remote_code(word: str) -> bool:
    return word == REMOTE_CODE_FLAG or word.startswith(REMOTE_CODE_FLAG + "=")


def remote_code_problems(
    argv: Sequence[str], allowed: Iterable[str] = (), where: str = "extra_args"
) -> list[Problem]:
    """One problem when the ranks' command line ``argv`` turns on remote code and the command
    line did not grant it. The whole argv is read, not only ``extra_args``' keys: a list value
    (``--data-path: [a, --trust-remote-code]``) puts the flag on the command line too."""
    if REMOTE_CODE_FLAG in set(allowed) or not any(_turns_on_remote_code(str(w)) for w in argv):
        return []
    return [
        Problem(
            f"{where}.{REMOTE_CODE_FLAG}",
            "makes every rank import the Python of the tokenizer's directory (its auto_map), "
            "so a recipe may not turn it on; if you trust that directory, pass "
            f"{REMOTE_CODE_FLAG} on the command line",
        )
    ]


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
        raise EnvVariableError(
            f"launch.env.{missing[0]} is a secret, not kept in the run directory; export "
            f"{names} before megatron-ext run --resume"
        )
    for key, value in env.items():
        if is_secret(key) and value == REDACTED:
            restored[key] = environ[key]
    return restored
