"""Atomic writes and safe loads of federation checkpoints and run files.

A checkpoint is written to a temporary file in the target directory, flushed to disk and renamed over the target
(``os.replace`` is atomic on POSIX), so a crash leaves either the old or the new file, never half of one. Loading
uses ``torch.load(weights_only=True)``: only tensors and plain containers are unpickled, never arbitrary objects.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from pl_fedsparse.errors import CheckpointError

__all__ = ["atomic_write_bytes", "atomic_write_text", "save_checkpoint", "load_checkpoint", "FORMAT"]

FORMAT = "pl_fedsparse.checkpoint/1"


def _atomic(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    _atomic(Path(path), lambda f: f.write(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Save a checkpoint dict atomically (``state`` must hold only tensors and plain containers)."""
    _atomic(Path(path), lambda f: torch.save({"format": FORMAT, **state}, f))


def load_checkpoint(path: str | Path, param: str = "ckpt_path") -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint`, without executing code.

    Raises:
        CheckpointError: one line naming ``param`` and the path, when the file is missing, corrupted, not a
            pl_fedsparse checkpoint, or holds objects other than tensors and plain containers.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"{param}={str(path)!r} is invalid: expected an existing checkpoint file")
    try:
        state = torch.load(p, map_location="cpu", weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{param}={str(path)!r} is invalid: expected a readable pl_fedsparse checkpoint "
            f"(the file is corrupted or unsafe: {first[:160]})"
        ) from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{param}={str(path)!r} is invalid: expected a {FORMAT} checkpoint, found {found!r}"
        )
    return state


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
