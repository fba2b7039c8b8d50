"""Stopping a run on a signal: SIGTERM (what a cluster scheduler sends before preemption), SIGHUP (its terminal
closed) and SIGINT (Ctrl-C).

Inside :func:`stop_on_signals` the first SIGTERM raises :class:`Terminated` and the first SIGINT raises
:class:`KeyboardInterrupt` in the main thread, wherever it is — inside a client's Lightning fit, during evaluation,
during a checkpoint write, while Ray workers train. Both unwind the run like any exception: the temporary file of a
checkpoint being written is removed (``checkpoints/last.ckpt`` stays the last completed checkpoint), out-of-process
workers are stopped, the run directory's lock is released. Further signals while that happens are recorded and
ignored, so the cleanup itself is never interrupted (SIGKILL still ends the process). ``pl-fed`` then prints the
resume command and exits with 128 + the signal number: 143 for SIGTERM, 129 for SIGHUP, 130 for SIGINT.

Lightning's own SIGTERM handler (installed for each fit) calls the handler it found installed, so a SIGTERM during a
client's fit reaches this one too; Lightning turns the resulting interrupt into ``sys.exit(1)``, which
:func:`interrupt_in` recognises.

The Python API is unchanged outside this context manager (a ``FederatedLoop.fit`` called from a notebook keeps the
notebook's handlers); wrap a call in ``with stop_on_signals(): loop.fit(...)`` to get the same behaviour.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from pl_fedsparse.errors import cause_of

__all__ = ["STOPPING", "Terminated", "deferred_signals", "exit_status", "interrupt_in", "stop_on_signals", "stop_word"]


#: the signals that stop a run as a scheduler's SIGTERM does: SIGTERM, and SIGHUP (its terminal closed) where the
#: platform has it — the run checkpoints and releases its directory rather than dying with the lock behind it
STOPPING = (signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by the first SIGTERM inside :func:`stop_on_signals`.

    A subclass of :class:`KeyboardInterrupt`, so that everything that stops cleanly on Ctrl-C (Lightning's
    graceful shutdown, the loop's cleanup, client-fault containment, which never catches it) stops cleanly on SIGTERM.
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum


def stop_word(interrupt: KeyboardInterrupt | None) -> str:
    """How a stop is told: ``"terminated (SIGTERM)"`` (or the signal that stopped it), ``"interrupted"`` for Ctrl-C."""
    if isinstance(interrupt, Terminated):
        return f"terminated ({signal.Signals(interrupt.signum).name})"
    return "interrupted"


def exit_status(interrupt: KeyboardInterrupt) -> int:
    """``128 + signal number``: 143 for :class:`Terminated` (SIGTERM), 130 for Ctrl-C."""
    return 128 + int(getattr(interrupt, "signum", signal.SIGINT))


def interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The :class:`KeyboardInterrupt` (or :class:`Terminated`) that ``exc`` is, or that caused it — Lightning ends an
    interrupted fit with ``sys.exit(1)`` raised while handling the interrupt."""
    return cause_of(exc, KeyboardInterrupt)


@contextmanager
def stop_on_signals() -> Iterator[list[int]]:
    """Within the block, the first SIGTERM raises :class:`Terminated` and the first SIGINT :class:`KeyboardInterrupt`;
    later ones are ignored (and listed in the yielded list). The previous handlers are restored on exit. Outside the
    main thread (where signals cannot be handled) it does nothing."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if len(received) > 1:
            return  # already stopping: let the cleanup finish
        if _DEFERRED["depth"] > 0:
            _DEFERRED["pending"].append(signum)  # raised when the deferred block ends
            return
        if signum in STOPPING:
            raise Terminated(signum)
        raise KeyboardInterrupt

    previous = {s: signal.getsignal(s) for s in (*STOPPING, signal.SIGINT)}
    for s in previous:
        signal.signal(s, handler)
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


#: the main thread's deferred blocks: their depth and the signals that arrived inside them
_DEFERRED: dict[str, Any] = {"depth": 0, "pending": []}


@contextmanager
def deferred_signals() -> Iterator[None]:
    """Inside the block, the interrupt of a SIGTERM or SIGINT (from :func:`stop_on_signals`) waits until the block
    ends. This is for the few statements that create a file and record it for cleanup (a lock, a temporary file), so
    that an interrupt cannot fall between the two and leave the file behind. A Python-level deferral: another thread
    may receive the OS signal, but only the main thread runs the handler, and it checks this block. Outside the main
    thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _DEFERRED["depth"] += 1
    try:
        yield
    finally:
        _DEFERRED["depth"] -= 1
        if _DEFERRED["depth"] == 0 and _DEFERRED["pending"]:
            signum = _DEFERRED["pending"][0]
            _DEFERRED["pending"].clear()
            raise Terminated(signum) if signum in STOPPING else KeyboardInterrupt
