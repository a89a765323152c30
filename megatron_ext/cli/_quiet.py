"""Upstream start-up warnings the ``megatron-ext`` command does not show, each by its text.

Importing megatron on a machine without Transformer Engine, Apex or CUDA prints 10-20 lines
(megatron's "... not installed. Falling back ..." from several modules, torch's "No CUDA runtime
is found") before a command's own output. They describe this machine, which ``megatron-ext
doctor`` reports in one place, and they bury the line the user ran the command for. Only these
messages are silenced, by name; every other warning still shows, and the training ranks (whose
logs are the record of a run) are not affected.
"""

from __future__ import annotations

import logging
import warnings

UPSTREAM_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"Only transformer-engine>=\S+ supports MoE experts",
)
"""Messages (regular expressions matched at their start) of megatron's UserWarnings."""

TORCH_LOGGER_NOISE = {"torch.utils.cpp_extension": "No CUDA runtime is found"}
"""logger -> the start of the message it logs at import on a machine without CUDA."""


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_upstream_noise() -> None:
    """Install the filters (before megatron or torch is imported)."""
    for message in UPSTREAM_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name, prefix in TORCH_LOGGER_NOISE.items():
        logging.getLogger(name).addFilter(_DropMessage(prefix))
