"""glibc malloc settings for long federations: :func:`tune_malloc` (at start-up) and :func:`release_free_memory`
(what :class:`~pl_fedsparse.client.ClientStateStore` calls after storing enough new client state).

Both do nothing (and return ``False``) where the C library is not glibc.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

_log = logging.getLogger(__name__)

__all__ = ["apply_flush_denormal", "heap_only", "release_free_memory", "tune_malloc"]


@functools.cache
def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:  # pragma: no cover - exotic systems
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "malloc_trim") else None


def _left_to_the_user(*tunables: str) -> bool:
    """Whether malloc is not ours to tune: ``PL_FEDSPARSE_MALLOC_TUNING=0``, or ``GLIBC_TUNABLES`` sets one of
    ``glibc.malloc.<tunable>``."""
    given = os.environ.get("GLIBC_TUNABLES", "")
    return (os.environ.get("PL_FEDSPARSE_MALLOC_TUNING", "1") == "0"
            or any(f"malloc.{t}" in given for t in tunables))


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30) -> bool:
    """Keep glibc malloc from handing large buffers back to the kernel after every client fit.

    With glibc's defaults, freed blocks above the (dynamic) mmap threshold are unmapped and the next fit faults them
    in again page by page: on a 20-client DisPFL round, 27–30 s of *system* CPU per round. Fixing the
    mmap threshold at 32 MiB and the trim threshold at 1 GiB keeps them in the heap — the same as
    ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824``, but without the
    user setting anything (``mallopt(3)`` through ctypes). ``pl-fed`` and every Ray worker call it at start-up.

    Skipped (returns ``False``) when the C library is not glibc, when ``GLIBC_TUNABLES`` already sets either value,
    or when ``PL_FEDSPARSE_MALLOC_TUNING=0``.
    """
    if _left_to_the_user("mmap_threshold", "trim_threshold"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        return bool(libc.mallopt(m_mmap_threshold, int(mmap_threshold))) and bool(
            libc.mallopt(m_trim_threshold, int(trim_threshold)))
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return False


#: glibc's default ``M_MMAP_MAX`` (what :func:`heap_only` puts back)
_DEFAULT_MMAP_MAX = 65536


@contextlib.contextmanager
def heap_only() -> Iterator[bool]:
    """For the duration, glibc serves every allocation from the heap, also those above the 32 MiB mmap threshold
    (``mallopt(M_MMAP_MAX, 0)``); yields whether it did (not on other C libraries, with
    ``PL_FEDSPARSE_MALLOC_TUNING=0``, or when ``GLIBC_TUNABLES`` sets ``malloc.mmap_max``).

    Why: :func:`tune_malloc` can keep freed blocks of up to 32 MiB in the heap (glibc's largest mmap threshold), but
    a larger block is still mapped afresh at every allocation and faulted in page by page. The
    :class:`~pl_fedsparse.executors.VectorizedExecutor` allocates such blocks at every stacked step (a group's
    gradients, 100 MLP clients: 61 MB per layer): measured, a quarter of a round went to page faults. In the heap
    the freed block is reused by the next step (the trim threshold keeps it there).
    """
    if _left_to_the_user("mmap_max"):
        yield False
        return
    libc = _glibc()
    m_mmap_max = -4  # <malloc.h>
    done = False
    if libc is not None:
        try:
            done = bool(libc.mallopt(m_mmap_max, 0))
        except (OSError, AttributeError):  # pragma: no cover - exotic libc
            done = False
    try:
        yield done
    finally:
        if done:
            libc.mallopt(m_mmap_max, _DEFAULT_MMAP_MAX)


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the system (``malloc_trim(0)``); ``False`` where not glibc.

    Why: a federation's driver stores each client's new state while a fit's temporaries (up to :func:`tune_malloc`'s
    32 MiB mmap threshold) come and go in the same heap, and the heap's extent keeps growing even though the
    temporaries are freed. Measured with 40 synthetic ResNet18-GN DisPFL clients stored through ``Gossip`` with the
    lossless codec (:mod:`~pl_fedsparse.functional.floatcodec`): the process grew by ~55 MB per client for ~20 MB of
    state, also with the stored buffers moved out of the heap into their own memory mappings, so it is the
    temporaries' free space that is not reused, and 1,000 such clients would not fit in memory. ``malloc_trim``
    returns the free pages (a heap walk: 30-50 ms for a few GB) and the process is back at its live size; pages
    come back by page faults as the heap is reused — the cost :func:`tune_malloc` avoids per fit — so
    :class:`~pl_fedsparse.client.ClientStateStore` calls this after every 64 MiB of newly stored client state, not
    per fit (40 clients: 0.3-0.4 GB above the live size at most instead of 2.1 GB).
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def apply_flush_denormal(on: bool) -> bool:
    """Flush subnormal floats to zero in this process when ``on`` (``trainer.flush_denormal``); returns whether it
    did. A CPU without the instructions (not x86 with SSE3, not ARM) keeps them, said in one warning."""
    if not on:
        return False
    if torch.set_flush_denormal(True):
        return True
    _log.warning("trainer.flush_denormal=true has no effect here: this CPU cannot flush subnormal floats to zero")
    return False
