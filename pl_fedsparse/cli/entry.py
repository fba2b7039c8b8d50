"""The ``pl-fed`` console script, :func:`console_main`: the command's signals handled from its first moment.

This module imports nothing heavy (no torch, no Lightning: the package's ``__init__`` files import their names on
first use), so its handlers are in place before the seconds :mod:`pl_fedsparse.cli.commands` takes to import; and
``pl-fed configs``, ``report`` and ``sweep`` (:mod:`pl_fedsparse.cli.own`), which need none of it, run without
those imports.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from pl_fedsparse.cli.help import OWN_SUBCOMMANDS, PROG
from pl_fedsparse.signals import STOPPING, exit_status, stop_on_signals, stop_word

__all__ = ["console_main"]


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def console_main() -> None:
    """The ``pl-fed`` console script: :func:`~pl_fedsparse.cli.commands.main`, with the process's first and last
    seconds covered too.

    Before ``main`` (torch and Lightning take seconds to import), SIGINT, SIGTERM or SIGHUP ends the process with
    one line and ``128 + signal number`` (130 for Ctrl-C, 143 for SIGTERM): nothing was run or written. While
    ``main`` works, they raise :class:`KeyboardInterrupt` / :class:`~pl_fedsparse.signals.Terminated`
    (:func:`~pl_fedsparse.signals.stop_on_signals`): ``fit`` and ``sweep`` stop with their checkpoint and say so;
    another command (``report``) ends with ``pl-fed: interrupted`` and the same status, its files written whole or
    not at all. After it, the interpreter still shuts down (threads, caches) for up to a second, where a
    scheduler's SIGTERM used to end the process silently with -15; here it ends it with one line and ``main``'s own
    exit status: the work was done.
    """
    done: dict[str, int | None] = {"code": None}

    def stopped(signum: int, frame: Any) -> None:
        code = done["code"]
        what = signal.Signals(signum).name
        _flush()
        if code is None:
            code = 128 + int(signum)
            line = f"{PROG}: {what} while starting: stopped before anything was run (exit status {code})"
        else:
            line = f"{PROG}: {what} while exiting: ignored, the command had finished (exit status {code})"
        os.write(2, f"{line}\n".encode())
        os._exit(code)

    # SIGINT first: once the last of these is set, all are (a test waits for that)
    for s in (signal.SIGINT, *STOPPING):
        signal.signal(s, stopped)
    if sys.argv[1:2] and sys.argv[1] in OWN_SUBCOMMANDS:  # configs, report, sweep: no torch, no Lightning
        from pl_fedsparse.cli.own import run_own

        def main() -> int:
            return run_own(sys.argv[1:]) or 0
    else:
        from pl_fedsparse.cli.commands import main

    try:
        # while main runs, a signal is an exception, so files being written are cleaned up (a command that handles
        # it, `fit` and `sweep`, says what it stopped; another, `report`, ends here); `stopped` is back after it
        with stop_on_signals():
            code = main()
    except KeyboardInterrupt as e:  # (Terminated for SIGTERM / SIGHUP)
        code = exit_status(e)
        _flush()
        sys.stderr.write(f"{PROG}: {stop_word(e)} (exit status {code})\n")
    except SystemExit as e:  # (--help, a parse error): its status is the command's
        done["code"] = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    done["code"] = code
    sys.exit(code)
