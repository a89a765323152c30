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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

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


@contextlib.contextmanager
def torch_compile_deferred() -> Iterator[None]:
    """Run a block that imports megatron (lazily, e.g. the CLI's recipe checks) with the patch."""
    defer_torch_compile()
    try:
        yield
    finally:
        restore_torch_compile()
