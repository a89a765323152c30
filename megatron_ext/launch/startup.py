"""Start-up cost of our processes: importing megatron without loading torch's compiler.

megatron-core decorates its fusion functions with ``torch.compile`` at import time
(``megatron.core.jit.jit_fuser``). Each decoration imports ``torch._dynamo`` and
``torch._inductor``, about 40 % of the CPU time of importing a training entry point: ~4 of
~10 CPU-seconds per rank, measured with ``python -X importtime -c "import
megatron_ext.pretrain_gpt"``. A run pays that on every rank and again in the ``megatron-ext``
process that validates the recipe, although a CPU run never calls those functions.

While megatron is imported, :func:`compile_on_first_call` stands in for ``torch.compile``: a
decorated function compiles through the real ``torch.compile`` when it is first called.
``torch.compile`` already compiles lazily on the first call, so what runs is unchanged; only the
import of the compiler moves to the first call that needs it. Modules and other callables go to
the real ``torch.compile`` at once. The replacement is the registry's temporary "startup" patch.

The entry points also pause Python's cyclic garbage collector while they import
(:func:`begin_entry_imports`): the imports create millions of long-lived objects, and the
collections they trigger walk them again and again for nothing (~0.6 of ~4 CPU-seconds per
process, measured with ``time.process_time()`` around ``import megatron_ext.pretrain_gpt``).
:func:`end_entry_imports` resumes collection; whatever garbage the imports left is collected
then, as usual.

The end costs as much: clearing ~2,900 modules and a last collection of their objects took
3.5-5.6 s of a 19-26 s ``validate`` on a loaded 2-core machine, and 10-17 s between the last
checkpoint and the exit of a 4-rank CPU run (under load; measured from the ranks' logs). The
``megatron-ext`` program and the training entries therefore end with :func:`exit_now`.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from megatron_ext import registry

STARTUP_GROUP = "startup"


def compile_on_first_call(compile_now: Callable[..., Any]) -> Callable[..., Any]:
    """A ``torch.compile`` that compiles a plain function at its first call."""

    def deferred_compile(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: deferred_compile(fn, **options)
        if not inspect.isfunction(model):
            return compile_now(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_now(model, **options)
            return compiled(*args, **kwargs)

        return call

    return deferred_compile


def defer_torch_compile() -> None:
    """Apply the "startup" patch: call before an entry point's megatron imports."""
    registry.apply(STARTUP_GROUP)


def restore_torch_compile() -> None:
    """Undo it: call once the imports are done (functions decorated meanwhile keep deferring)."""
    registry.undo(STARTUP_GROUP)


# Nesting depth of begin_entry_imports, and whether the collector ran before the outermost one.
_paused_imports = 0
_collector_was_enabled = False


def begin_entry_imports() -> None:
    """Before an entry point's megatron imports: defer ``torch.compile`` and pause the cyclic
    garbage collector (nestable; each call needs its :func:`end_entry_imports`)."""
    global _paused_imports, _collector_was_enabled
    defer_torch_compile()
    if _paused_imports == 0:
        _collector_was_enabled = gc.isenabled()
        gc.disable()
    _paused_imports += 1


def end_entry_imports() -> None:
    """After them: ``torch.compile`` restored and (by the outermost call) collection resumed."""
    global _paused_imports
    restore_torch_compile()
    _paused_imports = max(_paused_imports - 1, 0)
    if _paused_imports == 0 and _collector_was_enabled:
        gc.enable()


def torch_compile_deferred() -> contextlib.AbstractContextManager[None]:
    """A block that imports megatron (lazily, e.g. the CLI's recipe checks) with the patch;
    inside an entry's import window it leaves that window's patch in place."""
    return registry.applied_for(STARTUP_GROUP)


def exit_now(status: int | None) -> None:
    """End the process with ``status`` once the work is done: the exit handlers run and the
    output is flushed, then ``os._exit`` skips the interpreter's teardown, which does nothing
    anyone waits for: files are written through ``with`` blocks, children are reaped, and
    ``atexit`` work (logging, tempfile cleanup, a trace's file) still runs here."""
    registry.private("atexit:_run_exitfuncs")()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to deliver
            pass
    os._exit(status or 0)


def end_rank(status: int | None = 0) -> None:
    """A training entry's last call on a rank whose training returned: after a success, wait
    until every rank got here (none leaves while a peer may still wait on it in a collective; megatron has
    flushed TensorBoard and finished its saves before ``pretrain`` returns), then
    :func:`exit_now`."""
    import torch.distributed as dist

    if not status and dist.is_available() and dist.is_initialized():
        dist.barrier()
    exit_now(status)
