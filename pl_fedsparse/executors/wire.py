"""The wire format between the driver and its fit workers: tensor trees with boolean masks bit-packed
(:func:`pack_tree` / :func:`unpack_tree`), sparse messages sent as their kept values, client updates packed for the
trip back, and a fit request whose start tensors that *are* the global state's are named rather than sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.executors.base import FitRequest
from pl_fedsparse.functional.sparse import expand_values

__all__ = ["pack_tree", "unpack_tree"]


# ------------------------------------------------------------------------------------------------ allocator
# ------------------------------------------------------------------------------------------------ compact tensors
@dataclass
class _Packed:
    """A boolean tensor as bits (``np.packbits``): 1/8 of its bytes on the wire."""

    bits: np.ndarray
    shape: tuple[int, ...]

    def unpack(self) -> Tensor:
        n = int(np.prod(self.shape)) if self.shape else 1
        return torch.from_numpy(np.unpackbits(self.bits, count=n).astype(bool)).reshape(self.shape)


def pack_tree(value: Any) -> Any:
    """``value`` with every boolean tensor (nested in dicts, lists, tuples) bit-packed; :func:`unpack_tree` undoes it.

    Example:
        >>> m = torch.tensor([[True, False, True], [False, False, True]])
        >>> packed = pack_tree({"mask": m, "w": torch.ones(2)})
        >>> bool((unpack_tree(packed)["mask"] == m).all())
        True
    """
    if isinstance(value, Tensor) and value.dtype == torch.bool and value.device.type == "cpu":
        return _Packed(np.packbits(value.contiguous().numpy().reshape(-1)), tuple(value.shape))
    if isinstance(value, dict):
        return {k: pack_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(pack_tree(v) for v in value)
    return value


def unpack_tree(value: Any) -> Any:
    """Inverse of :func:`pack_tree`."""
    if isinstance(value, _Packed):
        return value.unpack()
    if isinstance(value, dict):
        return {k: unpack_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(unpack_tree(v) for v in value)
    return value


@dataclass
class _SparseValues:
    """A message tensor that is zero outside its mask, as the values at the mask's positions."""

    values: Tensor
    shape: tuple[int, ...]


def _sparse_message_tensors(tensors: dict[str, Tensor], masks: Mapping[str, Tensor]) -> dict[str, Any]:
    """Message tensors that are exactly zero outside their (same-name) mask travel as their values at the mask."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        m = masks.get(name)
        if (m is not None and m.dtype == torch.bool and m.shape == t.shape and t.device.type == "cpu"
                and not bool(t[~m].any())):  # (a -0.0 off the mask comes back as +0.0: equal as a value)
            out[name] = _SparseValues(t[m], tuple(t.shape))
        else:
            out[name] = t
    return out


def _dense_message_tensors(tensors: dict[str, Any], masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, t in tensors.items():
        if isinstance(t, _SparseValues):
            t = expand_values(t.values, masks[name])
        out[name] = t
    return out


def _pack_update(update: ClientUpdate) -> ClientUpdate:
    """Boolean tensors bit-packed; message tensors zero outside their mask as values only (undone exactly by
    :func:`_unpack_update`)."""
    if update.message is not None:
        update.message.tensors = _sparse_message_tensors(update.message.tensors, update.message.masks)
        update.message.masks = pack_tree(update.message.masks)
    update.masks = pack_tree(update.masks)
    update.client_state = pack_tree(update.client_state)
    update.extras = pack_tree(update.extras)
    return update


def _unpack_update(update: ClientUpdate) -> ClientUpdate:
    update.masks = unpack_tree(update.masks)
    update.client_state = unpack_tree(update.client_state)
    update.extras = unpack_tree(update.extras)
    if update.message is not None:
        update.message.masks = unpack_tree(update.message.masks)
        update.message.tensors = _dense_message_tensors(update.message.tensors, update.message.masks)
    return update


@dataclass
class _WireRequest:
    """A :class:`~pl_fedsparse.executors.FitRequest` whose start tensors that are the synced global state's tensors
    are sent by name only."""

    request: FitRequest
    from_global: list[str] = field(default_factory=list)


def _to_wire(request: FitRequest, global_state: Mapping[str, Tensor] | None) -> _WireRequest:
    if not global_state:
        return _WireRequest(request)
    shared = [n for n, t in request.start.items() if global_state.get(n) is t]
    if not shared:
        return _WireRequest(request)
    start = {n: t for n, t in request.start.items() if global_state.get(n) is not t}
    return _WireRequest(FitRequest(request.context, start, request.client_state), shared)
