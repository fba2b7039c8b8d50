"""User-facing errors.

Every mistake a user can make in a config, a path or a checkpoint ends in a :class:`ConfigError`. The ``pl-fed``
entry point catches it and prints exactly one line (``error: <message>``) with a non-zero exit status, never a
traceback. Messages name the parameter, the value received and what is allowed.
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = [
    "STORAGE_ADVICE",
    "STORAGE_ERRNOS",
    "CheckpointError",
    "ConfigError",
    "DataNotFoundError",
    "StorageError",
    "cause_of",
    "check",
    "storage_error",
    "with_path",
]

#: the errors of a storage that stopped taking writes (not of a wrong path): full disk, quota, I/O error, read-only
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})

#: what to do about each storage error (also the CLI's hint for an unhandled one)
STORAGE_ADVICE = {
    errno.ENOSPC: "the disk is full: free some space or move the run (--trainer.default_root_dir)",
    errno.EDQUOT: "the disk quota is exceeded: free some space or move the run (--trainer.default_root_dir)",
    errno.EIO: "the storage reported an I/O error: check the disk or move the run (--trainer.default_root_dir)",
    errno.EROFS: "the file system is read-only: move the run (--trainer.default_root_dir)",
    errno.EFBIG: "the file is larger than the file system allows: move the run (--trainer.default_root_dir)",
}


class ConfigError(ValueError):
    """A configuration value, path or input that the user can fix."""


class DataNotFoundError(ConfigError):
    """A dataset is missing locally and cannot be downloaded; the message says how to get it."""


class CheckpointError(ConfigError):
    """A checkpoint is unreadable, corrupted or belongs to another configuration."""


def cause_of(exc: BaseException | None, kind: type[BaseException] | tuple[type[BaseException], ...]) -> Any:
    """The first exception of type ``kind`` in ``exc``'s chain (``exc`` itself, then its ``__cause__`` or
    ``__context__``, ...); ``None`` when there is none. E.g. the ``OSError`` behind torch's "unexpected pos"
    ``RuntimeError``, or the ``KeyboardInterrupt`` behind Lightning's ``sys.exit(1)``.

    Example:
        >>> try:
        ...     try:
        ...         raise OSError(28, "No space left on device")
        ...     except OSError:
        ...         raise RuntimeError("unexpected pos")
        ... except RuntimeError as e:
        ...     cause_of(e, OSError).errno
        28
    """
    seen, hops = exc, 0
    while seen is not None and hops < 16:
        if isinstance(seen, kind):
            return seen
        seen, hops = seen.__cause__ or seen.__context__, hops + 1
    return None


class StorageError(OSError):
    """Writing a run's file failed because the storage stopped taking writes (:data:`STORAGE_ERRNOS`). ``pl-fed``
    prints its one line and exits with status 74 (``EX_IOERR``); the previous checkpoint is intact."""

    def __str__(self) -> str:
        return str(self.strerror)


def with_path(e: OSError, path: str | os.PathLike[str]) -> OSError:
    """``e`` naming ``path`` when it names no file (a failed ``write()`` does not say which file it was writing).

    Example:
        >>> with_path(OSError(errno.ENOSPC, "No space left on device"), "/r/run.json").filename
        '/r/run.json'
    """
    if e.filename is not None:
        return e
    return OSError(e.errno, e.strerror or str(e), str(path))


def storage_error(e: OSError, what: str, state: str) -> StorageError:
    """The one-line :class:`StorageError` for ``e``: the file, what failed, why, what to do and what is left.

    Args:
        e: the error the write raised.
        what: what was being done (``"writing the checkpoint"``).
        state: what is left intact / how to continue.

    Example:
        >>> e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/r/checkpoints/round-000003.ckpt")
        >>> print(storage_error(e, "writing the checkpoint", "nothing else was changed"))
        ... # doctest: +NORMALIZE_WHITESPACE
        /r/checkpoints/round-000003.ckpt: writing the checkpoint failed: No space left on device (the disk is full:
        free some space or move the run (--trainer.default_root_dir); nothing else was changed)
    """
    path = os.fsdecode(e.filename) if isinstance(e.filename, (str, bytes, os.PathLike)) else None
    problem = e.strerror or os.strerror(e.errno or 0) or type(e).__name__
    advice = STORAGE_ADVICE.get(e.errno or 0, "check the storage")
    text = f"{path + ': ' if path else ''}{what} failed: {problem} ({advice}; {state})"
    return StorageError(e.errno, text, path)


def check(condition: bool, param: str, value: Any, allowed: str) -> None:
    """Raise :class:`ConfigError` with the project's one-line format unless ``condition`` holds.

    Args:
        condition: what must hold.
        param: the dotted config name of the parameter (e.g. ``"data.alpha"``).
        value: the value received.
        allowed: a short description of what is allowed (e.g. ``"a number > 0"``).

    Example:
        >>> check(0.5 > 0, "data.alpha", 0.5, "a number > 0")
        >>> check(-1 > 0, "data.alpha", -1, "a number > 0")
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: data.alpha=-1 is invalid: expected a number > 0
    """
    if not condition:
        raise ConfigError(f"{param}={value!r} is invalid: expected {allowed}")
