"""``--log-mhc-stats`` in megatron.training: the mHC statistics of :mod:`megatron_ext.mhc.stats`
on the log interval, written beside megatron's own scalars.

:func:`logging_mhc_stats` wraps megatron's ``training_log`` (a declared patch,
:mod:`megatron_ext.declarations`), which every rank calls after every step. On a logged
iteration it gathers the figures the hyper connections recorded during that step (every rank
takes part in the gather), writes them to TensorBoard through megatron's writer (the last
rank's) and prints the gains on the last rank; then it arms the recorder only for the step
before the next log, so other steps record nothing. Without ``--log-mhc-stats`` it only calls
the original.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from megatron_ext.mhc import stats


def start_if_requested(args: Any) -> None:
    """Switch recording on before training when ``--log-mhc-stats`` is given. The first step
    records (the start iteration is not known yet; unlogged, its samples are dropped)."""
    if getattr(args, "log_mhc_stats", False):
        stats.enable()


def write(figures: dict[str, float], iteration: int) -> None:
    """TensorBoard (megatron's writer exists on the last rank only) and one console line."""
    from megatron.training.global_vars import get_tensorboard_writer
    from megatron.training.utils import is_last_rank

    writer = get_tensorboard_writer()
    if writer is not None:
        add_scalars(writer, figures, iteration)
    line = console_line(figures, iteration)
    if is_last_rank() and line:
        print(line, flush=True)


def add_scalars(writer: Any, figures: dict[str, float], iteration: int) -> None:
    """Every figure as a TensorBoard scalar under its ``mhc/...`` name."""
    for name, value in sorted(figures.items()):
        writer.add_scalar(name, value, iteration)


def console_line(figures: dict[str, float], iteration: int) -> str | None:
    """`` mHC [iteration N]: forward gain X, backward gain Y`` (+ the MTP path's), or None."""
    if stats.FORWARD_GAIN not in figures:
        return None
    line = (
        f" mHC [iteration {iteration}]: forward gain {figures[stats.FORWARD_GAIN]:.6f}, "
        f"backward gain {figures[stats.BACKWARD_GAIN]:.6f}"
    )
    if stats.MTP_FORWARD_GAIN in figures:
        line += (
            f"; MTP path forward gain {figures[stats.MTP_FORWARD_GAIN]:.6f}, "
            f"backward gain {figures[stats.MTP_BACKWARD_GAIN]:.6f}"
        )
    return line


def logging_mhc_stats(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap megatron.training's ``training_log`` (iteration is its 4th argument)."""

    @functools.wraps(original)
    def training_log(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        recorder = stats.recorder()
        if recorder is None:
            return result
        from megatron.training import get_args

        iteration = args[3] if len(args) > 3 else kwargs["iteration"]
        interval = get_args().log_interval
        if iteration % interval == 0:
            figures = stats.collect(recorder)
            if figures:
                write(figures, iteration)
        recorder.samples.clear()
        recorder.armed = (iteration + 1) % interval == 0
        return result

    return training_log


__all__ = ["add_scalars", "console_line", "logging_mhc_stats", "start_if_requested", "write"]
