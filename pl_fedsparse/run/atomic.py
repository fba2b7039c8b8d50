"""Atomic writes: every file of a run is written to a temporary file in its directory (``.<name>.<random>.tmp``),
flushed to disk, given the permissions the process umask asks for and renamed over the target (``os.replace`` is
atomic on POSIX), so a crash leaves either the old or the new file, never half of one (at worst a stale ``.*.tmp``
file, which the next run in the directory removes).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

from pl_fedsparse.errors import cause_of, with_path
from pl_fedsparse.signals import deferred_signals

__all__ = ["atomic_link", "atomic_write_bytes", "atomic_write_text", "dumps_json", "refresh_umask"]


_UMASK: int | None = None


def _read_umask() -> int:
    try:  # Linux: read it without changing it (os.umask is process-wide: no window with another umask)
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0)
    os.umask(old)
    return old


def refresh_umask() -> int:
    """Read the process umask again (a run reads it once when it opens its directory) and return it."""
    global _UMASK
    _UMASK = _read_umask()
    return _UMASK


def _file_mode() -> int:
    """The mode ``open()`` would give a new file: 0o666 less the umask (``mkstemp`` creates files 0o600)."""
    return 0o666 & ~(_UMASK if _UMASK is not None else refresh_umask())


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _atomic(path: Path, write: Any) -> None:
    """Write through ``write(file)`` into a temporary file beside ``path``, then rename it over ``path``: a failure
    (a full disk, a signal) removes the temporary file and leaves ``path`` as it was. A write that failed with an
    ``OSError`` raises it, also when the writer wrapped it (torch's zip writer raises ``RuntimeError("unexpected
    pos ...")`` while handling a full disk's ``OSError``)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with deferred_signals():  # the temporary file exists only once `tmp` names it for the cleanup below
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), _file_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        cause = cause_of(e, OSError) if isinstance(e, Exception) and not isinstance(e, OSError) else None
        if cause is not None:
            raise OSError(cause.errno, cause.strerror or str(cause), str(path)) from None
        if isinstance(e, OSError) and e.filename is None:  # a failed write() names no file: name the target
            raise with_path(e, path) from None
        raise
    _fsync_dir(path.parent)


def atomic_link(source: str | Path, path: str | Path) -> None:
    """Make ``path`` name the same file as ``source``, atomically: a hard link under a temporary name renamed over
    ``path`` (a reader sees the old or the new file, never none); a copy where hard links are not supported."""
    source, path = Path(source), Path(path)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
        with deferred_signals():  # link, rename and cleanup as one step: no interrupt leaves the temporary name
            try:
                os.link(source, tmp)
            except FileExistsError:
                continue
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                linked = False
            else:
                linked = True
                try:
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)  # rename() leaves both names when they already were one file
        if not linked:
            atomic_write_bytes(path, source.read_bytes())  # no hard links here: a second atomic write
            return
        _fsync_dir(path.parent)
        return
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(path.parent))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    _atomic(Path(path), lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def dumps_json(obj: Any) -> str:
    """Compact, stable JSON (NaN written as null) for metrics files."""

    def clean(v: Any) -> Any:
        if isinstance(v, float) and v != v:
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), sort_keys=False)
