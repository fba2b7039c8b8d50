"""``pl-fed``'s commands: :func:`main` (``fit``/``validate``/``test`` through :class:`~pl_fedsparse.cli.app.FedCLI`;
``configs``, ``report`` and ``sweep``) and :func:`check_entry` (a sweep's entry checked without running it); the
console script around them is :func:`pl_fedsparse.cli.entry.console_main`. Every error and stop ends in one line
(:mod:`pl_fedsparse.cli.messages`).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from pl_fedsparse.cli import app
from pl_fedsparse.cli.app import FedCLI
from pl_fedsparse.cli.help import OWN_SUBCOMMANDS, PROG
from pl_fedsparse.cli.own import run_own
from pl_fedsparse.cli.messages import EXIT_STORAGE, _as_received, _interrupted_message, _os_error_message
from pl_fedsparse.cli.workdir import _working_dir_importable
from pl_fedsparse.errors import (
    STORAGE_ERRNOS,
    ConfigError,
    RunStoppedError,
    StorageError,
    UserCodeError,
    debugging,
)
from pl_fedsparse.signals import exit_status, interrupt_in, stop_on_signals

__all__ = ["check_entry", "main"]


#: the end of a one-line error whose traceback PL_FED_DEBUG=1 prints
_DEBUG_HINT = " (PL_FED_DEBUG=1 prints its traceback)"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pl-fed`` console script."""
    words = sys.argv[1:] if argv is None else list(argv)
    if not words:  # `pl-fed` alone: the help, which lists every subcommand
        words = ["--help"]
        argv = words
    elif not words[0].startswith("-") and words[0] not in [*FedCLI.subcommands(), *OWN_SUBCOMMANDS]:
        sys.stderr.write(f"error: unknown subcommand {words[0]!r}: expected one of "
                         f"{', '.join([*FedCLI.subcommands(), *OWN_SUBCOMMANDS])} (see `{PROG} --help`)\n")
        return 2
    own = run_own(words)  # configs, report, sweep (pl_fedsparse.cli.own)
    if own is not None:
        return own
    app._current_run = None
    from pl_fedsparse.allocator import tune_malloc

    tune_malloc()  # glibc: keep freed fit buffers in the heap (PL_FEDSPARSE_MALLOC_TUNING=0 opts out)
    received: list[int] = []
    try:
        with stop_on_signals() as received, _working_dir_importable(os.getcwd()):
            FedCLI(args=argv)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (Terminated)
        e = _as_received(e, received)
        sys.stderr.write(_interrupted_message(app._current_run, e) + "\n")
        return exit_status(e)
    except SystemExit as e:
        interrupt = interrupt_in(e) if e.code == 1 else None  # Lightning's shutdown of an interrupted fit
        if interrupt is None:
            raise
        interrupt = _as_received(interrupt, received)
        sys.stderr.write(_interrupted_message(app._current_run, interrupt) + "\n")
        return exit_status(interrupt)
    except RunStoppedError as e:  # the federation cannot go on (its last checkpoint is intact)
        if e.__cause__ is not None and debugging():  # (a fit's exception behind on_client_fault=raise)
            traceback.print_exception(e.__cause__)
        sys.stderr.write(f"error: {e}{_DEBUG_HINT if e.__cause__ is not None and not debugging() else ''}\n")
        return 1
    except UserCodeError as e:  # the user's code raised: one line; its traceback on PL_FED_DEBUG=1
        if debugging():
            traceback.print_exception(e.__cause__ or e)
        sys.stderr.write(f"error: {e}{'' if debugging() else _DEBUG_HINT}\n")
        return 1
    except StorageError as e:
        sys.stderr.write(f"error: {e}\n")
        return EXIT_STORAGE
    except OSError as e:
        sys.stderr.write(f"error: {_os_error_message(e, app._current_run)}\n")
        return EXIT_STORAGE if e.errno in STORAGE_ERRNOS else 2
    finally:
        app._current_run = None
    return 0


def check_entry(args: Sequence[str]) -> int:
    """Build a ``pl-fed fit`` configuration's classes (model, data module, loop, callbacks: every argument check)
    without running it; 0, or the status of the one line it printed (``pl-fed sweep`` checks its entries so)."""
    try:
        with _working_dir_importable(os.getcwd()):
            FedCLI(args=list(args), run=False)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    except UserCodeError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    return 0
