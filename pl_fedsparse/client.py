"""What travels between clients and the server, and what a client keeps between rounds.

* :class:`Message` — tensors (and optional masks) sent over one link; its size is counted from its contents
  (:func:`pl_fedsparse.functional.message_nbytes`).
* :class:`ClientUpdate` — the result of one client's local fit: its trained state, the message it uploads,
  sample count, metrics, and an ``extras`` dict through which callbacks pass data to each other.
* :class:`ClientStateStore` — per-client persistent state declared by callbacks (torchmetrics' ``add_state`` idea),
  kept compact on CPU between fits and checkpointed as a whole; optionally with its float32 tensors compressed
  losslessly (``codec="lossless"``, :mod:`pl_fedsparse.functional.floatcodec`) for federations whose client state
  does not fit in memory otherwise.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch  # the doctests
from torch import Tensor

from pl_fedsparse.allocator import release_free_memory
from pl_fedsparse.context import FitContext, current_fit
from pl_fedsparse.errors import check
from pl_fedsparse.functional import floatcodec, transfer
from pl_fedsparse.functional.accounting import message_nbytes
from pl_fedsparse.functional.resident import ResidentCopies
from pl_fedsparse.resources import check_fits, human_bytes

__all__ = ["STATE_CODECS", "ClientStateStore", "ClientUpdate", "Message", "StateInit", "to_cpu_state"]

#: what :class:`ClientStateStore` may do to the tensors it keeps (``trainer.client_state_codec``)
STATE_CODECS = ("none", "lossless")

TensorTree = Any  # a Tensor, or a (nested) dict of Tensors
StateInit = Callable[[int], TensorTree]


def to_cpu_state(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Detached CPU copies of a state dict (never aliases the module's live parameters); from a device, all of them
    in one copy across the link (:func:`~pl_fedsparse.functional.transfer.copy_tensors`); on the host, clones (what
    ``copy_tensors`` makes there — also in a device run simulated on the CPU, where nothing crosses for them)."""
    values = list(state.values())
    if not transfer.on_a_device(values):
        return {name: t.detach().clone() for name, t in state.items()}
    return dict(zip(state, transfer.copy_tensors(values, "cpu")))


def _leaves(value: TensorTree, out: list[Tensor]) -> list[Tensor]:
    if isinstance(value, Mapping):
        for v in value.values():
            _leaves(v, out)
    elif isinstance(value, Tensor):
        out.append(value)
    return out


def _replace(value: TensorTree, it: Iterator[Tensor]) -> TensorTree:
    if isinstance(value, Mapping):
        return {k: _replace(v, it) for k, v in value.items()}
    return next(it) if isinstance(value, Tensor) else value


@dataclass
class Message:
    """Tensors sent over one link.

    Args:
        tensors: values by name (a full or partial state dict, an update, ...).
        masks: masks by name. A mask named like a tensor makes that tensor sparse on the wire; a mask with no
            tensor of that name is sent as a bitmap.
        ternary: names of masked tensors whose sent values are ``±μ`` (FedSTC): each costs one float, a sign bit
            per value and its positions.

    Example:
        >>> Message({"w": torch.ones(4)}).nbytes()
        16
    """

    tensors: dict[str, Tensor]
    masks: dict[str, Tensor] = field(default_factory=dict)
    ternary: frozenset[str] = frozenset()
    #: per mask name, ``(mask, the positions it holds)`` where whoever set the mask knew the count without reading
    #: the mask (e.g. from its packed bytes on the host: :meth:`know_count`); used while ``masks[name]`` is still
    #: that mask, so that a mask on a device is not counted there (a wait)
    known_counts: dict[str, tuple[Tensor, int]] = field(default_factory=dict, compare=False, repr=False)

    def know_count(self, name: str, mask: Tensor, count: int) -> None:
        """Remember that ``mask`` (to be ``masks[name]``) holds ``count`` positions."""
        self.known_counts[name] = (mask, int(count))

    def nbytes(self) -> int:
        """Bytes on the wire (see :mod:`pl_fedsparse.functional.accounting`)."""
        counts = {n: c for n, (m, c) in self.known_counts.items() if self.masks.get(n) is m}
        return message_nbytes(self.tensors, self.masks, self.ternary, counts)


@dataclass
class ClientUpdate:
    """One client's result for one round.

    Attributes:
        client_idx: 0-based client index.
        round_idx: 0-based round index.
        n_samples: the client's number of training samples (FedAvg's weight).
        state: the client's state after local training (CPU copies).
        message: what the client uploads; ``None`` when it uploads nothing. Callbacks may replace it in
            ``on_client_fit_end`` (e.g. with a sparse update). Defaults to the dense trained ``state``.
        masks: the client's masks, if a callback uses them.
        metrics: local training metrics (``train_loss``, ``samples_seen``, ...).
        extras: free-form data one callback leaves for another (e.g. ``extras["next_mask"]``).
        flops: training FLOPs spent by this fit.
        kind: why the client trained (:data:`~pl_fedsparse.context.FitKind`): ``"train"`` (a round's local fit),
            ``"finetune"``, ``"personal"``, ``"personal_refine"`` (fits requested by callbacks).
        context: the fit's :class:`~pl_fedsparse.context.FitContext` (client, round, kind, stream, seed).
        client_state: the client's declared state after the fit (what an executor hands back to the loop).
        flop_charges: FLOPs charged during the fit, in order, not yet booked by the loop's accounting.
        fault: why the fit is unusable (``"exception"``, ``"no_data"``, ``"nonfinite_loss"``,
            ``"nonfinite_weights"``, ``"nonfinite_upload"``), ``None`` when healthy; a faulty update is left out of
            aggregation and gossip and the client keeps its previous state (``trainer.on_client_fault``).
        fault_detail: a short description (the exception, the tensor).
        pending: reads put off until the update crosses to the host (:meth:`on_host`); empty once the fit ended.
    """

    client_idx: int
    round_idx: int
    n_samples: int
    state: dict[str, Tensor]
    message: Message | None = None
    masks: dict[str, Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    flops: float = 0.0
    kind: str = "train"
    context: FitContext | None = None
    client_state: dict[str, TensorTree] | None = None
    flop_charges: list[float] = field(default_factory=list)
    fault: str | None = None
    fault_detail: str | None = None
    pending: list[tuple[list[Tensor], Callable[[list[Tensor]], None]]] = field(default_factory=list, repr=False,
                                                                                compare=False)

    def on_host(self, tensors: Sequence[Tensor], then: Callable[[list[Tensor]], None]) -> None:
        """Call ``then`` with host copies of ``tensors`` when the fit ends: they cross to the host with the update's
        own tensors, in its one copy, instead of making the host wait for the device now (``.tolist()`` of a device
        tensor in ``on_client_fit_end`` waits for everything queued before it). Where the tensors are on the host,
        ``then`` gets them as they are, at the same point of the fit's end — so a run takes the same steps on the CPU
        and on a GPU. The calls run in the order they were asked for, before the fit's faults are looked for.

        Example:
            >>> u = ClientUpdate(0, 0, 1, {}, metrics={})
            >>> u.on_host([torch.tensor([1.5, 2.5])], lambda host: u.metrics.update(total=sum(host[0].tolist())))
            >>> u.metrics  # (nothing read yet)
            {}
            >>> u.resolve_pending(); u.metrics
            {'total': 4.0}
        """
        self.pending.append((list(tensors), then))

    def resolve_pending(self, host: Mapping[int, Tensor] | None = None) -> None:
        """Run the calls :meth:`on_host` put off, each with its tensors' host copies (``host``: copy by tensor id;
        a tensor not in it is passed as it is). The engine calls this when the fit ends."""
        pending, self.pending = self.pending, []
        for tensors, then in pending:
            then([host.get(id(t), t) if host else t for t in tensors])


def _compact(value: TensorTree) -> TensorTree:
    """CPU, detached; 0/1 masks become bool so that many clients fit in memory."""
    if isinstance(value, Mapping):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, Tensor):
        if value.device.type == "cpu":  # (the tensor itself when it is detached already: its device copy is found)
            return value.detach() if value.requires_grad or value.grad_fn is not None else value
        return value.detach().to("cpu")
    return value


def _nbytes(value: TensorTree) -> int:
    if isinstance(value, Mapping):
        return sum(_nbytes(x) for x in value.values())
    return value.numel() * value.element_size() if isinstance(value, Tensor) else 0


def _storages(value: TensorTree, out: dict[int, int] | None = None) -> dict[int, int]:
    """``{storage pointer: bytes}`` of the tensors in ``value`` (a storage shared by several tensors counted once)."""
    out = {} if out is None else out
    if isinstance(value, Mapping):
        for v in value.values():
            _storages(v, out)
    elif isinstance(value, Tensor):
        storage = value.untyped_storage()
        out[storage.data_ptr()] = storage.nbytes()
    return out


def _has_encoded(value: TensorTree) -> bool:
    if floatcodec.is_encoded(value):
        return True
    return isinstance(value, Mapping) and any(_has_encoded(v) for v in value.values())


class ClientStateStore:
    """Per-client persistent state, declared by name with an initialiser.

    The loop creates every declared entry of every client when the federation starts (:meth:`materialize`), from
    the initial weights — never later, so no entry is drawn by whichever hook happens to read it first (e.g. during
    an evaluation, after another model's weights were loaded). After that, reading an entry that does not exist is
    an error. Before it (in tests and tools), entries are created on first read. Values are tensors or (nested)
    dicts of tensors, stored on CPU; initialisers that return the same tensor objects for every client (e.g. the
    initial weights) cost nothing per client.

    Example:
        >>> store = ClientStateStore()
        >>> store.declare("cb.counter", lambda k: torch.tensor(k))
        >>> int(store.get(3, "cb.counter"))
        3
        >>> store.set(3, "cb.counter", torch.tensor(7)); int(store.get(3, "cb.counter"))
        7

    Args:
        codec: ``"none"`` keeps tensors as they are. ``"lossless"`` keeps every float32 tensor of at least
            :data:`~pl_fedsparse.functional.floatcodec.MIN_NUMEL` values compressed
            (:mod:`~pl_fedsparse.functional.floatcodec`: ~3.4 bytes per value instead of 4 for trained weights)
            and decodes it on :meth:`get`, bit for bit — results do not change; each :meth:`set` and :meth:`get` of
            a large tensor costs a few vectorised passes over it (5.6 M values, one CPU thread: 30-45 ms to encode,
            20-40 ms to decode).
            :meth:`export_client` and :meth:`state_dict` hand out the encoded form (it travels to workers and
            into checkpoints as it is); :meth:`load_state_dict` converts a checkpoint written with the other codec.
            A tensor shared by many clients (e.g. the initial weights) is encoded once and stays shared.
        device_budget: bytes of device memory for copies of what crossed to the fits' device, kept between fits
            (:attr:`resident`; ``trainer.device_state_budget``): a fit's start weights and entries found there do
            not cross again. 0 (default) keeps none. The stored values stay on the host either way.

    After every :attr:`release_every` bytes of newly stored state the store hands the heap's free pages back to the
    system (:func:`~pl_fedsparse.allocator.release_free_memory`): without that, the driver of a long federation
    grows by the free space its fits leave in the heap — measured: 2-3× the stored state for ResNet18 clients.
    """

    #: bytes of newly stored client state after which the heap's free pages are handed back (0: never)
    release_every: int = 64 << 20

    def __init__(self, codec: Literal["none", "lossless"] = "none", device_budget: int = 0) -> None:
        check(codec in STATE_CODECS, "trainer.client_state_codec", codec, "one of " + ", ".join(STATE_CODECS))
        self.codec = codec
        #: device copies of what crossed to the fits' device (entries, start weights) and of the entries a fit wrote
        #: there, kept between fits within ``device_budget`` bytes (``trainer.device_state_budget``): a later fit
        #: reads them without crossing the link (:mod:`~pl_fedsparse.functional.resident`)
        self.resident = ResidentCopies(device_budget)
        self._inits: dict[str, StateInit] = {}
        self._data: dict[int, dict[str, TensorTree]] = {}
        self._sealed = False
        # id(tensor) -> (weak reference, version counter, encoded form): shared tensors stay shared when encoded
        self._memo: dict[int, tuple[weakref.ref, int, Any]] = {}
        self._written = 0  # bytes stored since the heap was last trimmed
        self._pending: dict[int, list[str]] = {}  # entries set during a fit, still on the device (flush_writes)
        # per client, per entry: its leaves' copies on the fit's device, moved ahead with the start weights (prefetch)
        self._prefetched: dict[int, dict[str, list[Tensor]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        self.flush_writes()
        # (weak references do not pickle; the memo is only a shortcut, the prefetched copies only a fit's; the
        # device copies stay on their device)
        return {**vars(self), "_memo": {}, "_prefetched": {}, "resident": ResidentCopies(self.resident.budget)}

    def _keep(self, value: TensorTree) -> TensorTree:
        """What the store holds for ``value``: compact on CPU and, with the lossless codec, encoded."""
        if floatcodec.is_encoded(value):
            return value if self.codec == "lossless" else floatcodec.decode(value)
        if isinstance(value, Mapping):
            return {k: self._keep(v) for k, v in value.items()}
        if self.codec == "none" or not isinstance(value, Tensor):
            return _compact(value)
        return self._encode(value)

    def _encode(self, t: Tensor) -> Any:
        """``t`` encoded (memoised by identity and version, so a tensor many clients share is encoded once)."""
        hit = self._memo.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        enc = floatcodec.encode(_compact(t))
        if floatcodec.is_encoded(enc):
            self._remember(t, enc)
        return enc

    def _remember(self, t: Tensor, enc: Any) -> None:
        key, memo = id(t), self._memo
        memo[key] = (weakref.ref(t, lambda _: memo.pop(key, None)), t._version, enc)

    def _decoded(self, value: TensorTree) -> TensorTree:
        """A new tree with every encoded tensor decoded; a decoded tensor set back unchanged is not encoded again."""
        if floatcodec.is_encoded(value):
            t = floatcodec.decode(value)
            if self.codec == "lossless":
                self._remember(t, value)
            return t
        if isinstance(value, Mapping):
            return {k: self._decoded(v) for k, v in value.items()}
        return value

    def declare(self, key: str, init: StateInit) -> None:
        """Declare an entry ``key`` created by ``init(client_idx)`` on first use."""
        if key in self._inits:
            raise ValueError(f"client state {key!r} is declared twice")
        self._inits[key] = init

    @property
    def keys(self) -> list[str]:
        """Declared entry names."""
        return list(self._inits)

    def has(self, client_idx: int, key: str) -> bool:
        """Whether the entry exists already (without creating it)."""
        return key in self._data.get(client_idx, {})

    def get(self, client_idx: int, key: str) -> TensorTree:
        """The entry, created by its initialiser on first access (decoded: see ``codec``).

        While a local fit runs (:func:`~pl_fedsparse.context.current_fit`) the value is the fit's own copy (new
        dicts, cloned tensors): whatever the fit does to it (an optimizer stepping a loaded momentum buffer in place,
        an edited dict) never reaches the stored entry, which only :meth:`set` replaces — so a failed fit leaves
        the client exactly as it was (the executor puts back the references it exported before the fit). Outside a
        fit the stored tensors themselves are handed out, read-only.
        """
        if key in self._pending.get(client_idx, ()):  # set on a device earlier in this fit: read as every entry is
            self.flush_writes(client_idx)
        value = self.stored(client_idx, key)
        if current_fit() is not None:
            private = self._private(value)
            twins = self._prefetched.get(client_idx, {}).get(key)
            if twins is not None:  # on the fit's device already: moving this copy there costs no host copy
                for host, twin in zip(_leaves(private, []), twins):
                    transfer.remember_twin(host, twin, owner=client_idx)
            return private
        return self.decode(value)

    def prefetch(self, client_idx: int, device: torch.device | str, extra: Sequence[Tensor] = ()) -> list[Tensor]:
        """Move the client's entries to ``device`` for the fit about to start, in one copy together with ``extra``
        (the start weights); returns ``extra``'s copies there. The host copies :meth:`get` hands out during the fit
        then reach ``device`` without crossing the link again when a callback moves them
        (:func:`~pl_fedsparse.functional.transfer.to_device`); the fit reads host tensors as ever.
        :meth:`end_prefetch` (the fit's end) drops the copies."""
        self.end_prefetch(client_idx)
        keys = [key for key in self._inits if self.has(client_idx, key) and key not in self._pending.get(client_idx, ())]
        stored = {key: self.stored(client_idx, key) for key in keys}
        leaves = {key: _leaves(self.decode(stored[key]), []) for key in keys}
        flat = [t for key in keys for t in leaves[key]] + list(extra)
        # (an encoded entry's decoded tensors are new at every read: never found again, so not kept)
        plain = {key: not _has_encoded(stored[key]) for key in keys}
        found = self.on_device(flat, device, [plain[key] for key in keys for _ in leaves[key]] + [True] * len(extra))
        moved = iter(found)
        self._prefetched[client_idx] = {key: [next(moved) for _ in leaves[key]] for key in keys}
        return list(moved)

    def on_device(self, tensors: Sequence[Tensor], device: torch.device | str,
                  keep: bool | Sequence[bool] = True) -> list[Tensor]:
        """``tensors`` on ``device``, crossing the link only for what is not there yet: a tensor on ``device`` already
        is handed back as it is, a host tensor whose copy is kept there (:attr:`resident`) gets that copy, and the
        rest cross in one copy — kept there afterwards (within the budget) where ``keep`` says so. Do not keep a
        tensor made anew at every read (a decoded one): it is never found again. The copies are handed out again:
        read them, never change them in place.

        What the work done where the fits run reads the stored state with: a fit's start
        (:meth:`prefetch`) and server work on the fits' device (DisPFL's gossip reads each neighbour's stored model
        once a round across the link, then from the copy kept there).

        Example:
            >>> store = ClientStateStore()
            >>> t = torch.ones(2)
            >>> store.on_device([t], "cpu")[0] is t  # (on the CPU, with nothing to move: as it is)
            True
        """
        flags = [keep] * len(tensors) if isinstance(keep, bool) else list(keep)
        dev = torch.device(device)
        found: list[Tensor | None] = [t if transfer.is_on(t, dev) else self.resident.lookup(t, dev) for t in tensors]
        todo = [i for i, c in enumerate(found) if c is None]
        copies = transfer.copy_tensors([tensors[i] for i in todo], dev, share=True, force=True)
        for i, c in zip(todo, copies):
            found[i] = c
        transfer.mark_placed(copies, dev)  # (a simulated device run: the copies are on "the device")
        self._keep_resident([tensors[i] if flags[i] else None for i in todo], copies)
        return found  # type: ignore[return-value]

    def to_host(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """``tensors`` on the host: host tensors as they are, the others copied there in one copy — each keeping its
        device copy as the host copy's (:attr:`resident`, within the budget), so that moving the host copy back to
        the device costs nothing. What work done on the fits' device hands back to the host with (the server's new
        weights, aggregated there: the next round's fits find them on the device).

        Example:
            >>> t = torch.ones(2)
            >>> ClientStateStore().to_host([t])[0] is t
            True
        """
        away = [i for i, t in enumerate(tensors) if transfer.on_a_device([t])]
        out = list(tensors)
        if not away:
            return out
        packed: list[Tensor | None] | None = [] if self.resident.active else None
        copies = transfer.copy_tensors([tensors[i] for i in away], "cpu", packed=packed)
        for i, c in zip(away, copies):
            out[i] = c
        if packed is not None:
            self._keep_resident(copies, packed)
        return out

    def end_prefetch(self, client_idx: int) -> None:
        """Drop what :meth:`prefetch` moved for the client (its fit has ended)."""
        if self._prefetched.pop(client_idx, None) is not None:
            transfer.clear_twins(client_idx)  # (only this fit's: a stacked group's other fits are still open)

    def _private(self, value: TensorTree) -> TensorTree:
        """A copy of ``value`` that shares nothing mutable with the store (decoded tensors are new already)."""
        if floatcodec.is_encoded(value):
            return self._decoded(value)
        if isinstance(value, Mapping):
            # (a mapping's tensors in one multi-tensor copy: on a GPU a launch or a few, not one per tensor)
            flat = {k: v for k, v in value.items() if isinstance(v, Tensor)}
            copies = dict(zip(flat, transfer.clone_tensors(list(flat.values()))))
            return {k: copies[k] if k in copies else self._private(v) for k, v in value.items()}
        return value.clone() if isinstance(value, Tensor) else value

    def stored(self, client_idx: int, key: str) -> TensorTree:
        """The entry as the store holds it — encoded where the codec encoded it: a reference to keep (e.g. a
        snapshot of every client at the start of a round) that costs no memory; read it with :meth:`decode`."""
        slot = self._data.setdefault(client_idx, {})
        if key not in slot:
            if key not in self._inits:
                raise KeyError(f"client state {key!r} was never declared")
            if self._sealed:
                raise KeyError(f"client state {key!r} of client {client_idx} does not exist: entries are created when "
                               "the federation starts (declare them in setup_federation)")
            slot[key] = self._keep(self._inits[key](client_idx))
        return slot[key]

    def decode(self, value: TensorTree) -> TensorTree:
        """``value`` (from :meth:`stored`, :meth:`export_client`) with its encoded tensors decoded; ``value`` itself
        where nothing is encoded."""
        return self._decoded(value) if _has_encoded(value) else value

    def materialize(self, clients: Iterable[int]) -> None:
        """Create every missing entry of ``clients`` (in declaration order), then refuse lazy creation.

        Before creating more than two clients' entries, the memory all of them need (the new storage the second
        client's entries take, times the clients) is checked against the available memory: a federation whose
        client state cannot fit is refused in one line (``data.num_clients``) instead of swapping or being killed.
        """
        clients = list(clients)
        for i, k in enumerate(clients):
            if i == 2 and self._inits:
                seen = _storages(self._data.get(clients[0], {}))
                marginal = sum(n for ptr, n in _storages(self._data.get(clients[1], {})).items() if ptr not in seen)
                missing = sum(1 for c in clients[2:] if c not in self._data)  # a resume restored the others
                check_fits("data.num_clients", len(clients), marginal * missing,
                           f"{len(clients)} clients' declared state ({human_bytes(marginal)} each: "
                           f"{', '.join(self._inits)})")
            for key in self._inits:
                self.get(k, key)
        self._sealed = True

    def export_client(self, client_idx: int) -> dict[str, TensorTree]:
        """All entries of one client (references, no copies; encoded as stored): what travels in a fit request."""
        self.flush_writes(client_idx)
        return dict(self._data.get(client_idx, {}))

    def import_client(self, client_idx: int, entries: Mapping[str, TensorTree]) -> None:
        """Replace one client's entries with ``entries`` (as returned by :meth:`export_client`)."""
        unknown = [k for k in entries if k not in self._inits]
        if unknown:
            raise KeyError(f"client state {unknown} was never declared")
        slot = self._data.setdefault(client_idx, {})
        for key, value in entries.items():
            if slot.get(key) is not value:
                slot[key] = self._keep(value)
                self._count(slot[key])

    def restore_client(self, client_idx: int, entries: Mapping[str, TensorTree]) -> None:
        """Put back one client's entries exactly as :meth:`export_client` returned them (the same objects; entries
        created since are dropped): how a failed fit is rolled back."""
        self._drop_pending(client_idx)
        self.end_prefetch(client_idx)
        self._data[client_idx] = dict(entries)

    def set(self, client_idx: int, key: str, value: TensorTree) -> None:
        """Replace the entry (stored compact on CPU)."""
        if key not in self._inits:
            raise KeyError(f"client state {key!r} was never declared")
        self._prefetched.get(client_idx, {}).pop(key, None)  # (a later read gets the new value)
        if current_fit() is not None and not floatcodec.is_encoded(value):
            leaves = _leaves(value, [])
            if transfer.ALWAYS_PACK or transfer.needs_copy(leaves, "cpu"):
                # set during a fit from the device: kept there until the fit ends, when all of the fit's entries
                # cross to the host in one copy (flush_writes) instead of one copy per tensor
                self._data.setdefault(client_idx, {})[key] = _replace(value, (t.detach() for t in leaves))
                pending = self._pending.setdefault(client_idx, [])
                if key not in pending:
                    pending.append(key)
                return
        self._drop_pending(client_idx, key)
        kept = self._data.setdefault(client_idx, {})[key] = self._keep(value)
        self._count(kept)

    def _drop_pending(self, client_idx: int, key: str | None = None) -> None:
        pending = self._pending.get(client_idx)
        if pending is not None:
            if key is None:
                pending.clear()
            elif key in pending:
                pending.remove(key)
            if not pending:
                del self._pending[client_idx]

    def flush_writes(self, client_idx: int | None = None, extra: Sequence[Tensor] = ()) -> list[Tensor]:
        """Bring the entries set on a device during a fit to the host (of one client, or all), in one copy together
        with ``extra`` tensors (e.g. a fit's upload); returns ``extra``'s host copies. The executor calls it when a
        fit ends, before the client's entries are exported; reading the store outside a fit never sees a device
        tensor."""
        clients = list(self._pending) if client_idx is None else [client_idx] if client_idx in self._pending else []
        values = [(k, key, self._data[k][key]) for k in clients for key in self._pending[k]]
        leaves = [_leaves(v, []) for _, _, v in values]
        # with a budget, the copies packed on the device before the buffer crossed (private: no callback holds them)
        # stay there as the host copies' device copies
        packed: list[Tensor | None] | None = [] if self.resident.active else None
        moved = iter(transfer.copy_tensors([t for ls in leaves for t in ls] + list(extra), "cpu", packed=packed))
        hosts: list[Tensor | None] = []
        for (k, key, value), device_leaves in zip(values, leaves):
            kept = self._data[k][key] = self._keep(_replace(value, moved))
            self._count(kept)
            if packed is not None:  # (an encoded entry is decoded anew at every read: never found again)
                hosts += [None] * len(device_leaves) if _has_encoded(kept) else _leaves(kept, [])
        for k in clients:
            del self._pending[k]
        out = list(moved)
        if packed is not None:
            self._keep_resident([*hosts, *out], packed)
        return out

    def _keep_resident(self, hosts: Sequence[Tensor | None], copies: Sequence[Tensor | None]) -> None:
        """Remember each device copy in ``copies`` for its host tensor (``None`` on either side: nothing to keep)."""
        for host, copy in zip(hosts, copies):
            if host is not None and copy is not None and transfer.on_a_device([copy]):
                self.resident.keep(host, copy)

    def _count(self, value: TensorTree) -> None:
        self._written += _nbytes(value)
        if self.release_every and self._written >= self.release_every:
            self._written = 0
            release_free_memory()

    def clients(self) -> Iterator[int]:
        """Clients that have at least one entry."""
        return iter(sorted(self._data))

    def state_dict(self) -> dict[int, dict[str, TensorTree]]:
        """Everything, for a checkpoint (only tensors, dicts and ints: loadable with ``weights_only=True``; encoded
        tensors as stored)."""
        self.flush_writes()
        return {k: dict(v) for k, v in self._data.items()}

    def load_state_dict(self, state: Mapping[int, Mapping[str, TensorTree]]) -> None:
        """Restore from :meth:`state_dict`; every key must have been declared."""
        unknown = {key for slot in state.values() for key in slot if key not in self._inits}
        if unknown:
            raise KeyError(f"checkpoint holds client state nobody declared: {sorted(unknown)}")
        self._data = {int(k): {kk: self._keep(vv) for kk, vv in v.items()} for k, v in state.items()}

    def nbytes(self) -> int:
        """Memory held by all entries (encoded tensors at their encoded size; shared tensors counted per client)."""
        return sum(_nbytes(v) for slot in self._data.values() for v in slot.values())
