"""User-facing errors.

Every mistake a user can make in a config, a path or a checkpoint ends in a :class:`ConfigError`. The ``pl-fed``
entry point catches it and prints exactly one line (``error: <message>``) with a non-zero exit status, never a
traceback. Messages name the parameter, the value received and what is allowed.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "STORAGE_ADVICE",
    "STORAGE_ERRNOS",
    "CheckpointError",
    "ConfigError",
    "DataNotFoundError",
    "RunStoppedError",
    "StorageError",
    "UserCodeError",
    "cause_of",
    "check",
    "debugging",
    "one_line_text",
    "raised_in",
    "user_code",
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


class RunStoppedError(Exception):
    """The federation cannot go on (e.g. every participant's fit failed in a round): one line, exit status 1; the
    last checkpoint is intact."""


class UserCodeError(Exception):
    """The user's code (their module, data module or callback) raised: one line naming the class, the hook, where
    in the federation (client, round) and the exception's own message. ``pl-fed`` prints it as ``error: ...`` and
    exits 1; the traceback of the user's exception is printed too when ``PL_FED_DEBUG=1`` (it is the ``__cause__``).
    """


def one_line_text(text: Any, limit: int = 300) -> str:
    """``text`` (e.g. an exception, whose message may span lines) as one line of at most ``limit`` characters.

    Example:
        >>> one_line_text(ValueError("Unknown configuration.   Expected one of:   * an Optimizer"))
        'Unknown configuration. Expected one of: * an Optimizer'
        >>> len(one_line_text("x" * 500))
        300
    """
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def user_code(owner: Any, hook: str, where: str = "") -> Iterator[None]:
    """Run a call into the user's code: an exception it raises becomes one :class:`UserCodeError` line naming
    ``owner``'s class, ``hook``, ``where`` (e.g. ``"client 3, round 7, personal model"``) and the message.

    The engine's own one-line errors (:class:`ConfigError`, :class:`StorageError`, :class:`UserCodeError`,
    :class:`RunStoppedError`), file errors (``OSError``: the CLI names the file in one line) and interrupts pass
    through unchanged.

    Example:
        >>> class Net:
        ...     pass
        >>> try:
        ...     with user_code(Net(), "forward", "client 0, round 1"):
        ...         raise KeyError("x")
        ... except UserCodeError as e:
        ...     print(e)
        Net.forward raised KeyError: 'x' (client 0, round 1)
    """
    try:
        yield
    except (ConfigError, OSError, UserCodeError, RunStoppedError):
        raise
    except Exception as e:  # noqa: BLE001 - the user's code: any exception becomes the one line
        name = owner if isinstance(owner, str) else type(owner).__qualname__
        context = f" ({where})" if where else ""
        raise UserCodeError(f"{_raised(f'{name}.{hook}', e)}{context}") from e


def debugging() -> bool:
    """Whether ``PL_FED_DEBUG`` asks for the tracebacks behind the one-line errors (any value but empty or 0)."""
    return os.environ.get("PL_FED_DEBUG", "") not in ("", "0")


def raised_in(error: BaseException, owners: Iterable[Any]) -> str:
    """``error`` as one line naming where in the user's code it was raised: the innermost frame of its traceback
    that runs a method of one of ``owners`` (the module, the data module, the callbacks) in code of their own
    (not torch's or Lightning's) — ``"MyNet.training_step raised KeyError: 'x'"``; ``"KeyError: 'x'"`` when no such
    frame is found.

    Example:
        >>> class Net:
        ...     def training_step(self):
        ...         return {}["x"]
        >>> net = Net()
        >>> try:
        ...     net.training_step()
        ... except KeyError as e:
        ...     print(raised_in(e, [net]))
        Net.training_step raised KeyError: 'x'
    """
    ids = {id(o) for o in owners if o is not None}
    found = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if id(frame.f_locals.get("self")) in ids and not _foreign(frame.f_code.co_filename):
            found = f"{type(frame.f_locals['self']).__qualname__}.{frame.f_code.co_name}"
        tb = tb.tb_next
    return _raised(found, error)


def _raised(where: str | None, error: BaseException) -> str:
    """``"Where.hook raised Type: message"`` (one line), or ``"Type: message"`` without ``where``."""
    text = f"{type(error).__name__}: {one_line_text(error)}"
    return f"{where} raised {text}" if where else text


def _foreign(filename: str) -> bool:
    """Code of torch or Lightning (their frames name no user's method)."""
    parts = filename.replace("\\", "/").split("/")
    return any(p in ("torch", "lightning", "lightning_fabric", "pytorch_lightning") for p in parts[-6:-1])


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
