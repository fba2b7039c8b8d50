"""Pure mask-update and mask-transport functions: cosine prune rate, prune-and-regrow, bit packing.

The prune-and-regrow step is the "modified DST" mask search of FedSpa (Huang et al. 2022, Alg. 2) as implemented by
DisPFL (Dai et al., ICML 2022, ``client.py:fire_mask`` / ``regrow_mask``), a federated variant of the dynamic sparse
training of SET (Mocanu et al. 2018) and RigL (Evci et al. 2020): per tensor, drop the ``k`` active entries of
smallest magnitude, then grow ``k`` inactive ones (largest gradient magnitude, or random scores for SET-style
regrowth), so every tensor keeps its exact number of active entries.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from pl_fedsparse.errors import check
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.masks import sortable, stable_top_k

__all__ = [
    "cosine_prune_rate",
    "drop_and_grow",
    "drop_and_grow_many",
    "expand_values",
    "group_average_stored",
    "masked_values",
    "pack_mask",
    "pack_masks",
    "packed_count",
    "prune_regrow_count",
    "prune_regrow_counts",
    "segment_layout",
    "unpack_mask",
    "unpack_masks",
]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def cosine_prune_rate(round_idx: int, total_rounds: int, alpha0: float) -> float:
    """The cosine-annealed prune rate ``α_t = α₀/2 · (1 + cos(π t / T))``.

    DisPFL ``client.py:72`` (and ``slim_util.py:5-6``); FedSpa Alg. 2. ``t`` is the 0-based round index and ``T``
    the total number of rounds, so ``α_0 = α₀`` and ``α_T = 0`` (no floor, unlike CosineDecay's ``eta_min``).

    Args:
        round_idx: ``t``, in ``[0, T]``.
        total_rounds: ``T >= 1``.
        alpha0: ``α₀`` in ``[0, 1]`` (DisPFL's ``--anneal_factor``, 0.5 in its scripts).

    Example:
        >>> cosine_prune_rate(0, 100, 0.5), cosine_prune_rate(50, 100, 0.5), cosine_prune_rate(100, 100, 0.5)
        (0.5, 0.25, 0.0)
    """
    check(_is_int(total_rounds) and total_rounds >= 1, "total_rounds", total_rounds, "an integer >= 1")
    check(_is_int(round_idx) and 0 <= round_idx <= total_rounds, "round_idx", round_idx,
          f"an integer in [0, {total_rounds}]")
    check(_is_real(alpha0) and 0 <= alpha0 <= 1, "alpha0", alpha0, "a number in [0, 1]")
    return alpha0 / 2 * (1 + math.cos(math.pi * round_idx / total_rounds))


def prune_regrow_count(mask: Tensor, rate: float) -> int:
    """The number of entries to drop (and regrow) in one tensor: ``ceil(rate · nnz)``, DisPFL's ``fire_mask``.

    Example:
        >>> prune_regrow_count(torch.tensor([True, True, True, False]), 0.5)  # ceil(1.5)
        2
        >>> prune_regrow_count(torch.tensor([True, True, True, False]), 0.0)
        0
    """
    check(_is_real(rate) and 0 <= rate <= 1, "rate", rate, "a number in [0, 1]")
    return math.ceil(rate * int(torch.count_nonzero(mask)))


def prune_regrow_counts(masks: Sequence[Tensor], rate: float) -> list[int]:
    """:func:`prune_regrow_count` of every mask, their active entries counted in one read (one wait where the masks
    are on a device, not one per mask).

    Example:
        >>> prune_regrow_counts([torch.tensor([True, True, True, False]), torch.tensor([True, False])], 0.5)
        [2, 1]
    """
    check(_is_real(rate) and 0 <= rate <= 1, "rate", rate, "a number in [0, 1]")
    if not masks:
        return []
    if len({m.device for m in masks}) == 1:
        nnz = torch.stack([torch.count_nonzero(m) for m in masks]).tolist()
    else:  # (masks on several devices: one read each)
        nnz = [int(torch.count_nonzero(m)) for m in masks]
    return [math.ceil(rate * c) for c in nnz]


def _as_scores(score: Tensor, mask: Tensor, param: str) -> Tensor:
    check(isinstance(score, Tensor) and score.shape == mask.shape, param,
          tuple(score.shape) if isinstance(score, Tensor) else type(score).__name__,
          f"a tensor of the mask's shape {tuple(mask.shape)}")
    return score.detach().reshape(-1)  # any real dtype: stable_top_k compares integers in float64


def drop_and_grow(mask: Tensor, drop_score: Tensor, grow_score: Tensor, k: int) -> Tensor:
    """One prune-and-regrow step on one tensor's mask; returns a new mask with the same number of active entries.

    1. **Drop**: among the active entries, deactivate the ``k`` with the smallest ``drop_score`` (DisPFL's
       ``fire_mask`` with ``|w|`` of the locally trained weights; FedSpa Alg. 2; RigL).
    2. **Grow**: among the entries inactive *after the drop*, activate the ``k`` with the largest ``grow_score``
       (``|∇|`` of one batch for gradient regrowth as in FedSpa/RigL; uniform random scores for DisPFL's scripts'
       random regrowth). Entries just dropped are candidates, so a dropped entry can be regrown in the same step
       (DisPFL's ``regrow_mask``); in particular a dense tensor is left unchanged.

    Inactive entries are never dropped and active-after-drop entries never grown: the selections run over those
    index sets only (equivalent to a drop score of +inf / grow score of −inf outside them). ``k`` is clipped to
    ``[0, nnz]``. Ties are broken deterministically by index order: both selections are the first ``k`` of a stable
    sort (:func:`~pl_fedsparse.functional.masks.stable_top_k`, found in linear time without sorting), so among
    equal scores the entry with the lower flat (row-major) index is dropped / grown first. NaN scores rank above
    every number (``torch.sort``'s convention): never dropped first, always grown first.

    Off the CPU the same masks are found by stable sorts of all entries (:func:`drop_and_grow_many`'s device path,
    for this one tensor), so that the host never waits for the device: the number of active entries is not read
    there.

    Args:
        mask: the bool mask of one tensor.
        drop_score: a score per entry, same shape (e.g. ``w.abs()``).
        grow_score: a score per entry, same shape (e.g. ``grad.abs()`` or ``torch.rand(..., generator=g)``).
        k: the number of entries to drop and regrow (see :func:`prune_regrow_count`).

    Example:
        Entry 1 has the smallest |w| among the active {0, 1, 2} and is dropped; among the inactive {1, 3} after
        the drop, entry 3 has the larger grow score and is grown:

        >>> m = torch.tensor([True, True, True, False])
        >>> drop_and_grow(m, torch.tensor([3., 1., 2., 0.]), torch.tensor([0., 5., 0., 9.]), 1)
        tensor([ True, False,  True,  True])

        If the dropped entry has the largest grow score, it comes straight back:

        >>> drop_and_grow(m, torch.tensor([3., 1., 2., 0.]), torch.tensor([0., 9., 0., 5.]), 1)
        tensor([ True,  True,  True, False])
    """
    check(isinstance(mask, Tensor) and mask.dtype == torch.bool, "mask",
          mask.dtype if isinstance(mask, Tensor) else type(mask).__name__, "a bool tensor")
    check(_is_int(k), "k", k, "an integer")
    ds = _as_scores(drop_score, mask, "drop_score")
    gs = _as_scores(grow_score, mask, "grow_score")
    if mask.device.type != "cpu" or not HOST_SELECTION_ON_CPU:
        return drop_and_grow_many([mask], [drop_score], [grow_score], [k])[0]
    new = mask.detach().reshape(-1).clone()
    active = new.nonzero().squeeze(1)
    k = max(0, min(k, active.numel()))
    if k == 0:
        return new.view(mask.shape)
    new[active[stable_top_k(ds[active], k, largest=False)]] = False
    inactive = (~new).nonzero().squeeze(1)
    new[inactive[stable_top_k(gs[inactive], k, largest=True)]] = True
    return new.view(mask.shape)


#: on the CPU, :func:`drop_and_grow` selects among the active (inactive) entries it lists with ``nonzero``, by
#: :func:`~pl_fedsparse.functional.masks.stable_top_k`'s linear-time counting (faster there); off the CPU it ranks
#: all entries with stable sorts (:func:`_first_of_sorts`) and reads nothing on the host, the same masks. ``False``
#: takes the device path on the CPU too (the device-traffic counter and the tests do, to count and check it)
HOST_SELECTION_ON_CPU = True


def drop_and_grow_many(masks: Sequence[Tensor], drop_scores: Sequence[Tensor], grow_scores: Sequence[Tensor],
                       ks: Sequence[int] | None = None, *, rate: float | None = None) -> list[Tensor]:
    """:func:`drop_and_grow` of many tensors at once: ``[drop_and_grow(m, d, g, k) for ...]``, the same masks — with
    the counts ``ks`` given, or with ``rate``: each tensor's :func:`prune_regrow_count` (``ceil(rate · nnz)``),
    counted where the masks are.

    Off the CPU (or with :data:`HOST_SELECTION_ON_CPU` off) the tensors are ranked together: their scores are joined
    into one flat buffer and each selection is two stable sorts of all of it — the scores, then (tensor, excluded)
    as one integer key, which groups the entries by tensor and keeps the score order inside each group — so a
    readjustment launches the same few kernels whatever the number of tensors (one tensor at a time, about 25
    each). Within each tensor the selection is the first ``k`` of a stable sort of its own scores among the entries
    not excluded (what :func:`~pl_fedsparse.functional.masks.stable_top_k` takes there): a stable sort of the joined
    scores keeps each tensor's entries in its own index order among equal scores, and the joining dtype (float64 where any
    tensor's :func:`~pl_fedsparse.functional.masks.sortable` dtype is, float32 otherwise) holds every score exactly,
    so no order changes. With ``rate`` the counts are computed there too, in float64 as Python computes them (the
    same integers), so the host reads nothing and sends nothing. On the CPU with host selection the tensors go one
    by one (the linear-time counting is faster there), as they do when they are on several devices.

    Args:
        masks: bool masks, any shapes, on one device.
        drop_scores: a score per entry of each mask (same shapes).
        grow_scores: a score per entry of each mask (same shapes).
        ks: the number of entries each tensor drops and regrows (integers); or
        rate: the share of each tensor's active entries to drop and regrow, in [0, 1] (exactly one of the two).

    Returns:
        The new masks, in order, as views of one flat buffer (the device path) or tensors of their own.

    Example:
        >>> m = [torch.tensor([True, True, True, False]), torch.tensor([False, True])]
        >>> drop_and_grow_many(m, [torch.tensor([3., 1., 2., 0.]), torch.tensor([0., 1.])],
        ...                    [torch.tensor([0., 5., 0., 9.]), torch.tensor([7., 0.])], [1, 1])
        [tensor([ True, False,  True,  True]), tensor([ True, False])]
    """
    n = len(masks)
    check((ks is None) != (rate is None), "drop_and_grow_many", "ks and rate" if ks is not None else "neither",
          "the counts ks or a rate, not both")
    check(rate is None or (_is_real(rate) and 0 <= rate <= 1), "rate", rate, "a number in [0, 1]")
    check(len(drop_scores) == n and len(grow_scores) == n and (ks is None or len(ks) == n), "drop_and_grow_many",
          (n, len(drop_scores), len(grow_scores), None if ks is None else len(ks)),
          "as many drop scores, grow scores and counts as masks")
    if not n:
        return []
    for i, m in enumerate(masks):
        check(isinstance(m, Tensor) and m.dtype == torch.bool, f"masks[{i}]",
              m.dtype if isinstance(m, Tensor) else type(m).__name__, "a bool tensor")
    for i, k in enumerate(ks or []):
        check(_is_int(k), f"ks[{i}]", k, "an integer")
    device = masks[0].device
    if (device.type == "cpu" and HOST_SELECTION_ON_CPU) or any(
            t.device != device for ts in (masks, drop_scores, grow_scores) for t in ts):
        counts = list(ks) if ks is not None else prune_regrow_counts(masks, rate)  # type: ignore[arg-type]
        return [drop_and_grow(m, d, g, k) for m, d, g, k in zip(masks, drop_scores, grow_scores, counts)]
    ds = [_as_scores(d, m, f"drop_scores[{i}]") for i, (d, m) in enumerate(zip(drop_scores, masks))]
    gs = [_as_scores(g, m, f"grow_scores[{i}]") for i, (g, m) in enumerate(zip(grow_scores, masks))]
    sizes = tuple(m.numel() for m in masks)
    segment, rank = segment_layout(sizes, device)
    new = torch.cat([m.detach().reshape(-1) for m in masks])
    # active entries per tensor (k is clipped to them, as in drop_and_grow), never read on the host
    active = torch.zeros(n, dtype=torch.int64, device=device).index_add_(0, segment, new.to(torch.int64))
    if ks is None:  # prune_regrow_count: ceil(rate · nnz), in float64 as Python's float arithmetic
        k_t = torch.ceil(active.double() * float(rate)).long()  # type: ignore[arg-type]
    else:
        k_t = transfer.host_tensor(list(ks), device, torch.int64)
    limit = torch.minimum(active, k_t)[segment]  # each entry's tensor's k
    new &= ~_first_of_sorts(_joined_scores(ds), ~new, segment, rank, limit, largest=False)
    new |= _first_of_sorts(_joined_scores(gs), new, segment, rank, limit, largest=True)
    return [piece.view(m.shape) for piece, m in zip(new.split(sizes), masks)]


def _joined_scores(scores: Sequence[Tensor]) -> Tensor:
    """The flat scores joined in one dtype that holds each of them exactly (see :func:`drop_and_grow_many`)."""
    flat = [sortable(s) for s in scores]  # (float32 or float64 each: float64 holds every float32 exactly)
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in flat) else torch.float32
    return torch.cat([s.to(dtype) for s in flat])


def _first_of_sorts(scores: Tensor, excluded: Tensor, segment: Tensor, rank: Tensor, limit: Tensor, *,
                    largest: bool) -> Tensor:
    """True at the first ``limit`` entries of a stable sort of each joined tensor's ``scores`` (``descending=largest``)
    among its entries not ``excluded`` (``segment``: each entry's tensor; ``rank``: its index there; ``limit``: its
    tensor's count, at most the entries not excluded). Two stable sorts: the scores, then (tensor, excluded) as one
    key — after them the entries of tensor ``i`` are at its own positions, those not excluded first in score order,
    so the first ``k`` of a tensor are where ``rank < limit``."""
    order = torch.sort(scores, descending=largest, stable=True).indices
    key = segment * 2 + excluded.to(segment.dtype)
    order = order[torch.sort(key[order], stable=True).indices]
    return torch.zeros_like(excluded).scatter_(0, order, rank < limit)


@functools.lru_cache(maxsize=16)
def segment_layout(sizes: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor]:
    """For tensors of ``sizes`` entries joined flat, on ``device``: each entry's tensor (int32) and its index in that
    tensor (int64) — made once per layout and device (a model's tensors keep their shapes from fit to fit), so that
    a per-tensor rule over joined tensors is a gather and a comparison (``rank < limits[segment]``: the first
    ``limits[i]`` entries of every tensor ``i``), not an operator or two a tensor.

    Example:
        >>> segment, rank = segment_layout((2, 3), torch.device("cpu"))
        >>> segment.tolist(), rank.tolist()
        ([0, 0, 1, 1, 1], [0, 1, 0, 1, 2])
    """
    # (made where they are used from no host values: a fill and a range per tensor, once per layout — no copy across
    # the host link, which on a GPU would wait for the device)
    segment = torch.cat([torch.full((n,), i, dtype=torch.int32, device=device) for i, n in enumerate(sizes)]
                        or [torch.zeros(0, dtype=torch.int32, device=device)])
    rank = torch.cat([torch.arange(n, dtype=torch.int64, device=device) for n in sizes]
                     or [torch.zeros(0, dtype=torch.int64, device=device)])
    return segment, rank


@functools.lru_cache(maxsize=16)
def _bit_shifts(device: torch.device) -> Tensor:
    """``arange(8)`` as uint8 on ``device``: each bit's shift in a packed byte (made there once, only ever read)."""
    return torch.arange(8, dtype=torch.uint8, device=device)


def pack_mask(mask: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """Bit-pack a mask: 8 positions per ``uint8`` byte, ``ceil(numel / 8)`` bytes, plus the mask's shape.

    Positions are the row-major flat indices; bit order within a byte is little-endian: position ``8·j + i`` is
    bit ``i`` (value ``2**i``) of byte ``j``. Unused high bits of the last byte are 0. Any nonzero entry counts as
    active (bool or 0/1 masks). Vectorised; the bytes stay on the mask's device.

    Example:
        >>> packed, shape = pack_mask(torch.tensor([[True, False, True], [False, False, False], [False, False, True]]))
        >>> packed, shape  # positions 0 and 2 -> 1 + 4; position 8 -> bit 0 of byte 1
        (tensor([5, 1], dtype=torch.uint8), (3, 3))
    """
    check(isinstance(mask, Tensor), "mask", type(mask).__name__, "a tensor")
    flat = (mask.detach().reshape(-1) != 0).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    packed = (flat.view(-1, 8) << _bit_shifts(flat.device)).sum(dim=1, dtype=torch.int32).to(torch.uint8)
    return packed, tuple(mask.shape)


def unpack_mask(packed: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """The bool mask of ``shape`` from :func:`pack_mask`'s bytes (little-endian bits, row-major positions).

    Example:
        >>> unpack_mask(torch.tensor([5, 1], dtype=torch.uint8), (3, 3)).int()
        tensor([[1, 0, 1],
                [0, 0, 0],
                [0, 0, 1]], dtype=torch.int32)
    """
    n = math.prod(shape)
    check(isinstance(packed, Tensor) and packed.dtype == torch.uint8 and packed.dim() == 1
          and packed.numel() == math.ceil(n / 8), "packed",
          f"{packed.dtype} {tuple(packed.shape)}" if isinstance(packed, Tensor) else type(packed).__name__,
          f"a 1-D uint8 tensor of ceil({n} / 8) = {math.ceil(n / 8)} bytes for shape {tuple(shape)}")
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:n].to(torch.bool).view(tuple(shape))


def pack_masks(masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """:func:`pack_mask` for every mask of a dict; the shapes travel separately (see :func:`unpack_masks`).

    The same bytes as packing each mask alone, made in one go where the masks are tensors on one device: every
    mask's positions, padded to whole bytes, joined and packed together (a handful of operators for the dict, not for
    each mask: on a GPU each is a kernel launch). The packed masks are then views of one buffer.

    Example:
        >>> pack_masks({"w": torch.ones(2, 5, dtype=torch.bool)})
        {'w': tensor([255,   3], dtype=torch.uint8)}
    """
    items = list(masks.items())
    if len(items) < 2 or not all(isinstance(m, Tensor) for _, m in items) or len({m.device for _, m in items}) > 1:
        return {k: pack_mask(m)[0] for k, m in items}
    flats = [m.detach().reshape(-1) for _, m in items]
    bits = (_joined_padded(flats) != 0).to(torch.uint8).view(-1, 8)  # (each mask's region padded to whole bytes)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    packed = (bits << shifts).sum(dim=1, dtype=torch.int32).to(torch.uint8)
    sizes = [math.ceil(f.numel() / 8) for f in flats]
    return {k: part for (k, _), part in zip(items, packed.split(sizes))}


#: the number of set bits of each byte value
_POPCOUNT = torch.tensor([i.bit_count() for i in range(256)], dtype=torch.int32)


def packed_count(packed: Tensor) -> int:
    """The number of positions a :func:`pack_mask` mask holds, read from its bytes (its unused high bits are 0):
    on the host, without unpacking it. A packed mask on a device is counted there and read back (a wait).

    Example:
        >>> packed_count(pack_mask(torch.tensor([True, False, True, True]))[0])
        3
    """
    check(isinstance(packed, Tensor) and packed.dtype == torch.uint8 and packed.dim() == 1, "packed",
          f"{packed.dtype} {tuple(packed.shape)}" if isinstance(packed, Tensor) else type(packed).__name__,
          "a 1-D uint8 tensor (pack_mask's bytes)")
    if packed.device.type == "cpu" and hasattr(np, "bitwise_count"):  # (NumPy 2: six times faster than the table)
        return int(np.bitwise_count(packed.numpy()).sum(dtype=np.int64))
    table = _POPCOUNT if packed.device.type == "cpu" else _POPCOUNT.to(packed.device)
    return int(table[packed.long()].sum())


def masked_values(tensors: Sequence[Tensor], masks: Sequence[Tensor],
                  counts: Sequence[int] | None = None) -> list[Tensor]:
    """Each tensor's values at its mask's positions, in row-major order: ``t[m]`` (a new tensor) for every pair —
    what a sparse store keeps of a masked tensor (:func:`expand_values` puts it back).

    ``t[m]`` on a device makes the host wait for it: the number of positions is read back to size the result. With
    ``counts`` — how many positions each mask holds, known on the host (:func:`packed_count` of the mask's bytes kept
    there; a prune-and-regrow readjustment keeps every count) — the positions are taken by ``torch.nonzero_static``
    at that size, which waits for nothing, and the values gathered there: the same tensor. On the host the counts are
    not needed (nothing to wait for) and not used. A wrong count would drop positions or gather padding on a device,
    so they must be exact: they are checked against the masks wherever the masks are on the host.

    Args:
        tensors: the dense tensors.
        masks: bool (or 0/1) tensors of the same shapes, where the tensors are.
        counts: optional, per mask, the positions it holds.

    Example:
        >>> w = torch.tensor([[1., 2.], [3., 4.]])
        >>> masked_values([w], [torch.tensor([[True, False], [False, True]])], counts=[2])
        [tensor([1., 4.])]
    """
    check(len(masks) == len(tensors), "masks", len(masks), f"one mask per tensor ({len(tensors)})")
    check(counts is None or len(counts) == len(tensors), "counts", None if counts is None else len(counts),
          f"one count per tensor ({len(tensors)})")
    out = []
    for i, (t, m) in enumerate(zip(tensors, masks)):
        check(tuple(m.shape) == tuple(t.shape), f"masks[{i}]", tuple(m.shape), f"the tensor's shape {tuple(t.shape)}")
        m = m if m.dtype == torch.bool else m.to(torch.bool)
        if counts is None or not transfer.on_a_device([t, m]):
            if counts is not None:
                check(int(m.sum()) == counts[i], f"counts[{i}]", counts[i],
                      f"the number of positions the mask holds ({int(m.sum())})")
            out.append(t[m])
            continue
        if transfer.on_a_device([t]) != transfer.on_a_device([m]):  # (the mask goes where the values are)
            m = transfer.to_where({"mask": m}, t)["mask"]
        where = torch.nonzero_static(m.reshape(-1), size=int(counts[i])).reshape(-1)
        out.append(t.reshape(-1).index_select(0, where))
    return out


def unpack_masks(packed: Mapping[str, Tensor], shapes: Mapping[str, torch.Size | tuple[int, ...]]) -> dict[str, Tensor]:
    """:func:`unpack_mask` for every entry of :func:`pack_masks`' dict, with the shapes by name.

    Example:
        >>> unpack_masks({"w": torch.tensor([255, 3], dtype=torch.uint8)}, {"w": (2, 5)})["w"].all().item()
        True
    """
    missing = [k for k in packed if k not in shapes]
    check(not missing, "shapes", missing, "a shape for every packed mask")
    items = list(packed.items())
    if len(items) < 2 or not all(isinstance(p, Tensor) for _, p in items) or len({p.device for _, p in items}) > 1:
        return {k: unpack_mask(p, shapes[k]) for k, p in items}
    # one go: every mask's bytes joined and unpacked together (its last byte's unused bits then dropped), the same
    # masks as unpacking each alone, views of one buffer
    sizes = [math.prod(shapes[k]) for k, _ in items]
    for (k, p), n in zip(items, sizes):
        check(p.dtype == torch.uint8 and p.dim() == 1 and p.numel() == math.ceil(n / 8), "packed",
              f"{p.dtype} {tuple(p.shape)}",
              f"a 1-D uint8 tensor of ceil({n} / 8) = {math.ceil(n / 8)} bytes for shape {tuple(shapes[k])}")
    bits = _joined_bits([p for _, p in items])
    parts = _regions(bits, sizes, [p.numel() for _, p in items])
    return {k: part.view(tuple(shapes[k])) for (k, _), part in zip(items, parts)}


def _joined_bits(packed: Sequence[Tensor]) -> Tensor:
    """The positions of :func:`pack_mask` byte strings joined, unpacked together (each mask's region its bytes' 8
    positions a byte, its last byte's unused bits included)."""
    joined = torch.cat(list(packed))
    return unpack_mask(joined, (8 * joined.numel(),))


def _regions(flat: Tensor, sizes: Sequence[int], nbytes: Sequence[int]) -> list[Tensor]:
    """The masks' own positions in a buffer laid out as :func:`_joined_bits` (views): ``sizes[i]`` positions of each
    ``8 * nbytes[i]``-position region."""
    return list(flat.split([x for n, b in zip(sizes, nbytes) for x in (n, 8 * b - n)])[::2])


def expand_values(values: Tensor, mask: Tensor, param: str = "values") -> Tensor:
    """A sparse tensor stored as its values at a mask's positions, put back in place: a dense tensor of ``mask``'s
    shape, ``values`` at the mask's positions in row-major order and zeros elsewhere (on ``values``' device and in
    its dtype).

    The same tensor as ``dense = values.new_zeros(mask.shape); dense[mask] = values``, by ``masked_scatter_``, which
    is about twice as fast on a CPU for a ResNet-18 layer's mask (``benchmarks/gossip_message.py``): the expansion is
    most of a DisPFL client's gossip message (each neighbour's stored model expanded once per receiver).

    Args:
        values: 1-D, as many entries as ``mask`` holds (``t[mask]`` of the dense tensor ``t``).
        mask: bool (or 0/1) tensor of the dense shape.
        param: the name a wrong count is reported under.

    Example:
        >>> expand_values(torch.tensor([1., 2.]), torch.tensor([[True, False], [False, True]]))
        tensor([[1., 0.],
                [0., 2.]])
    """
    if mask.dtype != torch.bool:
        mask = mask.to(torch.bool)
    if transfer.on_a_device([values]) != transfer.on_a_device([mask]):  # (the mask goes where the values are)
        mask = transfer.to_where({"mask": mask}, values)["mask"]
    # (counted on the host only: on a device the count would make the host wait; masked_scatter_ itself refuses
    # too few values there)
    count = values.numel() if transfer.on_a_device([values]) else int(mask.sum())
    check(values.dim() == 1 and values.numel() == count, param, tuple(values.shape),
          f"a 1-D tensor of {count} values (one per position the mask holds)")
    return values.new_zeros(mask.shape).masked_scatter_(mask, values)


def group_average_stored(
    members: Sequence[tuple[Mapping[str, Tensor], Mapping[str, Tensor]]],
    shapes: Mapping[str, torch.Size | tuple[int, ...]],
    counts: Sequence[Mapping[str, int]] | None = None,
) -> dict[str, Tensor] | None:
    """The per-coordinate average of stored sparse models (DisPFL Alg. 1 line 7), in a few operators per model.

    Each member is a model as a sparse client store keeps it (:class:`~pl_fedsparse.callbacks.Gossip`): its values by
    name — a masked tensor as its values at its mask's positions (1-D, ``t[mask]``), an unmasked one dense — and its
    masks bit-packed (:func:`pack_masks`). The result is, bit for bit, what expanding every member
    (:func:`expand_values`) and averaging with unit weights gives::

        weighted_average([expanded_j], [1.0] * n, [unpack_masks(packed_j, shapes)])

    but each member is unpacked, expanded and added as one flat buffer (its masks' bytes and its values concatenated)
    instead of tensor by tensor: about ten operators per member instead of about ten per member *and tensor* —
    the kernel launches that set the pace of a gossip message on a GPU (``benchmarks/gossip_message.py --flat``). The
    arithmetic per coordinate is the same: ``num + v`` equals ``num + v·m·1`` exactly for ``m`` in {0, 1} and ``v``
    zero off the mask, the masks' counts are small integers and the division is the same; the tensors nobody masks
    are summed with weight ``1/n`` as there (one fused multiply-add per coordinate, on a CPU in the vectorised body
    and the scalar tail alike: ``tests/test_gossip_flat.py`` checks tails of every length).

    The flat form applies when every member stores the same names, the same masked names — each as its values at its
    mask's positions, or every one of a member's at its dense shape (a client still holding the initial dense model
    under its first mask: it adds ``v·m``, as the expanded average does) — and floating tensors of one dtype and
    device; otherwise it returns ``None`` and the caller averages the expanded models (a member with some masked
    tensors dense and some not, mixed dtypes). A masked tensor's values are told from a dense tensor by their shape, as
    :class:`~pl_fedsparse.callbacks.Gossip` tells them; where the shapes cannot tell (a 1-D tensor whose mask holds
    every position), by ``counts`` — without them, such a group is declined.

    Args:
        members: ``(values, packed masks)`` per model, the receiver's own first; the result's non-floating entries
            (integer buffers) are the first member's, as :func:`~pl_fedsparse.functional.weighted_average` takes them.
        shapes: every tensor's dense shape by name.
        counts: per member, the positions each of its masks holds (:func:`packed_count` of its bytes on the host,
            known without reading a device).

    Returns:
        The average by name (floating tensors are views of one buffer per kind: masked, unmasked), or ``None``.

    Example:
        >>> a = ({"w": torch.tensor([1., 2.]), "b": torch.tensor([1.])}, pack_masks({"w": torch.tensor([1, 1, 0])}))
        >>> b = ({"w": torch.tensor([4.]), "b": torch.tensor([3.])}, pack_masks({"w": torch.tensor([0, 0, 1])}))
        >>> group_average_stored([a, b], {"w": (3,), "b": (1,)})
        {'w': tensor([1., 2., 4.]), 'b': tensor([2.])}
    """
    first, packed0 = members[0]
    names = list(first)
    masked = [n for n in names if n in packed0]
    dense = [n for n in names if n not in packed0 and first[n].is_floating_point()]
    ref = first[masked[0]] if masked else first[dense[0]] if dense else None
    if ref is None or not set(packed0) <= set(names):
        return None
    at_shape: list[bool] = []  # per member: every masked tensor stored dense (the initial model under its first mask)
    for i, (values, packed) in enumerate(members):
        if (values.keys() != first.keys() or packed.keys() != packed0.keys()
                or any(values[n].dtype != ref.dtype or values[n].device != ref.device for n in masked + dense)
                or any(packed[n].device != ref.device for n in masked)):
            return None
        shaped = [tuple(values[n].shape) == tuple(shapes[n]) for n in masked]
        at_shape.append(bool(masked) and all(shaped))
        if at_shape[-1]:
            continue
        if any(values[n].dim() != 1 for n in masked):
            return None
        if counts is None:  # (a dense tensor has its dense shape; a 1-D one may be either: declined)
            if any(shaped):
                return None
        elif any(values[n].numel() != counts[i][n] for n in masked):
            return None
    acc = torch.float64 if ref.dtype == torch.float64 else torch.float32
    out: dict[str, Tensor] = {}
    if masked:
        # one region per masked tensor, 8 positions per packed byte (a tensor's last byte's unused bits are 0)
        nbytes = [packed0[n].numel() for n in masked]
        num = torch.zeros(8 * sum(nbytes), dtype=acc, device=ref.device)
        den = torch.zeros_like(num)
        for (values, packed), whole in zip(members, at_shape):
            bits = _joined_bits([packed[n] for n in masked])
            if whole:  # (dense values in the masks' layout, times the mask: v·m, as the expanded average takes them)
                num.add_(_joined_padded([values[n].reshape(-1) for n in masked]).to(acc) * bits)
            else:
                vals = torch.cat([values[n] for n in masked])
                num.add_(torch.zeros_like(num).masked_scatter_(bits, vals.to(acc)))
            den.add_(bits)
        avg = torch.where(den > 0, num / den.clamp_min(torch.finfo(acc).tiny), torch.zeros_like(num)).to(ref.dtype)
        parts = _regions(avg, [math.prod(shapes[n]) for n in masked], nbytes)
        out.update({n: _shaped(part, shapes[n]) for n, part in zip(masked, parts)})
    if dense:
        num = torch.zeros(sum(first[n].numel() for n in dense), dtype=acc, device=ref.device)
        for values, _ in members:  # (nobody masks these: weighted_average's unmasked rule, Σ_j v_j · 1/n)
            flat = torch.cat([values[n] if values[n].dim() == 1 else values[n].reshape(-1) for n in dense])
            num.add_(flat.to(acc), alpha=1.0 / len(members))
        parts = num.to(ref.dtype).split([first[n].numel() for n in dense])
        out.update({n: _shaped(part, first[n].shape) for n, part in zip(dense, parts)})
    for n in names:
        if n not in out:
            out[n] = first[n].clone()
    return {n: out[n] for n in names}


def _joined_padded(flats: Sequence[Tensor]) -> Tensor:
    """Flat tensors joined in :func:`_joined_bits`' layout (:func:`pack_masks`' regions): each padded with zeros
    to whole bytes of positions, a multiple of 8 (one concatenation)."""
    pads = [(-f.numel()) % 8 for f in flats]
    if not any(pads):
        return torch.cat(list(flats))
    zeros = flats[0].new_zeros(max(pads))
    return torch.cat([part for f, pad in zip(flats, pads) for part in ((f, zeros[:pad]) if pad else (f,))])


def _shaped(flat: Tensor, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """``flat`` viewed as ``shape`` (as it is when already 1-D of that shape: no operator)."""
    return flat if flat.dim() == len(shape) == 1 else flat.view(tuple(shape))
