"""Lossless compression of float32 tensors for memory held over many clients (``ClientStateStore(codec="lossless")``).

A float32 value is 1 sign bit, 8 exponent bits and 23 mantissa bits. The mantissa is close to random, but a trained
model's magnitudes span few octaves, so the *top byte* (the sign and the exponent's 7 high bits) takes few distinct
values: for Gaussian-like weights its entropy is about 3-4 bits, not 8. The codec keeps the three low bytes as they
are and replaces the top byte by a ``b``-bit code (``b`` chosen per tensor, 1-7): the ``2**b − 1`` most frequent top
bytes get their rank as code, the rest the escape code ``2**b − 1`` with the byte itself kept in an escape list.
Decoding gives back the same bits (``torch.equal`` on the bit pattern, NaN payloads and signed zeros included).

Size: ``3 + b/8`` bytes per value plus one byte per escaped value — 3.4-3.5 bytes instead of 4 for trained
weights (12-15 % less). The codes travel as ``b`` bit planes packed 8 per byte (:func:`~.sparse.pack_mask`).

Why not a general-purpose compressor (``zlib``, ``lzma``): on float32 weights they find the same redundancy (the
exponent) at 10-50× the time, since they look for repeated byte strings that random mantissas do not have; this codec
is a handful of vectorised tensor operations. Why not 16-bit storage: that would change the results.

An encoded tensor is a plain dict of tensors with the marker key :data:`MARK` (what a checkpoint may hold:
``torch.load(weights_only=True)`` reads it).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["MARK", "MIN_NUMEL", "decode", "encode", "encoded_nbytes", "is_encoded"]

#: the key that marks a dict as an encoded tensor (its value: the shape, int64)
MARK = "__pl_fedsparse_f32codec__"
#: tensors with fewer values are kept as they are (the table and padding would eat the gain)
MIN_NUMEL = 4096
_LITTLE = sys.byteorder == "little"


def _cost(counts_sorted: Tensor, n: int, b: int) -> int:
    """Bytes of the top-byte part with ``b``-bit codes: the planes plus one byte per escaped value."""
    keep = (1 << b) - 1
    escaped = n - int(counts_sorted[:keep].sum())
    return b * math.ceil(n / 8) + escaped


def _pack_planes(codes: Tensor, bits: int) -> Tensor:
    """``(bits, ceil(n / 8))`` bytes: bit ``i`` of code ``8·j + k`` is bit ``k`` of byte ``j`` of plane ``i`` (the
    bit order of :func:`~.sparse.pack_mask`)."""
    pad = (-codes.numel()) % 8
    c8 = (torch.cat([codes, codes.new_zeros(pad)]) if pad else codes).view(-1, 8)
    planes = torch.zeros(bits, c8.shape[0], dtype=torch.uint8)
    for i in range(bits):
        plane = planes[i]
        for k in range(8):
            plane |= ((c8[:, k] >> i) & 1) << k
    return planes


def _unpack_planes(planes: Tensor, n: int) -> Tensor:
    """The ``n`` codes :func:`_pack_planes` packed."""
    c8 = torch.zeros(planes.shape[1], 8, dtype=torch.uint8)
    for k in range(8):
        column = c8[:, k]
        for i in range(planes.shape[0]):
            column |= ((planes[i] >> k) & 1) << i
    return c8.view(-1)[:n]


def encode(t: Tensor) -> dict[str, Tensor] | Tensor:
    """The encoded form of a float32 CPU tensor, or ``t`` itself where encoding would not save memory (other
    dtypes, fewer than :data:`MIN_NUMEL` values, a big-endian machine, or top bytes too spread out).

    Example:
        >>> w = torch.randn(64, 64) * 0.05
        >>> enc = encode(w)
        >>> torch.equal(decode(enc).view(torch.int32), w.view(torch.int32)), encoded_nbytes(enc) < w.numel() * 4
        (True, True)
    """
    if not (isinstance(t, Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" and _LITTLE
            and t.numel() >= MIN_NUMEL):
        return t
    n = t.numel()
    b4 = t.detach().contiguous().view(-1).view(torch.uint8).view(n, 4)
    hi = b4[:, 3]
    counts = torch.bincount(hi, minlength=256)
    order = torch.argsort(counts, descending=True, stable=True)
    counts_sorted = counts[order]
    bits = min(range(1, 8), key=lambda b: _cost(counts_sorted, n, b))
    if _cost(counts_sorted, n, bits) + 16 >= n:  # no gain over the raw top byte
        return t
    keep = (1 << bits) - 1
    table = order[:keep].to(torch.uint8)
    lut = torch.full((256,), keep, dtype=torch.uint8)
    lut[order[:keep]] = torch.arange(keep, dtype=torch.uint8)
    codes = lut.index_select(0, hi.to(torch.int32))  # (index_select with int32 indices: ~10x plain indexing)
    planes = _pack_planes(codes, bits)
    return {MARK: torch.tensor(list(t.shape), dtype=torch.int64), "low": b4[:, :3].reshape(-1).clone(),
            "planes": planes, "table": table, "escaped": hi[codes == keep].clone()}


def decode(enc: Mapping[str, Tensor]) -> Tensor:
    """The tensor :func:`encode` encoded (bit for bit)."""
    shape = tuple(int(s) for s in enc[MARK].tolist())
    n = math.prod(shape)
    planes, table = enc["planes"], enc["table"]
    bits = planes.shape[0]
    codes = _unpack_planes(planes, n)
    keep = (1 << bits) - 1
    full = torch.cat([table, torch.zeros(1, dtype=torch.uint8)])
    hi = full.index_select(0, codes.to(torch.int32))
    escaped = codes == keep
    hi[escaped] = enc["escaped"]
    out = torch.empty(n, 4, dtype=torch.uint8)
    out[:, :3] = enc["low"].view(n, 3)
    out[:, 3] = hi
    return out.view(torch.float32).view(shape)


def is_encoded(value: Any) -> bool:
    """Whether ``value`` is :func:`encode`'s dict."""
    return isinstance(value, Mapping) and MARK in value


def encoded_nbytes(enc: Mapping[str, Tensor]) -> int:
    """Bytes the encoded tensor holds."""
    return sum(v.numel() * v.element_size() for v in enc.values())
