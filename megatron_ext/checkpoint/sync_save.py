"""Synchronous ``torch_dist`` saves without a multiprocessing Manager.

megatron-core's ``FileSystemWriterAsync`` hands each save's write results to
``retrieve_write_results`` through ``filesystem_async.get_write_results_queue()``: a queue of a
``multiprocessing`` Manager started with ``spawn``, made for asynchronous saves, whose writer
runs in another process. A synchronous save (``AsyncRequest.execute_sync``, megatron.training
without ``--async-save``) writes and collects in the rank's own process, yet the first save of
every rank still spawns that Manager, and the Manager imports torch to unpickle the results:
seconds on the first save's critical path of every run that saves (the first save of the
4-rank ``hybrid_mhc_tp2_pp2_mtp`` recipe on CPU took 9.8 s, the second 0.6 s; with this patch
the first takes 0.5 s).

:func:`results_queue_for_sync_saves` stands in for ``get_write_results_queue`` (the registry's
core patch): while megatron.training's arguments say saves are synchronous it returns a plain
in-process queue (``put`` / ``get_nowait``, the two calls megatron makes), a new one per writer.
With ``--async-save``, or outside megatron.training (no parsed arguments), the original runs.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any


def _saves_are_synchronous() -> bool:
    try:
        from megatron.training.global_vars import get_args

        args = get_args()
    except (ImportError, AssertionError):  # not megatron.training, or arguments not parsed
        return False
    return args is not None and not getattr(args, "async_save", False)


def results_queue_for_sync_saves(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_write_results_queue`` returning an in-process queue for synchronous saves."""

    def get_write_results_queue(*args: Any, **kwargs: Any) -> Any:
        if _saves_are_synchronous():
            return queue.Queue()
        return original(*args, **kwargs)

    # a function takes attributes; mypy's type for a def has no __wrapped__
    get_write_results_queue.__wrapped__ = original  # type: ignore[attr-defined]
    get_write_results_queue.__doc__ = results_queue_for_sync_saves.__doc__
    return get_write_results_queue
