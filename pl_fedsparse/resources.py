"""Sizes checked before work: a size-like parameter whose memory would not fit is refused in one line, before
anything is allocated.

:func:`available_memory` is what this process may still allocate: the kernel's ``MemAvailable``, lowered by a cgroup
memory limit (a container, a SLURM job) when there is one. :func:`check_fits` compares an estimate of what a
parameter needs with it. The estimates are lower bounds of the real peak (the arrays the data needs, not Python's
overhead), so nothing that fits is refused; what they refuse would have run out of memory or swapped for minutes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from pl_fedsparse.errors import ConfigError

__all__ = ["available_memory", "check_fits", "human_bytes"]

#: set to a number of bytes to check against instead of the machine's available memory (tests, or a stricter limit)
ENV_LIMIT = "PL_FEDSPARSE_MEMORY_LIMIT"


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """What the cgroup (v2, else v1) still lets this process allocate; None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max":
                return None
            limit, usage = int(raw), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:  # v1's "no limit"
            return None
        return max(limit - usage, 0)
    return None


def available_memory() -> int | None:
    """Bytes this process may still allocate (``None`` when the platform does not say)."""
    override = os.environ.get(ENV_LIMIT)
    if override:
        try:
            limit = float(override)
        except ValueError:
            limit = float("nan")
        if not (math.isfinite(limit) and limit >= 0):
            raise ConfigError(f"{ENV_LIMIT}={override!r} is invalid: expected a number of bytes >= 0")
        return int(limit)
    room = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    return min(room) if room else None


def human_bytes(n: float) -> str:
    """``1.5 GB`` (decimal units).

    Example:
        >>> human_bytes(1536), human_bytes(3.2e12)
        ('1.5 kB', '3.2 TB')
    """
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def check_fits(param: str, value: Any, need: float, what: str) -> None:
    """Refuse ``param=value`` in one line when ``need`` bytes (an estimate of ``what``) exceed the available memory.

    Example:
        >>> os.environ[ENV_LIMIT] = "1e9"
        >>> check_fits("data.synthetic.num_train", 10**9, 3e12, "the synthetic images")
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: data.synthetic.num_train=1000000000 is invalid: expected a size whose memory fits: the synthetic images need at least 3.0 TB, 1.0 GB is available
        >>> del os.environ[ENV_LIMIT]
    """
    room = available_memory()
    if room is not None and need > room:
        raise ConfigError(f"{param}={value!r} is invalid: expected a size whose memory fits: {what} need at least "
                          f"{human_bytes(need)}, {human_bytes(room)} is available")
