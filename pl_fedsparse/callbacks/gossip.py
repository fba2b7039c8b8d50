"""Serverless averaging with neighbours: :class:`Gossip` (DisPFL, D-PSGD).

At the start of a round every client's last trained model and the mask it trained with are snapshotted. Client
``k``'s new starting point is the per-coordinate average of its own and its neighbours' snapshot models over the
positions each of them holds (DisPFL Alg. 1 line 7):

    w_k ← (Σ_{j ∈ N_k ∪ {k}} m_j ⊙ w_j) / (Σ_{j ∈ N_k ∪ {k}} m_j)        (0 where nobody holds a position)

and a mask callback (:class:`~pl_fedsparse.callbacks.SparseMask` / ``RandomRegrow`` / ``GradientRegrow``) then
multiplies it by ``k``'s current mask in ``on_client_message``. Without masks this is D-PSGD's uniform average. The
average is the same kernel as the server methods' (:func:`~pl_fedsparse.functional.weighted_average`). Before its first fit a client's snapshot is
the initial model under its initial mask (``loop.client_masks``), so round 0 is counted sparse too. Every client
reads the snapshot only, so the order in which clients are processed cannot matter. Each link ``j → k`` is recorded in
the communication ledger with the bytes of ``j``'s (sparse) model.

Client memory: a client's last model is kept sparse — the values at its mask's positions (a 1-D tensor per masked
tensor) beside the bit-packed mask — and expanded (zeros elsewhere) when it is sent or evaluated. For ResNet18-GN at
density 0.5 that is 24 MB per client instead of 45 MB (``benchmarks/client_memory.py``; 21.6 MB with
``trainer.client_state_codec: lossless``). Before its first fit a client holds references to the shared initial
weights (nothing per client). The round's snapshot holds the entries as stored (encoded under the lossless codec) and
decodes one sender at a time; it stays in the driver (``driver_only_attributes``).

Where the average is made: on the device the fits run on, when they run in this process on an accelerator
(:func:`~pl_fedsparse.callbacks.base.message_device`; the host otherwise, and always on the CPU). Each neighbour's
stored values and packed mask then cross to the device once a round and are kept there for its other neighbours
(the client store's device copies, ``trainer.device_state_budget``), unpacked, expanded and averaged there; the
message reaches its fit without crossing the link again. Each model of the group is added as one flat buffer — its
masks' bytes and its values joined, unpacked, expanded and added in one go
(:func:`~pl_fedsparse.functional.sparse.group_average_stored`: about ten operators a model instead of about ten a
model and tensor, which on a GPU are kernel launches; the same bits; a member that has not trained yet, holding
the initial dense model under its first mask, is added as its values times its mask) — except with mixed dtypes, or
in a subclass overriding ``sender_message`` or ``_expand``, where the messages are expanded tensor by tensor. The
ledger's bytes are counted from the packed masks on the host (:func:`~pl_fedsparse.functional.sparse.packed_count`,
once per sender and round), so nothing waits for the device. The arithmetic is the host's, element by element (a
GPU may round a fused multiply-add differently in the last bit); a simulated device run on the CPU gives the same
numbers bit for bit (``tests/test_device_messages.py``).

Two readings of a serverless run (``consensus_eval``): every evaluation reports each client's own model — the personal
view, ``acc_mean`` — and, with ``consensus_eval: true``, also the *consensus*: the uniform average of all clients'
models (:func:`consensus_state`), evaluated on every client's test data as the model kind ``"consensus"``
(``consensus_acc``, ``consensus_acc_weighted``, ``<view>/consensus_acc``, ``consensus_f1_macro``, …; see
:mod:`pl_fedsparse.evaluation`). The consensus is what the DisPFL code reports for D-PSGD (``dpsgd_api.py:85``: the
"global" model is the average of all clients' models, ``:159-167``, then tested on every client) and what its
D-PSGD-FT fine-tunes from (:class:`~pl_fedsparse.callbacks.FineTune` with ``start: consensus``). No peer could
compute it, so it is an evaluation-only view: it is built in the driver right before an evaluation and dropped
after it, sends nothing (no bytes in the ledger), trains nothing (no FLOPs) and leaves every client's state as it
was — a run gives the same training numbers with it on or off (``tests/test_consensus_view.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback, message_device
from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.functional.accounting import message_nbytes
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.functional.sparse import (
    expand_values,
    group_average_stored,
    pack_masks,
    packed_count,
    unpack_masks,
)

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["Gossip", "consensus_state"]


def consensus_state(loop: FederationView) -> dict[str, Tensor]:
    """The *consensus* of a federation: the uniform average of every client's personal model.

    The DisPFL code's D-PSGD "global" model (``dpsgd_api.py:85``, averaged over all clients at ``:159-167``) and the
    start of its D-PSGD-FT fine-tuning. Each client's model is ``loop.personal_state(k)`` — what the personal view of
    the evaluation loads for that client (before evaluation hooks adjust it, e.g. ``FineTune``'s fine-tuned model
    or a mask under ``mask_personal_eval``). For masked clients (DisPFL) it is the plain uniform average of their
    stored weights, each zero off its own mask, as the DisPFL code averages its clients' models: no per-coordinate
    normalisation by the masks and no mask on the result.

    Clients are added one at a time (memory: one client's expanded model plus the sum, not every client's), with
    the arithmetic of ``weighted_average(states, [1.0] * n)`` (:func:`~pl_fedsparse.functional.weighted_average`,
    the same additions in the same order), so the result is bit for bit ``FineTune(start="consensus")``'s start.
    Non-floating entries are taken from client 0. Reads the client store only (no RNG, no communication).

    Args:
        loop: a set-up federation (in the driver: every client's state is needed).

    Returns:
        A new state dict (CPU tensors).
    """
    n = loop.num_clients
    total: dict[str, Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for k in range(n):
        for name, t in loop.personal_state(k).items():
            if k == 0:
                dtypes[name] = t.dtype
                if not t.is_floating_point():
                    total[name] = t.clone()
                    continue
                acc_dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
                total[name] = torch.zeros(t.shape, dtype=acc_dtype, device=t.device)
            if dtypes[name].is_floating_point:
                total[name].add_(t.to(total[name].dtype), alpha=1.0 / n)
    return {name: t.to(dtypes[name]) for name, t in total.items()}


class Gossip(FederatedCallback):
    """Peer-to-peer averaging over the topology's neighbours (owns ``client_message``, ``aggregate`` and
    ``personal_state``: there is no global model; a client's personal model is its last trained model).

    Args:
        consensus_eval: also evaluate the consensus — the uniform average of all clients' models
            (:func:`consensus_state`) — on every client's test data at every evaluation, reported as
            ``consensus_acc``, ``consensus_acc_weighted`` (and ``<view>/consensus_acc``, ``consensus_<metric>``) beside
            the personal models' ``acc_mean``: the DisPFL code's D-PSGD reading (``dpsgd_api.py:85,159-167``).
            Evaluation only: no bytes, no FLOPs, no change to training; a resumed run may switch it. Default off: it
            costs one more forward pass per client and view, and for DisPFL itself the code reports each client's
            freshly trained model (``_local_test_on_all_clients``, mean at ``dispfl_api.py:262``); the D-PSGD and
            D-PSGD-FT configs switch it on.

    Example:
        .. code-block:: yaml

            trainer:
              topology: {class_path: pl_fedsparse.topology.RandomPeers, init_args: {k: 10}}
              callbacks:
                - class_path: pl_fedsparse.callbacks.RandomRegrow      # DisPFL; omit for D-PSGD
                  init_args: {density: 0.5, same_mask: false, mask_personal_eval: false}
                - class_path: pl_fedsparse.callbacks.Gossip
                  init_args: {consensus_eval: true}                    # also report the consensus (D-PSGD)
    """

    #: (client_message runs in the driver)
    driver_only_attributes = ("_snapshot", "_decode", "_store", "_counts", "_nbytes")
    #: the consensus of the evaluation in progress (None between evaluations); not driver-only: an out-of-process
    #: executor's workers receive it with the callbacks to evaluate their clients on it
    scratch_attributes = ("_consensus",)
    #: evaluation only: switching the consensus view changes no round already run
    resume_may_change: tuple[str, ...] = ("consensus_eval",)

    def __init__(self, *, consensus_eval: bool = False) -> None:
        check(isinstance(consensus_eval, bool), "Gossip.consensus_eval", consensus_eval, "true or false")
        self.consensus_eval = consensus_eval
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._snapshot: dict[int, tuple[dict[str, Tensor], dict[str, Tensor]]] = {}
        self._decode: Callable[[Any], Any] = lambda value: value
        self._store: ClientStateStore | None = None
        # per sender, the positions each of its masks holds (this round's snapshot), counted once on the host
        self._counts: dict[int, dict[str, int]] = {}
        # per sender, the bytes of its message this round (the ledger's, counted once)
        self._nbytes: dict[int, int] = {}
        self._consensus: dict[str, Tensor] | None = None

    @override
    def setup_federation(self, loop: FederationView) -> None:
        if loop.topology.has_server:
            raise ConfigError(f"trainer.topology={type(loop.topology).__name__} is invalid for Gossip: expected a "
                              "peer topology (pl_fedsparse.topology.Ring, FullyConnected or RandomPeers)")
        self._shapes = {k: tuple(v.shape) for k, v in loop.initial_state.items()}
        self._consensus = None
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))
        # the mask of the last fit, bit-packed ({} = dense); before the first fit, the client's initial mask (from the
        # mask callback's client_masks policy), so round 0 already sends w₀ ⊙ m_k as DisPFL's clients do
        self.add_client_state(loop, "mask", lambda k: pack_masks(loop.client_masks(k) or {}))

    @override
    def on_round_start(self, loop: FederationView, round_idx: int) -> None:
        # references to the stored tensors, as stored (encoded with trainer.client_state_codec: lossless — decoded
        # per message, so the snapshot of every client costs no memory): entries are replaced, never mutated, when
        # clients finish training
        store, key = loop.client_store, self.client_state_prefix
        self._snapshot = {j: (store.stored(j, f"{key}/weights"), store.stored(j, f"{key}/mask"))
                          for j in range(loop.num_clients)}
        self._decode, self._store, self._counts, self._nbytes = store.decode, store, {}, {}

    def _expand(self, weights: dict[str, Tensor], masks: dict[str, Tensor]) -> dict[str, Tensor]:
        """Dense tensors from a stored model: a masked tensor stored as its values at the mask's positions is put
        back in place (zeros elsewhere); tensors stored dense are returned as they are."""
        out = {}
        for name, v in weights.items():
            m = masks.get(name)
            if m is not None and tuple(v.shape) != self._shapes[name]:
                v = expand_values(v, m)
            out[name] = v
        return out

    def sender_message(self, client_idx: int, device: torch.device | None = None) -> Message:
        """What ``client_idx`` sends to a neighbour: its snapshot model, sparse under the mask it trained with —
        made on ``device`` when given (:func:`~pl_fedsparse.callbacks.base.message_device`): the stored values and
        packed masks cross to it once (the store keeps their copies there within ``trainer.device_state_budget``,
        so the sender's other neighbours read them there) and are unpacked and expanded there."""
        return self._message(client_idx, *self._stored_on(client_idx, device))

    def _message(self, client_idx: int, plain: dict[str, Tensor], packed: dict[str, Tensor]) -> Message:
        """:meth:`sender_message` from the sender's stored model already where the message is made."""
        masks = unpack_masks(packed, self._shapes) if packed else {}
        message = Message(self._expand(plain, masks), masks)
        counts = self._packed_counts(client_idx)
        for name, m in masks.items():
            message.know_count(name, m, counts[name])
        return message

    def _stored_on(self, client_idx: int, device: torch.device | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """``client_idx``'s snapshot model as stored — its values (decoded) and packed masks — on ``device``."""
        weights, host_packed = self._snapshot[client_idx]
        assert self._store is not None or device is None
        return self._moved(self._store, weights, self._decode(weights), host_packed, device)  # type: ignore[arg-type]

    def _packed_counts(self, client_idx: int) -> dict[str, int]:
        """The positions each of the sender's masks holds: the ledger's counts, read from the packed bytes on the
        host once per sender and round (no wait on a device)."""
        counts = self._counts.get(client_idx)
        if counts is None:
            packed = self._snapshot[client_idx][1]
            counts = self._counts[client_idx] = {name: packed_count(p) for name, p in packed.items()}
        return counts

    def _sent_nbytes(self, client_idx: int, plain: dict[str, Tensor]) -> int:
        """The bytes of :meth:`sender_message` for ``client_idx`` (its ``nbytes()``), from the stored model's shapes,
        dtypes and mask counts alone (nothing expanded; once per sender and round)."""
        nbytes = self._nbytes.get(client_idx)
        if nbytes is None:
            # (meta tensors: the shapes and dtypes the message's tensors and masks have, with no data)
            tensors = {n: torch.empty(self._shapes.get(n, tuple(v.shape)), dtype=v.dtype, device="meta")
                       for n, v in plain.items()}
            masks = {n: torch.empty(self._shapes[n], dtype=torch.bool, device="meta")
                     for n in self._snapshot[client_idx][1]}
            nbytes = self._nbytes[client_idx] = message_nbytes(tensors, masks, counts=self._packed_counts(client_idx))
        return nbytes

    @staticmethod
    def _moved(store: ClientStateStore, stored: dict[str, Any], plain: dict[str, Tensor], packed: dict[str, Tensor],
               device: torch.device | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """A stored model's values (``plain``: ``stored`` decoded) and packed masks on ``device`` (as they are for
        ``None``), read from the store's copies there where kept, the rest moved in one copy and kept there."""
        if device is None:
            return plain, packed
        names, masked = list(plain), list(packed)
        # (a decoded tensor is new at every read: not kept)
        keep = [plain[name] is stored[name] for name in names] + [True] * len(masked)
        moved = store.on_device([*plain.values(), *packed.values()], device, keep)
        return dict(zip(names, moved[:len(names)])), dict(zip(masked, moved[len(names):]))

    @override
    def client_message(self, loop: FederationView, client_idx: int) -> Message | None:
        topo, r, n = loop.topology, loop.round_idx, loop.num_clients
        device = message_device(loop)  # (None: on the host)
        if topo.skips_aggregation(r, client_idx, n, loop.seed):
            return Message(dict(self.sender_message(client_idx, device).tensors))
        neighbours = topo.neighbors(r, client_idx, range(n), loop.seed)
        group = [client_idx, *neighbours]
        if type(self).sender_message is Gossip.sender_message and type(self)._expand is Gossip._expand:
            # the group's stored models averaged as one flat buffer each (group_average_stored: the same numbers
            # bit for bit, a few operators per model); a subclass that changes what a sender sends, or a model
            # the flat form does not take (mixed dtypes), is expanded tensor by tensor
            stored = [self._stored_on(j, device) for j in group]
            avg = group_average_stored(stored, self._shapes, [self._packed_counts(j) for j in group])
            if avg is not None:
                for j, (plain, _) in zip(neighbours, stored[1:]):
                    loop.accounting.send(j, client_idx, self._sent_nbytes(j, plain))
                return Message(avg)
            messages = [self._message(j, *st) for j, st in zip(group, stored)]
        else:
            messages = [self.sender_message(j, device) for j in group]
        for j, msg in zip(neighbours, messages[1:]):
            loop.accounting.send(j, client_idx, msg)
        avg = weighted_average([m.tensors for m in messages], [1.0] * len(messages),
                               [m.masks or None for m in messages])
        return Message(avg)

    @override
    def on_before_aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> None:
        # after every callback's on_client_fit_end, so update.masks is final whatever the callback order; only the
        # round's own fits are here (fine-tuning fits never become a client's gossip model)
        self._consensus = None  # (the clients' models change here: never evaluate a consensus of older ones)
        for update in updates:
            masks = {n: m.to(torch.bool) for n, m in (update.masks or {}).items() if n in self._shapes}
            # sparse: the values at the mask's positions (the trained model is zero elsewhere; see the module doc)
            kept = {n: (t[masks[n]] if n in masks else t) for n, t in update.state.items()}
            self.set_client_state(loop, update.client_idx, "weights", kept)
            self.set_client_state(loop, update.client_idx, "mask", pack_masks(masks) if masks else {})

    @override
    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        return None

    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """The client's last trained model, expanded — on the fits' device where the messages are made there (an
        evaluation then loads it with no copy across the link, and the stored model it crossed from is found there
        by the next round's messages)."""
        store, key = loop.client_store, self.client_state_prefix
        stored = store.stored(client_idx, f"{key}/weights")
        plain, packed = self._moved(store, stored, self.get_client_state(loop, client_idx, "weights"),
                                    self.get_client_state(loop, client_idx, "mask"), message_device(loop))
        return self._expand(plain, unpack_masks(packed, self._shapes) if packed else {})

    def eval_models(self, loop: FederationView) -> dict[str, dict[str, Tensor]]:
        """The evaluation-only models of this evaluation (:func:`pl_fedsparse.evaluation.shared_models`):
        ``{"consensus": consensus_state(loop)}`` with ``consensus_eval``, else none.

        Computed once per evaluation, in the driver (the evaluator asks before any forward pass), and kept until
        ``on_evaluation_end``: every client's forward pass — here or in an executor's worker, which receives it with
        the callbacks — evaluates the same consensus.
        """
        if not self.consensus_eval:
            return {}
        if self._consensus is None:
            self._consensus = consensus_state(loop)
        return {"consensus": self._consensus}

    @override
    def on_evaluation_end(self, loop: FederationView, metrics: dict[str, Any]) -> None:
        self._consensus = None  # a dense model: not kept (nor shipped to workers) between evaluations

    @override
    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        return [("consensus model acc", "consensus_acc")] if self.consensus_eval else []
