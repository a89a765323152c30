"""Upstream warnings the ``megatron-ext`` command counts instead of showing.

Importing megatron on a machine without Transformer Engine, Apex or CUDA prints 10-20 lines
(megatron's "... not installed. Falling back ..." from several modules, torch's "No CUDA runtime
is found") before a command's own output, and packages we pin warn about their own deprecated
internals. They describe this machine or code we do not own, which ``megatron-ext doctor``
reports in one place, and they bury the line the user ran the command for. So the command
counts them and says, at the end, "N upstream warnings hidden; --verbose shows them".

Hidden are only: the machine notices below, matched by their text, and deprecation warnings
(Deprecation-, PendingDeprecation-, FutureWarning) raised inside an upstream package. Every
other warning still shows, megatron-ext's own always (a deprecated call *in our code* is
attributed to our file by the warning's stack level, so it shows too), and errors are never
touched. The training ranks (whose logs are the record of a run) are not affected.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from pathlib import Path

UPSTREAM_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"Only transformer-engine>=\S+ supports MoE experts",
    r"MimoModelConfig is experimental",
    r"'pin_memory' argument is set as true but no accelerator is found",
    r"Could not determine rank from torch\.distributed",  # megatron asked outside a run
)
"""Messages (regular expressions matched at their start) of upstream UserWarnings that only say
what this machine lacks."""

TORCH_LOGGER_NOISE = {"torch.utils.cpp_extension": "No CUDA runtime is found"}
"""logger -> the start of the message it logs at import on a machine without CUDA."""

UPSTREAM_PACKAGES = frozenset(
    {
        "megatron",
        "torch",
        "transformer_engine",
        "apex",
        "triton",
        "transformers",
        "tokenizers",
        "sentencepiece",
        "numpy",
        "yaml",
        "matplotlib",
        "tensorboard",
        "google",  # protobuf, under tensorboard
        "mamba_ssm",
        "causal_conv1d",
    }
)
"""Top-level packages whose deprecation warnings are theirs to fix, not the user's."""

DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
HIDDEN_LINE = "megatron-ext: {n} upstream warning{s} hidden; --verbose shows them"

_NOISE = re.compile("|".join(f"(?:{message})" for message in UPSTREAM_NOISE))


class _State:
    hidden = 0
    verbose = False
    logger_filters = False
    show: object = None  # the installed warnings.showwarning


def from_upstream(filename: str) -> bool:
    """Whether a warning's file lies in an upstream package (and not in megatron-ext, whatever
    directory megatron-ext sits in)."""
    parts = Path(filename).parts
    return "megatron_ext" not in parts and any(part in UPSTREAM_PACKAGES for part in parts)


def is_upstream_noise(message: str, category: type[Warning], filename: str) -> bool:
    """The rule of this module for one warning (see the module docstring)."""
    if not from_upstream(filename):
        return False
    if issubclass(category, DEPRECATIONS):
        return True
    return issubclass(category, UserWarning) and bool(_NOISE.match(message))


def _show(message, category, filename, lineno, file=None, line=None, _show_original=None):
    if not _State.verbose and is_upstream_noise(str(message), category, filename):
        _State.hidden += 1
        return
    _show_original(message, category, filename, lineno, file, line)


class _CountMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if _State.verbose or not str(record.msg).startswith(self.prefix):
            return True
        _State.hidden += 1
        return False


def silence_upstream_noise(verbose: bool = False) -> None:
    """Count upstream noise from now on (before megatron or torch is imported), or show it all
    with ``verbose``. Calling it again only changes ``verbose`` and restarts the count."""
    _State.verbose, _State.hidden = verbose, 0
    if warnings.showwarning is not _State.show:  # not yet, or put back (catch_warnings)
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            _show(message, category, filename, lineno, file, line, _show_original=original)

        warnings.showwarning = _State.show = show
    if not _State.logger_filters:
        _State.logger_filters = True
        for name, prefix in TORCH_LOGGER_NOISE.items():
            logging.getLogger(name).addFilter(_CountMessage(prefix))


def hidden() -> int:
    """How many upstream warnings were hidden since :func:`silence_upstream_noise`."""
    return _State.hidden


def report_hidden(stream=None) -> None:
    """The one line that stands for the hidden warnings (nothing when none were hidden)."""
    if _State.hidden:
        n = _State.hidden
        print(HIDDEN_LINE.format(n=n, s="" if n == 1 else "s"), file=stream or sys.stderr)
