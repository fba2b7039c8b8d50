"""The loop's default policies — what runs when no callback owns a policy (Flower's default strategy idea).

=====================  ========================================================================================
policy                 default
=====================  ========================================================================================
``select_clients``     uniform without replacement (``join_ratio`` / ``clients_per_round``) among the clients the
                       topology has not dropped this round, from the ``sample`` stream of the round (a
                       ``clients_per_round`` above the number of clients takes every client, with one warning)
``client_message``     the dense global model (nothing without one); on the device the fits run on, where they
                       run in this process on an accelerator (:func:`~pl_fedsparse.callbacks.base.message_device`)
``aggregate``          FedAvg: the uploads averaged with the clients' training-sample counts as weights
                       (McMahan et al. 2017)
``personal_state``     the global model (a method without one must own this policy)
``client_masks``       ``None``: the model is dense
=====================  ========================================================================================
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from pl_fedsparse.callbacks.base import message_device
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional.aggregation import weighted_average

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["select_clients", "client_message", "aggregate", "personal_state", "client_masks"]

log = logging.getLogger(__name__)

#: the federations whose ``clients_per_round`` clamp was reported (the policy writes nothing into the loop)
_WARNED_CLAMP: weakref.WeakSet[FederationView] = weakref.WeakSet()


def select_clients(loop: FederationView, round_idx: int, client_ids: Sequence[int]) -> list[int]:
    ids = [k for k in client_ids if k not in loop.topology.dropped(round_idx, len(client_ids), loop.seed)]
    m = loop.clients_per_round or max(1, int(loop.join_ratio * loop.num_clients + 1e-9))
    if loop.clients_per_round and loop.clients_per_round > loop.num_clients and loop not in _WARNED_CLAMP:
        _WARNED_CLAMP.add(loop)  # once per run, not every round
        log.warning("trainer.clients_per_round=%d is more than the %d clients of the federation: every available client "
                    "is selected each round", loop.clients_per_round, loop.num_clients)
    if m >= len(ids):
        return ids
    rng = loop.streams.numpy("sample", round_idx)
    return sorted(ids[int(i)] for i in rng.choice(len(ids), size=m, replace=False))  # (ids, not positions)


def client_message(loop: FederationView, client_idx: int) -> Message | None:
    if loop.global_state is None:
        return None
    device = message_device(loop)
    if device is None:
        return Message(loop.global_state)
    # where the fits run: the global model crosses once a round (kept there, trainer.device_state_budget) and every
    # participant's message starts from that copy (a mask callback then masks it there)
    names = list(loop.global_state)
    return Message(dict(zip(names, loop.client_store.on_device([loop.global_state[n] for n in names], device))))


def aggregate(loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
    sent = [u for u in updates if u.message is not None]
    if loop.global_state is None or not sent:
        return loop.global_state
    merged = weighted_average([u.message.tensors for u in sent], [u.n_samples for u in sent])  # type: ignore[union-attr]
    return {**loop.global_state, **merged}


def personal_state(loop: FederationView, client_idx: int) -> dict[str, Tensor]:
    if loop.global_state is None:
        raise ConfigError("trainer.callbacks is invalid: the method keeps no global model, so a callback must "
                          "own the 'personal_state' policy")
    return loop.global_state


def client_masks(loop: FederationView, client_idx: int) -> dict[str, Tensor] | None:
    return None
