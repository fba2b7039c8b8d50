"""Many tensors across the host link in one copy.

A client fit ends with dozens of small tensors going to the host — the trained state dict, masks, optimizer and gate
state — and a copy per tensor costs a launch and, copied to pageable memory, a wait for the device each time. Here
they travel as one byte buffer: every tensor's bytes are laid out at 64-byte aligned offsets in one ``uint8`` tensor
on the source device (one concatenation of the tensors' bytes there: a kernel launch or two on a GPU, not one per
tensor), the buffer crosses once, and each tensor is read back as a view of it
(``Tensor.view(dtype)`` then its shape). Values are bit for bit the tensors' own: only bytes move.

Between the host and a CUDA device the buffer is staged in page-locked ("pinned") host memory
(``trainer.pin_memory``, on by default; :func:`host_staging`): a copy to the device is queued without holding the host
up — it goes on launching the fit's kernels while the copy runs, and torch's pinned-memory allocator keeps the
buffer from reuse until the copy is done — and a copy to the host goes straight into page-locked memory (no staging
through a driver buffer), waited for once before it is read. Pageable memory is used where pinning fails (the host
cannot lock more memory: one warning, then pageable copies). The client states the federation keeps stay in
pageable memory: locking a whole federation's state would take gigabytes the system could no longer page.

The tensors that come back share that one buffer's storage. :func:`copy_tensors` hands out such views (``share=True``:
cheapest, for values used and dropped together, e.g. an update the server aggregates) or, by default, tensors with
storages of their own (a host-side copy each: a value kept long, e.g. a client's state, must not keep the whole
buffer alive, and a checkpoint must not save it).

Example:
    >>> ts = [torch.arange(3.0), torch.tensor([True, False]), torch.tensor(7)]
    >>> out = copy_tensors(ts, "cpu", force=True)
    >>> [torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(ts, out)]
    [True, True, True]
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = [
    "ALIGN",
    "ALWAYS_PACK",
    "DeviceMismatch",
    "PlacementTracker",
    "abs_tensors",
    "clear_twins",
    "clone_tensors",
    "copy_into",
    "copy_tensors",
    "host_staging",
    "host_tensor",
    "is_on",
    "mark_placed",
    "needs_copy",
    "on_a_device",
    "placed_on",
    "remember_twin",
    "send",
    "tensors_in",
    "to_device",
    "to_host",
    "to_where",
    "twins_on",
]

#: byte alignment of every tensor inside the buffer (any dtype's element size divides it)
ALIGN = 64

#: take the device path on the CPU too (``force`` everywhere): what tests and the device-traffic counter set to see,
#: on a machine without an accelerator, the copies a device run makes
ALWAYS_PACK = False

#: stage the copies between the host and a CUDA device in pinned host memory (see the module docstring;
#: ``trainer.pin_memory`` sets it for a federation through :func:`host_staging`)
PIN_MEMORY = True

#: set when pinned host memory could not be had once: the copies of this process use pageable memory from then on
_PINNING_FAILED = False

_log = logging.getLogger(__name__)


_SCALARS = (int, float, complex, str, bytes, bool, type(None))


def tensors_in(tree: Any) -> Iterable[Tensor]:
    """Every tensor of ``tree``, in ``tree_leaves`` order: dicts, lists and tuples walked here (a few times faster
    than the pytree walk on the per-fit structures: state dicts, metrics, messages); any other container through
    ``torch.utils._pytree``.

    Example:
        >>> [t.tolist() for t in tensors_in(({"a": torch.ones(1)}, [1.0, (torch.zeros(1),)]))]
        [[1.0], [0.0]]
    """
    if isinstance(tree, Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from tensors_in(v)
    elif type(tree) in (list, tuple):
        for v in tree:
            yield from tensors_in(v)
    elif not isinstance(tree, _SCALARS):
        yield from (t for t in tree_leaves(tree) if isinstance(t, Tensor))


def needs_copy(tensors: Sequence[Tensor], device: torch.device | str) -> bool:
    """Whether any of ``tensors`` lies on another device than ``device`` (``"cuda"`` without an index matches any
    CUDA device's tensors).

    Example:
        >>> needs_copy([torch.zeros(2)], "cpu")
        False
    """
    dev = torch.device(device)
    return any(t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index) for t in tensors)


def copy_tensors(tensors: Sequence[Tensor], device: torch.device | str, *, share: bool = False,
                 force: bool = False, packed: list[Tensor | None] | None = None) -> list[Tensor]:
    """Detached copies of ``tensors`` on ``device``, moved in one host↔device copy per source device.

    Args:
        tensors: any dtypes, shapes (0-d included), devices and layouts (non-contiguous ones are made contiguous
            on their device first). Sparse tensors are not supported.
        device: where the copies go.
        share: hand out views of the one buffer (see the module docstring) instead of tensors of their own.
        force: pack and copy even when everything is on ``device`` already (what a device run does; on the CPU
            the copy is then a plain ``clone``) — tests and the device-traffic counter use it.
        packed: a list that receives, in order, each tensor's copy in the packed buffer on its own device (a
            private copy made there, before the buffer crossed; ``None`` where nothing was packed): what a caller
            keeps to find the values on the source device again (:mod:`~pl_fedsparse.functional.resident`).

    Returns:
        The copies, in order. Without ``force`` and with nothing to move, each is ``t.detach().clone()``.
    """
    dev = torch.device(device)
    if not tensors:
        return []
    if packed is not None:
        packed[:] = [None] * len(tensors)
    if not (force or ALWAYS_PACK) and not needs_copy(tensors, dev):
        return [t.detach().clone() for t in tensors]
    for t in tensors:
        if t.layout != torch.strided:
            raise TypeError(f"copy_tensors: a {t.layout} tensor cannot be packed (strided tensors only)")
    out: list[Tensor | None] = [None] * len(tensors)
    by_source: dict[tuple[torch.device, str | None], list[int]] = {}
    for i, t in enumerate(tensors):  # (simulated on the CPU: what is placed on "the device" apart from the rest)
        by_source.setdefault((t.device, placed_on(t) if ALWAYS_PACK else None), []).append(i)
    for (source, where), idx in by_source.items():
        offsets, total = [], 0
        for i in idx:
            offsets.append(total)
            nbytes = tensors[i].numel() * tensors[i].element_size()
            total += -(-nbytes // ALIGN) * ALIGN
        pin = _stages_pinned(source, dev)
        buf = _pack(tensors, idx, offsets, total, source, where, pin=pin and source.type == "cpu")
        if ALWAYS_PACK and where is None and len(by_source) > 1 and dev.type == "cpu":
            # (simulated: host tensors copied to the host beside device tensors — a host copy, as on an
            # accelerator, where they are a group of their own; not a crossing)
            moved = buf.clone()
        else:
            moved = _cross(buf, dev, pin)  # the one copy across the link
            if ALWAYS_PACK and where is not None and dev.type == "cpu":
                # (simulated: from "the device" to the host — what is made from the copy is host work, as on an
                # accelerator, not device work)
                _unplace([moved])
        for i, at in zip(idx, offsets):
            t = tensors[i]
            n = t.numel() * t.element_size()
            view = moved[at:at + n].view(t.dtype).view(t.shape)
            out[i] = view if share else view.clone()
            if packed is not None:
                packed[i] = source_view = buf[at:at + n].view(t.dtype).view(t.shape)
                where = placed_on(t)
                if where is not None:  # (a simulated device run: the packed copy is where its source was)
                    _remember(_placed, [source_view], where)
    if ALWAYS_PACK:  # (a simulated device run: a copy is placed by its caller, e.g. to_device; a host copy is not)
        _unplace(out)  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


#: per device, ``ALIGN`` bytes that fill the gaps between the packed tensors (their value is never read)
_GAPS: dict[torch.device, Tensor] = {}


def _pack(tensors: Sequence[Tensor], idx: Sequence[int], offsets: Sequence[int], total: int,
          source: torch.device, where: str | None = None, *, pin: bool = False) -> Tensor:
    """The ``total``-byte buffer on ``source`` holding ``tensors[i]``'s bytes at ``offsets`` (for ``i`` in ``idx``),
    written by one concatenation of the tensors' bytes (views, no copy of their own) and of gap fillers (``where``:
    the simulated device the tensors are placed on, where the fillers are placed too); in pinned host memory where
    ``pin`` asks and it can be had."""
    gap = _GAPS.get(source)
    if gap is None:
        gap = _GAPS[source] = torch.zeros(ALIGN, dtype=torch.uint8, device=source)
    pieces: list[Tensor] = []
    filled = 0
    for i, at in zip(idx, offsets):
        t = tensors[i].detach()
        n = t.numel() * t.element_size()
        if not n:
            continue
        if at > filled:
            pieces.append(gap[:at - filled])
            if where is not None:
                _remember(_placed, pieces[-1:], where)
        pieces.append(t.contiguous().reshape(-1).view(torch.uint8))
        filled = at + n
    if total > filled:
        pieces.append(gap[:total - filled])
        if where is not None:
            _remember(_placed, pieces[-1:], where)
    buf = _pinned_bytes(total) if pin else None
    if buf is None:
        buf = torch.empty(total, dtype=torch.uint8, device=source)
    if pieces:
        torch.cat(pieces, out=buf)
    return buf


def _stages_pinned(source: torch.device, dev: torch.device) -> bool:
    """Whether a copy from ``source`` to ``dev`` is staged in pinned host memory: one side the host, the other a CUDA
    device, :data:`PIN_MEMORY` on (and pinning not found impossible in this process)."""
    return PIN_MEMORY and not _PINNING_FAILED and {source.type, dev.type} == {"cpu", "cuda"}


def _pinned(make: Callable[[], Tensor]) -> Tensor | None:
    """``make()`` (a tensor in pinned host memory), or ``None`` — with one warning a process, and no attempt after
    it — where pinned memory cannot be had."""
    global _PINNING_FAILED
    if _PINNING_FAILED:
        return None
    try:
        return make()
    except RuntimeError as err:
        _PINNING_FAILED = True
        _log.warning("trainer.pin_memory: pinned host memory could not be had (%s); the copies across the host link "
                     "use pageable memory from here on", str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


def _pinned_bytes(n: int) -> Tensor | None:
    """``n`` bytes of pinned host memory, or ``None`` where it cannot be had (:func:`_pinned`)."""
    return _pinned(lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True))


def _cross(buf: Tensor, dev: torch.device, pin: bool) -> Tensor:
    """``buf`` copied to ``dev``: the one copy across the link. Staged in pinned host memory (``pin``): to the
    device queued without a wait (``non_blocking``: the host goes on while it runs; torch's pinned-memory allocator
    keeps ``buf`` from reuse until it is done), to the host straight into pinned memory and waited for once — the
    host reads it next, as after a blocking copy."""
    if pin and dev.type == "cuda" and buf.is_pinned():
        return buf.to(dev, non_blocking=True)
    if pin and dev.type == "cpu":
        out = _pinned_bytes(buf.numel())
        if out is not None:
            out.copy_(buf, non_blocking=True)
            torch.cuda.current_stream(buf.device).synchronize()
            return out
    return buf.to(dev, copy=True)


def send(t: Tensor, device: torch.device | str) -> Tensor:
    """``t.to(device)`` without holding the host up where it crosses to a CUDA device: staged in pinned memory and
    copied ``non_blocking`` (:data:`PIN_MEMORY`; a copy from pageable memory makes PyTorch wait for everything queued
    on the stream). For the small host-made tensors a fit sends on its own — an epoch's batch order and augmentation
    draws, a client's sample indices. Elsewhere (on the CPU, staging off or unavailable) it is ``t.to(device)``.

    Example:
        >>> send(torch.arange(3), "cpu").tolist()
        [0, 1, 2]
    """
    dev = torch.device(device)
    if t.device.type == "cpu" and _stages_pinned(t.device, dev):
        staged = _pinned(t.pin_memory)
        if staged is not None:
            return staged.to(dev, non_blocking=True)
    return t.to(dev)


def host_tensor(data: Any, device: torch.device | str, dtype: torch.dtype | None = None) -> Tensor:
    """``torch.tensor(data, dtype=dtype, device=device)`` — made on the host and sent by :func:`send`: on a GPU
    queued without a wait, where ``torch.tensor(..., device=<the GPU>)`` copies from pageable memory and waits for
    everything queued on the stream. The same values, dtype inferred from ``data`` as ``torch.tensor`` does.

    Example:
        >>> host_tensor([1, 2], "cpu"), host_tensor([True], "cpu").dtype
        (tensor([1, 2]), torch.bool)
    """
    return send(torch.tensor(data, dtype=dtype), device)


@contextlib.contextmanager
def host_staging(pinned: bool) -> Iterator[None]:
    """Within the block, stage the copies between the host and a CUDA device in pinned host memory (``pinned``) or
    in pageable memory; :data:`PIN_MEMORY` is put back after it. The federation runs its ``fit``, ``validate`` and
    ``test`` under ``host_staging(trainer.pin_memory)``. The same bytes either way: only the copies' speed differs.

    Example:
        >>> with host_staging(False):
        ...     copy_tensors([torch.ones(2)], "cpu", force=True)[0].tolist()
        [1.0, 1.0]
    """
    global PIN_MEMORY
    before, PIN_MEMORY = PIN_MEMORY, bool(pinned)
    try:
        yield
    finally:
        PIN_MEMORY = before


def clone_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Detached copies of ``tensors`` where each is, with its dtype and strides: one multi-tensor copy
    (``torch._foreach_copy_``) into fresh tensors — on a GPU a launch or a few for them all, where a ``clone`` each is
    a launch each. The same bytes as ``t.detach().clone()``.

    Example:
        >>> ts = [torch.arange(3.0), torch.tensor(True)]
        >>> out = clone_tensors(ts)
        >>> [torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(ts, out)]
        [True, True]
    """
    if not tensors:
        return []
    src = [t.detach() for t in tensors]
    out = [torch.empty_like(t) for t in src]
    with torch.no_grad():
        torch._foreach_copy_(out, src)
    return out


def abs_tensors(tensors: Sequence[Tensor]) -> list[Tensor]:
    """``t.abs()`` of every tensor (new tensors, no autograd): one multi-tensor ``torch._foreach_abs`` where they are
    dense and on one device (a launch or a few on a GPU for them all), one by one otherwise (sparse tensors, several
    devices). The same values either way (``abs`` is exact).

    Example:
        >>> [t.tolist() for t in abs_tensors([torch.tensor([-1.5, 2.0]), torch.tensor(-3)])]
        [[1.5, 2.0], 3]
    """
    if not tensors:
        return []
    src = [t.detach() for t in tensors]
    if all(t.layout == torch.strided and t.device == src[0].device for t in src):
        return list(torch._foreach_abs(src))
    return [t.abs() for t in src]


def copy_into(targets: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``target.copy_(source)`` for every pair, without autograd, in one multi-tensor copy (a launch or a few on a
    GPU for them all; dtypes are converted as ``copy_`` converts them)."""
    if targets:
        with torch.no_grad():
            torch._foreach_copy_(list(targets), [s.detach() for s in sources])


def to_device(tensors: Mapping[str, Tensor], device: torch.device | str, *, share: bool = True) -> dict[str, Tensor]:
    """``{name: t.to(device)}`` for a dict of tensors, with the copies across the link made as one
    (:func:`copy_tensors`, sharing its buffer): tensors already on ``device`` are handed back as they are, as
    ``Tensor.to`` does — unless :data:`ALWAYS_PACK` is set, which packs everything as a device run would.
    ``share=False``: the moved tensors get storages of their own (for values kept long). A tensor with a twin on
    ``device`` (:func:`remember_twin`: moved there ahead of time) gets a copy of its twin made there instead.

    Example:
        >>> m = {"w": torch.ones(2)}
        >>> to_device(m, "cpu")["w"] is m["w"]
        True
    """
    if _twins:  # tensors whose copy on ``device`` was made already (moved with others, ahead of time)
        twins = {n: d for n, d in ((n, _twin_of(t, device)) for n, t in tensors.items()) if d is not None}
        if twins:  # (copies of the twins made there, all in one multi-tensor copy; the twins stay as they were)
            found = dict(zip(twins, clone_tensors(list(twins.values()))))
            mark_placed(found.values(), device)
            left = {n: t for n, t in tensors.items() if n not in found}
            rest = to_device(left, device, share=share) if left else {}
            return {n: found[n] if n in found else rest[n] for n in tensors}
    names = list(tensors)
    values = [tensors[n] for n in names]
    if not ALWAYS_PACK:
        if not needs_copy(values, device):
            return dict(zip(names, values))
        return dict(zip(names, copy_tensors(values, device, share=share, force=True)))
    # a device run on the CPU: what an earlier call moved "to the device" (or computed there) is there already; the
    # rest crosses
    out = dict(zip(names, values))
    todo = [n for n, t in zip(names, values) if not is_on(t, device)]
    moved = copy_tensors([tensors[n] for n in todo], device, share=share, force=True)
    for n, t in zip(todo, moved):
        out[n] = t
    mark_placed(moved, device)
    return out


def to_host(tensors: Mapping[str, Tensor], *, share: bool = True) -> dict[str, Tensor]:
    """``tensors`` on the host: the ones on a device (:func:`on_a_device`; a simulated device run's placed tensors
    too) copied there in one copy, host tensors handed back as they are. ``share=False``: the copies get storages of
    their own. (Not ``to_device(tensors, "cpu")``: in a device run simulated on the CPU, "the device" is the CPU too,
    and a placed tensor would stay placed.)

    Example:
        >>> m = {"w": torch.ones(2)}
        >>> to_host(m)["w"] is m["w"]
        True
    """
    away = [n for n, t in tensors.items() if on_a_device([t])]
    if not away:
        return dict(tensors)
    return {**tensors, **dict(zip(away, copy_tensors([tensors[n] for n in away], "cpu", share=share, force=True)))}


def to_where(tensors: Mapping[str, Tensor], like: Tensor) -> dict[str, Tensor]:
    """``tensors`` where ``like`` is: on its device (:func:`to_device`) — or, when ``like`` is on the host, the ones
    on a device copied to the host in one copy (:func:`to_host`). What a callback combining its own tensors with an
    update's uses, wherever the engine left that update."""
    if on_a_device([like]):
        return to_device(tensors, like.device)
    return to_host(tensors, share=False)


#: ``ALWAYS_PACK``'s record of what is on "the device" in a device run simulated on the CPU, by id: ``(weak
#: reference, device)`` — what :func:`to_device` moved there, and (under :class:`PlacementTracker`) what was computed
#: from it
_placed: dict[int, tuple[weakref.ref, str]] = {}


#: tensors made under a strict :class:`PlacementTracker` from no existing tensor (a factory call), by id: neither on
#: the host nor on the device as far as the simulation can tell
_fresh: dict[int, tuple[weakref.ref, str]] = {}


def _remember(record: dict[int, tuple[weakref.ref, str]], tensors: Iterable[Tensor], device: str) -> None:
    for t in tensors:
        key = id(t)
        record[key] = (weakref.ref(t, functools.partial(_forget, record, key)), device)


def _forget(record: dict[int, Any], key: int, _collected: weakref.ref) -> None:
    record.pop(key, None)


def _is_fresh(t: Tensor) -> bool:
    hit = _fresh.get(id(t))
    return hit is not None and hit[0]() is t


def placed_on(t: Tensor) -> str | None:
    """Under :data:`ALWAYS_PACK`: the (simulated) device ``t`` was placed on, ``None`` for a host tensor."""
    hit = _placed.get(id(t))
    return hit[1] if hit is not None and hit[0]() is t else None


def is_on(t: Tensor, device: torch.device | str) -> bool:
    """Whether ``t`` is on ``device`` already — in a device run simulated on the CPU (:data:`ALWAYS_PACK`), placed
    there (:func:`placed_on`).

    Example:
        >>> is_on(torch.zeros(1), "cpu")
        True
    """
    if ALWAYS_PACK:
        return placed_on(t) == str(device)
    return not needs_copy([t], device)


def on_a_device(tensors: Iterable[Tensor]) -> bool:
    """Whether any of ``tensors`` is on an accelerator — or, in a device run simulated on the CPU
    (:data:`ALWAYS_PACK`), placed on its device (:func:`placed_on`)."""
    return any(t.device.type != "cpu" or (ALWAYS_PACK and placed_on(t) is not None) for t in tensors)


def _unplace(tensors: Iterable[Tensor]) -> None:
    """Record ``tensors`` as host tensors (copies made for the host)."""
    for t in tensors:
        if placed_on(t) is not None:
            del _placed[id(t)]
        if _is_fresh(t):
            del _fresh[id(t)]


class DeviceMismatch(RuntimeError):
    """An operator given tensors on the (simulated) device and host tensors together: on an accelerator it fails
    ("Expected all tensors to be on the same device"); :class:`PlacementTracker` ``strict`` finds it on the CPU."""


#: operators that take a host tensor beside a device one on an accelerator too: copies across the link, and indexing
#: with host indices (moved to the device by the operator)
_CROSSING_OPS = frozenset({"copy_", "_foreach_copy_", "_to_copy", "_copy_from", "_copy_from_and_resize", "to",
                           "set_", "index", "index_put", "index_put_", "_index_put_impl_", "lift_fresh",
                           "lift_fresh_copy"})


class PlacementTracker(TorchDispatchMode):
    """In a device run simulated on the CPU (:data:`ALWAYS_PACK`): what an operator computes from a tensor placed on
    the device is on the device too, as on an accelerator (a mask drawn from the trained weights, a gradient, a
    clone) — so that moving it "to the device" later is seen to cost no copy, and moving it to the host is seen to
    cost one. Host copies made by :func:`copy_tensors` stay on the host; data arrives on the device where the engine
    moves a batch there (:func:`mark_placed`). Used by the device-traffic counter and the tests that count copies;
    a run under it gives the same numbers.

    Args:
        strict: also fail as an accelerator would where an operator mixes a tensor on the device with a host tensor
            of one dimension or more (0-dim host tensors are scalars there; copies and host indices are allowed):
            :class:`DeviceMismatch`, naming the operator and the host tensors' shapes. How a tensor left on the
            wrong side by the engine or a callback is found without a GPU.
    """

    def __init__(self, strict: bool = False) -> None:
        super().__init__()
        self.strict = strict

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        device = next((d for t in leaves for d in (placed_on(t),) if d is not None), None)
        if self.strict and device is not None and func._schema.name.split("::")[-1] not in _CROSSING_OPS:
            host = [tuple(t.shape) for t in leaves if t.dim() > 0 and placed_on(t) is None and not _is_fresh(t)]
            if host:
                raise DeviceMismatch(f"{func._schema.name} was given tensors on the device and on the host (shapes "
                                     f"{', '.join(map(str, host))}): on an accelerator it fails")
        out = func(*args, **(kwargs or {}))
        if device is not None:
            mark_placed((t for t in tree_leaves(out) if isinstance(t, Tensor)), device)
            if func._schema.name.startswith("aten::_foreach_") and func._schema.name.endswith("_") and args:
                # (a multi-tensor in-place operation returns nothing: what it wrote is where the operation ran)
                mark_placed((t for t in tree_leaves(args[0]) if isinstance(t, Tensor)), device)
        elif self.strict and (func in _LIFTS or all(_is_fresh(t) for t in leaves)):
            # made here from no tensor (``torch.arange(8, device=x.device)``) or only from such: on a GPU it is where
            # its ``device=`` says, which the CPU cannot tell, so the strict check lets it meet either side
            _remember(_fresh, (t for t in tree_leaves(out) if isinstance(t, Tensor)), "")
        return out

    def __exit__(self, *exc: object) -> None:
        _fresh.clear()
        super().__exit__(*exc)


#: ``torch.tensor(data)`` (its device is in its ``device=``, as for a factory call)
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


#: host tensor id -> (weak reference to it, its version when remembered, its copy on a device, the client whose fit
#: it belongs to or None): see remember_twin
_twins: dict[int, tuple[weakref.ref, int, Tensor, int | None]] = {}


def remember_twin(host: Tensor, twin: Tensor, owner: int | None = None) -> None:
    """Remember that ``twin`` (on a device) holds ``host``'s values, so that :func:`to_device` hands out a copy of
    ``twin`` made on that device instead of crossing the link again — while ``host`` is alive and not changed in
    place (its version counter). How a fit's client-state entries, moved ahead with its start weights in one copy,
    reach the device when a callback moves them (``ClientStateStore.prefetch``). ``owner``: the client whose fit
    the twin serves (forgotten when that fit ends, :func:`clear_twins`; a stacked group's fits all start before the
    first one ends)."""
    key = id(host)
    _twins[key] = (weakref.ref(host, lambda _: _twins.pop(key, None)), host._version, twin, owner)


def clear_twins(owner: int | None = None) -> None:
    """Forget the twins of ``owner``'s fit and those of no client (a fit has ended: its device copies are freed);
    every twin without ``owner``.

    Example:
        >>> a, b = torch.ones(1), torch.ones(1)
        >>> remember_twin(a, a.clone(), owner=0); remember_twin(b, b.clone(), owner=1)
        >>> clear_twins(0); twins_on([a], "cpu"), twins_on([b], "cpu")
        (False, True)
        >>> clear_twins(); twins_on([b], "cpu")
        False
    """
    if owner is None:
        _twins.clear()
        return
    for key in [k for k, hit in _twins.items() if hit[3] is None or hit[3] == owner]:
        del _twins[key]


def twins_on(hosts: Iterable[Tensor], device: torch.device | str) -> bool:
    """Whether every one of ``hosts`` has a twin on ``device`` (and has not changed since)."""
    return all(_twin_of(t, device) is not None for t in hosts)


def _twin_of(t: Tensor, device: torch.device | str) -> Tensor | None:
    hit = _twins.get(id(t))
    if hit is None or hit[0]() is not t or hit[1] != t._version or needs_copy([hit[2]], device):
        return None
    return hit[2]


def mark_placed(tensors: Iterable[Tensor], device: torch.device | str) -> None:
    """Under :data:`ALWAYS_PACK`, record ``tensors`` as moved to ``device`` already (by a :func:`copy_tensors` call
    of their own), so that :func:`to_device` does not move them again; otherwise nothing."""
    if ALWAYS_PACK:
        _remember(_placed, tensors, str(device))
