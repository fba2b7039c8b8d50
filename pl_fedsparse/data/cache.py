"""The on-disk cache of decoded datasets (``$PL_FEDSPARSE_CACHE``, default ``~/.cache/pl_fedsparse``), keyed by
dataset name, absolute folder and every source file's size and mtime, and the default download folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import zipfile
from pathlib import Path

import torch

from pl_fedsparse.errors import cause_of

log = logging.getLogger(__name__)

__all__ = ["CACHE_ENV", "cache_dir", "download_dir"]


CACHE_ENV = "PL_FEDSPARSE_CACHE"

_CACHE_VERSION = 1


def cache_dir() -> Path:
    """The folder of decoded-dataset caches: ``$PL_FEDSPARSE_CACHE`` or ``~/.cache/pl_fedsparse``."""
    return Path(os.environ.get(CACHE_ENV, "~/.cache/pl_fedsparse")).expanduser()


def download_dir(name: str) -> Path:
    """Where a dataset is downloaded to (and looked for) when ``root`` is unset: ``cache_dir() / name``.

    Example:
        >>> download_dir("cifar10").name
        'cifar10'
    """
    return cache_dir() / name


# ----------------------------------------------------------------------------------------------- on-disk cache
def _signature(name: str, folder: str, files: list[str], extra: str = "") -> str:
    """Hash of the dataset name, folder and every file's relative path, size and mtime."""
    skip = len(os.path.join(folder, ""))
    parts = [f"{_CACHE_VERSION}|{name}|{folder}|{extra}"]
    for path in files:
        st = os.stat(path)
        parts.append(f"{path[skip:] if path.startswith(folder) else path}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _cache_load(path: Path) -> dict[str, torch.Tensor] | None:
    """Load a cache file; ``None`` when it is missing or unreadable (a corrupted cache is simply rebuilt)."""
    if not path.is_file():
        return None
    try:
        with zipfile.ZipFile(path) as archive:  # (torch.load does not check the members' CRCs: a damaged byte)
            if archive.testzip() is not None:
                return None
        blob = torch.load(path, map_location="cpu", weights_only=True)
        keys = ("train_x", "train_y", "test_x", "test_y")
        if not isinstance(blob, dict) or not all(isinstance(blob.get(k), torch.Tensor) for k in keys):
            return None
        return blob
    except Exception:  # noqa: BLE001 - any unreadable cache is rebuilt
        return None


def _cache_save(path: Path, blob: dict[str, torch.Tensor]) -> None:
    """Write ``blob`` atomically (temp file in the same folder + ``os.replace``). The cache is an optimisation: a
    folder that does not take the write (read-only, full, over quota) costs a warning and the decoding next time, not
    the run."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # read-only or full disk: run without a cache
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        cause = e if isinstance(e, OSError) else cause_of(e, OSError)
        reason = (cause.strerror or str(cause)) if cause is not None else str(e).splitlines()[0]
        log.warning("the dataset cache %s was not written (%s); the data will be decoded again next time "
                    "(the PL_FEDSPARSE_CACHE variable names another folder)", path, reason)


def _cached(name: str, folder: str, files: list[str], build, extra: str = "") -> dict[str, torch.Tensor]:
    """Return ``build()``'s tensors, from the cache when the source files are unchanged."""
    path = cache_dir() / f"{name}-{_signature(name, folder, files, extra)}.pt"
    blob = _cache_load(path)
    if blob is None:
        blob = build()
        _cache_save(path, blob)
    return blob
