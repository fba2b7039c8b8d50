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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.functional.sparse import pack_masks, unpack_masks

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["Gossip"]


class Gossip(FederatedCallback):
    """Peer-to-peer averaging over the topology's neighbours (owns ``client_message``, ``aggregate`` and
    ``personal_state``: there is no global model; a client's personal model is its last trained model).

    Example:
        .. code-block:: yaml

            trainer:
              topology: {class_path: pl_fedsparse.topology.RandomPeers, init_args: {k: 10}}
              callbacks:
                - class_path: pl_fedsparse.callbacks.RandomRegrow      # DisPFL; omit for D-PSGD
                  init_args: {density: 0.5, same_mask: false, mask_personal_eval: false}
                - class_path: pl_fedsparse.callbacks.Gossip
    """

    driver_only_attributes = ("_snapshot", "_decode")  # (client_message runs in the driver)

    def __init__(self) -> None:
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._snapshot: dict[int, tuple[dict[str, Tensor], dict[str, Tensor]]] = {}
        self._decode: Callable[[Any], Any] = lambda value: value

    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        if loop.topology.has_server:
            raise ConfigError(f"trainer.topology={type(loop.topology).__name__} is invalid for Gossip: expected a "
                              "peer topology (pl_fedsparse.topology.Ring, FullyConnected or RandomPeers)")
        self._shapes = {k: tuple(v.shape) for k, v in loop.initial_state.items()}
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))
        # the mask of the last fit, bit-packed ({} = dense); before the first fit, the client's initial mask (from the
        # mask callback's client_masks policy), so round 0 already sends w₀ ⊙ m_k as DisPFL's clients do
        self.add_client_state(loop, "mask", lambda k: pack_masks(loop.client_masks(k) or {}))

    @override
    def on_round_start(self, loop: FederatedLoop, round_idx: int) -> None:
        # references to the stored tensors, as stored (encoded with trainer.client_state_codec: lossless — decoded
        # per message, so the snapshot of every client costs no memory): entries are replaced, never mutated, when
        # clients finish training
        store, key = loop.client_store, self.client_state_prefix
        self._snapshot = {j: (store.stored(j, f"{key}/weights"), store.stored(j, f"{key}/mask"))
                          for j in range(loop.num_clients)}
        self._decode = store.decode

    def _expand(self, weights: dict[str, Tensor], masks: dict[str, Tensor]) -> dict[str, Tensor]:
        """Dense tensors from a stored model: a masked tensor stored as its values at the mask's positions is put
        back in place (zeros elsewhere); tensors stored dense are returned as they are."""
        out = {}
        for name, v in weights.items():
            m = masks.get(name)
            if m is not None and tuple(v.shape) != self._shapes[name]:
                dense = torch.zeros(self._shapes[name], dtype=v.dtype)
                dense[m] = v
                v = dense
            out[name] = v
        return out

    def sender_message(self, client_idx: int) -> Message:
        """What ``client_idx`` sends to a neighbour: its snapshot model, sparse under the mask it trained with."""
        weights, packed = self._snapshot[client_idx]
        masks = unpack_masks(packed, self._shapes) if packed else {}
        return Message(self._expand(self._decode(weights), masks), masks)

    @override
    def client_message(self, loop: FederatedLoop, client_idx: int) -> Message | None:
        topo, r, n = loop.topology, loop.round_idx, loop.num_clients
        own = self.sender_message(client_idx)
        if topo.skips_aggregation(r, client_idx, n, loop.seed):
            return Message(dict(own.tensors))
        neighbours = topo.neighbors(r, client_idx, range(n), loop.seed)
        sent = [self.sender_message(j) for j in neighbours]
        for j, msg in zip(neighbours, sent):
            loop.accounting.send(j, client_idx, msg)
        group = [own, *sent]
        avg = weighted_average([m.tensors for m in group], [1.0] * len(group), [m.masks or None for m in group])
        return Message(avg)

    @override
    def on_before_aggregate(self, loop: FederatedLoop, updates: Sequence[ClientUpdate]) -> None:
        # after every callback's on_client_fit_end, so update.masks is final whatever the callback order; only the
        # round's own fits are here (fine-tuning fits never become a client's gossip model)
        for update in updates:
            masks = {n: m.to(torch.bool) for n, m in (update.masks or {}).items() if n in self._shapes}
            # sparse: the values at the mask's positions (the trained model is zero elsewhere; see the module doc)
            kept = {n: (t[masks[n]] if n in masks else t) for n, t in update.state.items()}
            self.set_client_state(loop, update.client_idx, "weights", kept)
            self.set_client_state(loop, update.client_idx, "mask", pack_masks(masks) if masks else {})

    @override
    def aggregate(self, loop: FederatedLoop, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        return None

    @override
    def personal_state(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        packed = self.get_client_state(loop, client_idx, "mask")
        weights = self.get_client_state(loop, client_idx, "weights")
        return self._expand(weights, unpack_masks(packed, self._shapes) if packed else {})
