"""Stop signals that save: a run asked to stop (SIGTERM, SIGUSR1) saves a checkpoint at the next
iteration boundary through megatron.training's own exit-signal handling, then ends resumable.

megatron.training listens for one signal (``--exit-signal-handler --exit-signal SIG``): its
handler only records the signal, and after each iteration every rank all-gathers the flag,
saves (``--save``) and leaves the training loop with status 0. megatron-ext's ranks listen for
:data:`SAVE_SIGNAL` (SIGUSR1), so a plain SIGTERM from the local launcher (Ctrl-C, a failed
peer, a timeout) still stops a rank at once. The launcher turns its own SIGTERM / SIGUSR1 into
:data:`SAVE_SIGNAL` for every rank; a Slurm job's ranks also route the SIGTERM Slurm sends them
(``scancel``, preemption, the time limit) to it (:data:`ROUTE_ENV`).

Two gaps of the upstream handler are closed on the rank side, by :func:`install_rank_handlers`
(called before megatron initialises) and :func:`redeliver_pending` (at every forward step):
a signal that arrives before Megatron installed its handler (start-up, data, model build) is
held and delivered again once training runs, instead of ending the rank by the signal's
default action.
"""

from __future__ import annotations

import os
import signal

from megatron_ext.errors import EnvVariableError

SAVE_SIGNAL = signal.SIGUSR1
"""What megatron-ext's ranks pass as ``--exit-signal``: the launchers send it to ask for a save."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""What the launchers (``megatron-ext run``, the Slurm batch script) accept as 'save and stop'."""

ROUTE_ENV = "MEGATRON_EXT_SAVE_ON"
"""Comma-separated signal names a rank turns into :data:`SAVE_SIGNAL` (Slurm jobs: SIGTERM)."""

EXIT_STOPPED = 75
"""``megatron-ext run`` / the Slurm job: stopped by a signal, resumable (sysexits' EX_TEMPFAIL:
'try again later'); ``megatron-ext run --resume RUN_DIR`` continues it."""


def megatron_args() -> list[str]:
    """The flags that make megatron.training save and stop on :data:`SAVE_SIGNAL`."""
    return ["--exit-signal-handler", "--exit-signal", SAVE_SIGNAL.name]


def parse_signals(text: str) -> list[signal.Signals]:
    """'SIGTERM,USR1' -> [SIGTERM, SIGUSR1]; EnvVariableError names an unknown one."""
    out = []
    for name in (n.strip().upper() for n in text.split(",") if n.strip()):
        full = name if name.startswith("SIG") else f"SIG{name}"
        try:
            out.append(signal.Signals[full])
        except KeyError:
            raise EnvVariableError(f"{ROUTE_ENV}: unknown signal {name!r}") from None
    return out


_pending: list[int] = []


def _hold(signum: int, _frame) -> None:
    """Before Megatron's handler exists: remember the request (the default would end the rank)."""
    _pending.append(signum)


def _route(signum: int, _frame) -> None:
    os.kill(os.getpid(), _exit_signal)


_exit_signal: signal.Signals = SAVE_SIGNAL


def exit_signal_of(argv: list[str]) -> signal.Signals | None:
    """The signal megatron.training will listen for with these flags (None: no handler)."""
    if "--exit-signal-handler" not in argv:
        return None
    if "--exit-signal" in argv[:-1]:
        return parse_signals(argv[argv.index("--exit-signal") + 1])[0]
    return signal.SIGTERM  # megatron.training's default --exit-signal


def install_rank_handlers(argv: list[str]) -> None:
    """In a rank, before megatron initialises: hold an early exit signal, route :data:`ROUTE_ENV`'s."""
    global _exit_signal
    sig = exit_signal_of(argv)
    if sig is None:
        return
    _exit_signal = sig
    signal.signal(_exit_signal, _hold)
    for sig in parse_signals(os.environ.get(ROUTE_ENV, "")):
        if sig != _exit_signal:
            signal.signal(sig, _route)


def redeliver_pending() -> int | None:
    """Once Megatron's handler has replaced :func:`_hold`, send it a held request (returns it)."""
    if not _pending or signal.getsignal(_exit_signal) is _hold:
        return None
    _pending.clear()
    os.kill(os.getpid(), _exit_signal)
    return int(_exit_signal)
