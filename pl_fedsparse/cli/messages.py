"""How a stopped or failed command is told in one line: a configuration error found inside a library's exception, an
interrupted run (the round its last checkpoint holds and the command that resumes it) and an :class:`OSError`
nobody else handled (the path, the problem and what to do).
"""

from __future__ import annotations

import errno
import os
import re
import shlex
from pathlib import Path
from typing import Any

from pl_fedsparse.cli.help import PROG
from pl_fedsparse.errors import (
    STORAGE_ADVICE,
    ConfigError,
    UserCodeError,
)
from pl_fedsparse.loop import FederatedLoop
from pl_fedsparse.signals import STOPPING, Terminated, stop_word

__all__ = ["EXIT_STORAGE"]


#: the exit status of a run stopped by a storage failure (sysexits.h ``EX_IOERR``)
EXIT_STORAGE = 74

_OUR_FORMAT = re.compile(r"(\S+=.+ is invalid: expected .+)$")


def _config_error_in(exc: BaseException) -> BaseException:
    """The :class:`ConfigError` (or :class:`OSError`) behind an exception jsonargparse raised while instantiating a
    class.

    jsonargparse re-raises constructor errors of nested classes (e.g. a callback in ``trainer.callbacks``) as a
    ``ValueError`` listing every type it tried; the user's mistake is the line in our own format.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ConfigError, OSError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    for line in str(exc).splitlines():
        m = _OUR_FORMAT.search(line.strip().lstrip("- ").strip())
        if m:
            return ConfigError(m.group(1))
    # a class of the user's whose __init__ raised: jsonargparse lists the message among the union's errors and names
    # the class in the value it was given
    text = str(exc)
    path = re.search(r"class_path='([^']+)'", text)
    errors = re.search(r"\nErrors:\n\s*- (.+)", text)
    if path and errors and not errors.group(1).startswith(("Expected a", "Not a valid", "Import path", "Problem with")):
        owner = _raising_init(exc) or path.group(1)  # (a nested class, e.g. model.backbone, names its own)
        err = UserCodeError(f"{owner}.__init__ raised: {' '.join(errors.group(1).split())} (while building "
                            "the configured classes)")
        err.__cause__ = exc  # (PL_FED_DEBUG=1: jsonargparse's account, which lists every type it tried)
        return err
    return exc


def _raising_init(exc: BaseException) -> str | None:
    """``module.Class`` of the innermost ``__init__`` outside installed packages (the user's class, or ours) in the
    tracebacks of ``exc``'s chain: which of the configured classes raised, where jsonargparse names only the
    outermost one (``model`` for a failing ``model.backbone``)."""
    seen: BaseException | None = exc
    while seen is not None:
        found, tb = None, seen.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            owner = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
            if owner is not None and "site-packages" not in frame.f_code.co_filename \
                    and "/lib/python" not in frame.f_code.co_filename:
                found = f"{type(owner).__module__}.{type(owner).__qualname__}"
            tb = tb.tb_next
        if found is not None:
            return found
        seen = seen.__cause__ or seen.__context__
    return None


# ---------------------------------------------------------------------------------------------- messages
def _as_received(e: KeyboardInterrupt, received: list[int]) -> KeyboardInterrupt:
    """The interrupt as the signal that started it: code that catches an interrupt and raises a new plain
    ``KeyboardInterrupt`` (``ray.get`` does) must not turn a SIGTERM (exit 143) into a Ctrl-C (exit 130)."""
    if received and received[0] in STOPPING and not isinstance(e, Terminated):
        return Terminated(received[0])
    return e


def _interrupted_message(run: tuple[str | None, FederatedLoop] | None,
                         interrupt: KeyboardInterrupt | None = None) -> str:
    """What an interrupted run left behind and how to continue it."""
    word = stop_word(interrupt)
    subcommand, loop = run if run is not None else (None, None)
    if subcommand != "fit" or loop is None:
        return word
    if loop.run_dir is None:
        opening = getattr(getattr(getattr(loop, "reporter", None), "directory", None), "run_dir", None)
        if opening is not None and Path(opening).is_dir():  # (its first files written, no round run)
            return f"{word} while the run directory {opening} was being opened, before any round: run the command again"
        return f"{word} before the run directory was opened: nothing was written, run the command again"
    rd = Path(loop.run_dir)
    ckpt = rd / "checkpoints" / "last.ckpt"
    done = loop.reporter.directory.checkpoint_round  # (None: this run has written none, whatever the folder holds)
    if not ckpt.is_file() or done is None:
        return f"{word}: no checkpoint was written in {rd} (trainer.checkpoint_every=" \
               f"{loop.checkpoint_every}), the run cannot be resumed"
    # counted as the progress lines count (round k/N from 1), with metrics.jsonl's numbers (from 0) beside
    held = "round 0" if done == 1 else f"rounds 0 to {done - 1}"
    at = (f" (the checkpoint holds {done} completed round{'s' if done != 1 else ''}, {held} in metrics.jsonl; the "
          f"resumed run continues with round {done + 1}/{loop.num_rounds})") if done else \
        " (no round had completed)" if done == 0 else ""
    q = shlex.quote  # a path with a space or a quote still makes a command the shell runs as printed
    config = f"--config {q(str(rd / 'config.yaml'))} " if (rd / "config.yaml").is_file() else ""
    return f"{word}: resume with `{PROG} fit {config}--trainer.default_root_dir {q(str(rd))} " \
           f"--ckpt_path {q(str(ckpt))}`{at}"


_OS_HINTS = {
    errno.ENOTDIR: "a component of the path is a file, not a directory",
    errno.EACCES: "this user may not access it: fix the permissions or choose another path",
    errno.EPERM: "this user may not access it: fix the permissions or choose another path",
    errno.EEXIST: "it already exists: remove it or choose another path",
    errno.EISDIR: "it is a directory, a file was expected",
    errno.ENAMETOOLONG: "choose a shorter path",
    **STORAGE_ADVICE,  # full disk, quota, I/O error, read-only: one wording with StorageError's
}


def _path_text(name: Any) -> str | None:
    if isinstance(name, (str, bytes, os.PathLike)):
        return os.fsdecode(name)
    return None if name is None else str(name)  # e.g. a file descriptor


def _inside(path: str, directory: str) -> bool:
    try:
        a, d = os.path.abspath(path), os.path.abspath(directory)
        return os.path.commonpath([a, d]) == d
    except ValueError:
        return False


def _os_error_message(e: OSError, run: tuple[str | None, FederatedLoop] | None) -> str:
    """``<path>: <problem> (<where>; <what to do>)`` for an :class:`OSError`, in full."""
    problem = e.strerror or str(e) or type(e).__name__
    path, path2 = _path_text(e.filename), _path_text(e.filename2)
    hints = []
    loop = run[1] if run is not None else None
    rd = None if loop is None else (loop.run_dir or loop.default_root_dir)
    if rd is not None and (path is None or _inside(path, str(rd))):
        hints.append(f"trainer.default_root_dir={str(rd)!r}")
    if e.errno in _OS_HINTS:
        hints.append(_OS_HINTS[e.errno])
    text = problem if path is None else f"{path}{' -> ' + path2 if path2 else ''}: {problem}"
    return text + (f" ({'; '.join(hints)})" if hints else "")
