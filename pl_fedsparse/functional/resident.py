"""Device copies of host tensors kept between fits, within a byte budget: what is already on the device does not
cross the link again.

A federation's host keeps every client's state, and each fit moves what it needs to the device (the start weights
and the client's stored entries, in one copy: :meth:`~pl_fedsparse.client.ClientStateStore.prefetch`). Much of it
crossed before and has not changed since: the server's weights, the same for every client of a round; the entries
a client's last fit wrote, read again by its next fit. :class:`ResidentCopies` remembers, for a host tensor, the copy
of it that is on the device — made when it was moved there, or the device tensor it was copied from when it came
back — and hands that copy out instead of moving the tensor again, while the host tensor is alive and unchanged
(its version counter: an in-place change forgets the copy).

The host tensor stays what the federation reads and writes (aggregation, checkpoints, the callbacks' hooks outside a
fit see host tensors as before): the copies are a cache, so the numbers cannot change, only the copies across the
link. Memory: the copies are kept while their device storages fit in ``budget`` bytes, the least recently used
dropped first (``trainer.device_state_budget``); a copy's storage is counted whole once, however many copies share
it, and freed when none of them is kept.

Example:
    >>> cache = ResidentCopies(budget=1 << 20)
    >>> host, copy = torch.ones(4), torch.ones(4)  # (on a GPU: ``copy`` is on the device)
    >>> cache.keep(host, copy)
    >>> cache.lookup(host, "cpu") is copy
    True
    >>> _ = host.add_(1)  # changed in place: the copy is stale
    >>> cache.lookup(host, "cpu") is None
    True
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

from pl_fedsparse.errors import check
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.transfer import needs_copy

__all__ = ["AUTO_BUDGET_ON_CPU", "ResidentCopies", "device_budget", "parse_budget"]

#: ``"auto"``'s budget in a device run simulated on the CPU (:data:`~pl_fedsparse.functional.transfer.ALWAYS_PACK`:
#: ``pl_fedsparse.testing.simulated_device``), so that the simulation keeps copies as a GPU run would
AUTO_BUDGET_ON_CPU = 256 << 20

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_budget(value: Any, param: str = "trainer.device_state_budget") -> int | None:
    """``value`` as bytes: an int (bytes) or a string with a unit (``"512MiB"``, ``"2GB"``, ``"0"``); ``None`` for
    ``"auto"``. Raises :class:`~pl_fedsparse.errors.ConfigError` naming ``param`` for anything else.

    Example:
        >>> parse_budget("1.5GiB"), parse_budget(0), parse_budget("auto")
        (1610612736, 0, None)
    """
    amount, unit = -1.0, ""
    if isinstance(value, int) and not isinstance(value, bool):
        amount = float(value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if text == "auto":
            return None
        number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = text[len(number):]
        with contextlib.suppress(ValueError):
            amount = float(number)
    check(unit in _UNITS and math.isfinite(amount) and amount >= 0, param, value,
          "auto, a number of bytes >= 0 or a size such as 512MiB or 2GB")
    return int(amount * _UNITS[unit])


def device_budget(value: Any, device: torch.device | str) -> int:
    """``trainer.device_state_budget`` in bytes for fits on ``device``: ``"auto"`` is half a CUDA device's free
    memory now, and 0 elsewhere (the CPU has no link to save; :data:`AUTO_BUDGET_ON_CPU` in a simulated device
    run)."""
    budget = parse_budget(value)
    if budget is not None:
        return budget
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free) // 2
    return AUTO_BUDGET_ON_CPU if transfer.ALWAYS_PACK and dev.type == "cpu" else 0


class ResidentCopies:
    """Host tensor → its copy on a device, kept within ``budget`` bytes of device storage (see the module
    docstring). ``budget`` 0 keeps nothing (every lookup misses).

    Attributes:
        hits: lookups answered with a kept copy.
    """

    def __init__(self, budget: int = 0) -> None:
        self.budget = int(budget)
        # id(host) -> (weak reference to host, its version when kept, the device copy, the copy's version); least
        # recently used first
        self._copies: OrderedDict[int, tuple[weakref.ref, int, Tensor, int]] = OrderedDict()
        # device storage pointer -> [copies kept in it, its bytes]
        self._storages: dict[int, list[int]] = {}
        self.used = 0
        self.hits = 0

    @property
    def active(self) -> bool:
        """Whether anything can be kept."""
        return self.budget > 0

    def __len__(self) -> int:
        return len(self._copies)

    def lookup(self, host: Tensor, device: torch.device | str) -> Tensor | None:
        """The kept copy of ``host`` on ``device``, if neither has changed since it was kept (do not change it: it is
        handed out again); ``None`` otherwise."""
        key = id(host)
        hit = self._copies.get(key)
        if hit is None:
            return None
        if hit[0]() is not host or hit[1] != host._version or hit[3] != hit[2]._version or needs_copy([hit[2]], device):
            self._drop(key)
            return None
        self._copies.move_to_end(key)
        self.hits += 1
        return hit[2]

    def keep(self, host: Tensor, copy: Tensor) -> None:
        """Remember ``copy`` (on a device, holding ``host``'s values) for ``host``, dropping the least recently used
        copies while the storages kept exceed the budget. A copy whose storage alone exceeds it is not kept."""
        if not self.active or copy is host:
            return
        ptr, nbytes = copy.untyped_storage().data_ptr(), copy.untyped_storage().nbytes()
        if ptr not in self._storages and nbytes > self.budget:
            return
        key = id(host)
        if key in self._copies:
            self._drop(key)
        slot = self._storages.get(ptr)
        if slot is None:
            slot = self._storages[ptr] = [0, nbytes]
            self.used += nbytes
        slot[0] += 1
        copies = self._copies
        me = weakref.ref(self)  # (the host's callback must not keep the cache alive)

        def forget(_: weakref.ref, key: int = key) -> None:
            cache = me()
            if cache is not None:
                cache._drop(key)

        copies[key] = (weakref.ref(host, forget), host._version, copy, copy._version)
        while self.used > self.budget and copies:
            self._drop(next(iter(copies)))

    def _drop(self, key: int) -> None:
        hit = self._copies.pop(key, None)
        if hit is None:
            return
        ptr = hit[2].untyped_storage().data_ptr()
        slot = self._storages[ptr]
        slot[0] -= 1
        if not slot[0]:
            del self._storages[ptr]
            self.used -= slot[1]
