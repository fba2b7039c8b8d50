"""Communication accounting: bytes of a message as it would travel on the wire.

Rules (documented in ``docs/outputs.md``, "How are bytes and FLOPs counted?"):

* A dense floating tensor costs 4 bytes per value (float32 on the wire, whatever the training precision).
  Non-floating tensors cost their element size per value.
* A sparse tensor (one sent together with a mask) costs 4 bytes per non-zero *value* plus the cheaper of two
  index encodings: a bitmap of ``ceil(numel / 8)`` bytes or ``4 · nnz`` bytes of int32 indices. The mask itself
  therefore travels for free with the values: the receiver rebuilds it from the bitmap or the indices.
* A mask sent on its own (no values) costs its bitmap, ``ceil(numel / 8)`` bytes.
* A ternary sparse tensor (values ``{−μ, 0, μ}``, FedSTC) costs one float for ``μ``, one sign bit per non-zero
  (``ceil(nnz / 8)`` bytes) and the same cheaper index encoding.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from torch import Tensor

__all__ = ["tensor_nbytes", "sparse_nbytes", "ternary_nbytes", "bitmap_nbytes", "message_nbytes", "VALUE_BYTES"]

VALUE_BYTES = 4  # float32 on the wire


def tensor_nbytes(t: Tensor) -> int:
    """Bytes of a dense tensor on the wire.

    Example:
        >>> import torch
        >>> tensor_nbytes(torch.zeros(10, dtype=torch.float16)), tensor_nbytes(torch.zeros(3, dtype=torch.int64))
        (40, 24)
    """
    return t.numel() * (VALUE_BYTES if t.is_floating_point() else t.element_size())


def bitmap_nbytes(numel: int) -> int:
    """Bytes of a bit-packed mask over ``numel`` positions.

    Example:
        >>> bitmap_nbytes(17)
        3
    """
    return math.ceil(numel / 8)


def sparse_nbytes(numel: int, nnz: int) -> int:
    """Bytes of a sparse tensor: values plus the cheaper of a bitmap or int32 indices.

    Example:
        >>> sparse_nbytes(1000, 10)   # 40 B values + min(125 B bitmap, 40 B indices)
        80
        >>> sparse_nbytes(1000, 500)  # 2000 B values + 125 B bitmap
        2125
    """
    return VALUE_BYTES * nnz + min(bitmap_nbytes(numel), 4 * nnz)


def ternary_nbytes(numel: int, nnz: int) -> int:
    """Bytes of a ternary sparse tensor: ``μ``, a sign bit per non-zero, and the cheaper of a bitmap or indices.

    Example:
        >>> ternary_nbytes(1000, 10)  # 4 B mu + 2 B signs + min(125 B bitmap, 40 B indices)
        46
    """
    return VALUE_BYTES + math.ceil(nnz / 8) + min(bitmap_nbytes(numel), 4 * nnz)


def message_nbytes(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor] | None = None,
                   ternary: Collection[str] = (), counts: Mapping[str, int] | None = None) -> int:
    """Bytes of a message: dense tensors, sparse tensors (those with a mask) and bare masks.

    Args:
        tensors: the values sent, by name.
        masks: masks by name. A mask whose name is also in ``tensors`` makes that tensor sparse; a mask with no
            tensor of the same name is a bare mask and costs its bitmap.
        ternary: names of sparse tensors whose sent values are ``±μ`` (one ``μ`` per tensor, FedSTC): they cost
            :func:`ternary_nbytes`. The sender decides (a downstream message may carry the receiver's new weights
            while what travels is a ternary update).
        counts: the number of positions each mask holds, by name, where the caller knows it already (e.g. from the
            packed mask on the host, :func:`~pl_fedsparse.functional.sparse.packed_count`): a mask on a device is
            then not counted there (a count read on the host waits for the device). Must be the masks' own counts.

    Example:
        >>> import torch
        >>> message_nbytes({"w": torch.ones(100)}, {"w": torch.arange(100) < 10})
        53
        >>> message_nbytes({}, {"m": torch.ones(64, dtype=torch.bool)})
        8
    """
    masks, counts = masks or {}, counts or {}
    total = 0
    for name, t in tensors.items():
        m = masks.get(name)
        if m is None:
            total += tensor_nbytes(t)
            continue
        nnz = counts[name] if name in counts else int(m.count_nonzero())
        total += (ternary_nbytes if name in ternary else sparse_nbytes)(t.numel(), nnz)
    for name, m in masks.items():
        if name not in tensors:
            total += bitmap_nbytes(m.numel())
    return total
