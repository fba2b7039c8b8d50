"""Named random streams: every random draw of a federation comes from one of them.

A stream is named (``"sample"``, ``"fit"``, ``"mask"``, ...) and keyed by integers (round, client, ...); its seed is
``stream_seed(seed, stream_id, *keys)``. Because every draw is a pure function of ``(seed, name, keys)``, the order in
which clients are processed — or the process they run in — cannot change a result, and the "sampler state" of a
checkpoint is just the round index.

The built-in ids below are fixed (changing one changes every result of the project). A user callback that needs its
own randomness registers a name once (:func:`register_stream`); its id is derived from the name, so it does not
depend on import or registration order, and a clash with another name is an error.

=================  ====  =========================================================================================
name               id    keys
=================  ====  =========================================================================================
``sample``         1     round — which clients take part
``fit``            2     round, client, fit stream — shuffling, augmentation and the torch RNG of a local fit
``eval``           3     client — shift/corruption draws of evaluation views
``mask``           11    client (0 = shared), density·1e6 — initial masks
``grow``           13    round, client — regrowth scores and gradient batches of prune-and-regrow
``drop``           21    round — dropped clients (topologies)
``peers``          22    round — random peer graphs
=================  ====  =========================================================================================

Fit streams (the last key of ``fit``) separate the kinds of fits a client may run in one round:
``train`` 0, ``finetune`` 7, ``personal_refine`` 17, ``personal`` 19.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

__all__ = ["stream_seed", "register_stream", "stream_id", "Streams", "STREAM_IDS", "FIT_STREAM_IDS"]

#: built-in streams (fixed ids: changing one changes every result)
STREAM_IDS: dict[str, int] = {"sample": 1, "fit": 2, "eval": 3, "mask": 11, "grow": 13, "drop": 21, "peers": 22}
#: sub-streams of ``fit``, one per kind of fit
FIT_STREAM_IDS: dict[str, int] = {"train": 0, "finetune": 7, "personal_refine": 17, "personal": 19}


def stream_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed for the random stream named by ``(seed, *keys)`` (e.g. ``(seed, stream, round, client)``).

    Example:
        >>> stream_seed(0, 1, 2) == stream_seed(0, 1, 2), stream_seed(0, 1, 2) == stream_seed(0, 2, 1)
        (True, False)
    """
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *[int(k) & 0xFFFFFFFF for k in keys]])
               .generate_state(2, np.uint64)[0] >> np.uint64(1))


def _derived_id(name: str) -> int:
    return 1000 + zlib.crc32(name.encode("utf-8")) % 1_000_000_000


def register_stream(name: str, *, fit: bool = False) -> int:
    """Register a user stream (or, with ``fit=True``, a fit stream) and return its id; idempotent.

    The id is derived from the name (not from the order of registration), above every built-in id.

    Example:
        >>> register_stream("my_method.noise") == register_stream("my_method.noise")
        True
    """
    table = FIT_STREAM_IDS if fit else STREAM_IDS
    if name in table:
        return table[name]
    sid = _derived_id(name)
    clash = [n for n, i in table.items() if i == sid]
    if clash:
        raise ValueError(f"stream name {name!r} collides with {clash[0]!r}; choose another name")
    table[name] = sid
    return sid


def stream_id(name: str, *, fit: bool = False) -> int:
    """The id of a registered stream (a clear error for an unknown name)."""
    table = FIT_STREAM_IDS if fit else STREAM_IDS
    if name not in table:
        raise KeyError(f"unknown {'fit ' if fit else ''}stream {name!r}: expected one of {sorted(table)} "
                       "(register new ones with pl_fedsparse.streams.register_stream)")
    return table[name]


class Streams:
    """The named streams of one federation (bound to its seed).

    Example:
        >>> s = Streams(0)
        >>> s.seed("sample", 3) == stream_seed(0, 1, 3), s.fit_seed("finetune", 3, 5) == stream_seed(0, 2, 3, 5, 7)
        (True, True)
    """

    def __init__(self, seed: int) -> None:
        self.base = int(seed)

    def seed(self, name: str, *keys: int) -> int:
        """Seed of stream ``name`` at ``keys``."""
        return stream_seed(self.base, stream_id(name), *keys)

    def fit_seed(self, fit_stream: str, round_idx: int, client_idx: int) -> int:
        """Seed of one local fit: shuffling, augmentation and the torch RNG inside it."""
        return stream_seed(self.base, STREAM_IDS["fit"], round_idx, client_idx, stream_id(fit_stream, fit=True))

    def generator(self, name: str, *keys: int) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded from stream ``name`` at ``keys``."""
        return torch.Generator().manual_seed(self.seed(name, *keys))

    def numpy(self, name: str, *keys: int) -> np.random.Generator:
        """A NumPy generator seeded from stream ``name`` at ``keys``."""
        return np.random.default_rng(self.seed(name, *keys))
