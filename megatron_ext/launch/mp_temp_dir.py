"""One multiprocessing temporary directory per run, shared by every process of its ranks.

Python's multiprocessing makes a ``pymp-*`` directory in the system temporary directory the
first time a process needs one (a ``listener-*`` socket: a Manager's server, or the resource
sharer that hands a file descriptor to another process) and removes it in that process's exit
handler. PyTorch's DataLoader workers need one as soon as they send a batch (a tensor's shared
memory travels as a file descriptor), and they never run that handler: a failing rank's
multiprocessing clean-up, the launcher's stop and a killed rank's group all end them with a
signal. One ``make test`` left 27 such directories (issue 41, item 13), six per rank of a run
that failed or was stopped (two workers for each of megatron's train, valid and test loaders).

A process started by multiprocessing (forked or spawned) inherits its parent's directory, so:

- the local launcher (:mod:`megatron_ext.launch.local`) makes one ``pymp-*`` directory per run,
  hands it to the ranks through :data:`DIR_ENV` and removes it once the ranks and everything in
  their process groups have ended, however they ended;
- each rank adopts it (:func:`share_with_children`) before it starts any worker, so every
  socket of its workers lies there. A rank started otherwise (torchrun, srun) makes its own at
  that point instead: its workers still share it, and the rank's exit handler removes it, also
  on the failing path (:func:`megatron_ext.launch.faults.run_failing_fast`).

A launcher killed with SIGKILL runs no clean-up: its (empty, once the workers are gone)
directory stays, as every other process's would.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from megatron_ext import registry

DIR_ENV = "MEGATRON_EXT_MP_TEMP_DIR"
"""The run's multiprocessing temporary directory, set by the local launcher for its ranks."""

PREFIX = "pymp-"
"""multiprocessing's own prefix: a directory left by a killed launcher is named as Python's."""


@contextlib.contextmanager
def for_the_ranks() -> Iterator[str]:
    """Launcher side: a fresh directory for one run's ranks, removed when the block ends (the
    caller ends every process of the ranks first). Made where multiprocessing would make each
    process's own, with the same name length, so no socket path inside is any longer."""
    directory = tempfile.mkdtemp(prefix=PREFIX)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def share_with_children() -> str:
    """Rank side, before any child process starts: this process's multiprocessing temporary
    directory is the launcher's (:data:`DIR_ENV`), or else one made now; the children started
    afterwards (DataLoader workers, a Manager's server) inherit it. Returns it."""
    given = os.environ.get(DIR_ENV)
    if given and os.path.isdir(given):
        # not multiprocessing's to remove: no exit handler is registered for it here, the
        # launcher removes it after the last process that could use it has ended
        registry.private("multiprocessing.process:current_process()._config")["tempdir"] = given
        return given
    import multiprocessing.util

    return multiprocessing.util.get_temp_dir()
