"""Aggregation rules over client tensors.

One kernel, :func:`masked_weighted_average`, serves every method: FedAvg is the all-ones-mask case (McMahan et al.
2017, sample-weighted mean); DM-PFL's Eq. 5 and FedPSE's element-wise aggregation (EWA, Alg. 2) weight each
coordinate by the clients that hold it; DisPFL's gossip (Alg. 1 line 7) is the same rule with unit weights over a
client's neighbourhood. Write new rules on top of this kernel rather than beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["masked_weighted_average", "weighted_average"]


def masked_weighted_average(
    values: Sequence[Tensor],
    weights: Sequence[float] | Tensor,
    masks: Sequence[Tensor | None] | None = None,
    fallback: Tensor | None = None,
) -> Tensor:
    """Per-coordinate weighted mean over the clients that hold each coordinate.

    ``out[i] = Σ_k w_k · m_k[i] · v_k[i] / Σ_k w_k · m_k[i]``; where no client holds ``i`` (denominator 0) the result
    is ``fallback[i]`` (or 0 without a fallback). A ``None`` mask means the client holds every coordinate.

    Args:
        values: one tensor per client, all of the same shape.
        weights: one non-negative weight per client (e.g. its number of samples).
        masks: optional 0/1 or bool tensors of the same shape, one per client.
        fallback: value for coordinates held by nobody (DM-PFL Eq. 5 keeps the old global value).

    Returns:
        The aggregated tensor, float32 (or the values' floating dtype), on the values' device.

    Example:
        >>> v = [torch.tensor([1., 2., 3.]), torch.tensor([3., 4., 5.])]
        >>> masked_weighted_average(v, [1.0, 3.0])
        tensor([2.5000, 3.5000, 4.5000])
        >>> m = [torch.tensor([1, 1, 0]), torch.tensor([0, 1, 0])]
        >>> masked_weighted_average(v, [1.0, 3.0], m, fallback=torch.tensor([9., 9., 9.]))
        tensor([1.0000, 3.5000, 9.0000])
    """
    if len(values) == 0:
        raise ValueError("masked_weighted_average needs at least one tensor")
    w = torch.as_tensor(weights, dtype=torch.float64)
    if w.numel() != len(values):
        raise ValueError(f"got {len(values)} tensors but {w.numel()} weights")
    dtype = values[0].dtype if values[0].is_floating_point() else torch.float32
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    num = torch.zeros(values[0].shape, dtype=acc_dtype, device=values[0].device)
    if masks is None or all(m is None for m in masks):
        total = float(w.sum())
        if total <= 0:
            raise ValueError("weights must sum to a positive number")
        for v, wk in zip(values, w.tolist()):
            num.add_(v.to(acc_dtype), alpha=wk / total)
        return num.to(dtype)
    den = torch.zeros_like(num)
    for v, wk, m in zip(values, w.tolist(), masks):
        if m is None:
            num.add_(v.to(acc_dtype), alpha=wk)
            den.add_(wk)
        else:
            mf = m.to(acc_dtype)
            num.addcmul_(v.to(acc_dtype), mf, value=wk)
            den.add_(mf, alpha=wk)
    held = den > 0
    out = torch.where(held, num / den.clamp_min(torch.finfo(acc_dtype).tiny), torch.zeros_like(num))
    if fallback is not None:
        out = torch.where(held, out, fallback.to(acc_dtype))
    return out.to(dtype)


def weighted_average(
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    masks: Sequence[Mapping[str, Tensor] | None] | None = None,
    fallback: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """Apply :func:`masked_weighted_average` to every entry of a list of state dicts.

    Non-floating entries (integer buffers such as BatchNorm's ``num_batches_tracked``) are taken from the first state.

    Args:
        states: one state dict per client, all with the same keys.
        weights: one weight per client.
        masks: optional per-client dicts of masks; a missing key means "holds every coordinate".
        fallback: optional state used where no client holds a coordinate.

    Returns:
        A new state dict.

    Example:
        >>> s = [{"w": torch.tensor([0., 2.])}, {"w": torch.tensor([2., 4.])}]
        >>> weighted_average(s, [1, 1])["w"]
        tensor([1., 3.])
    """
    out: dict[str, Tensor] = {}
    for key, first in states[0].items():
        if not first.is_floating_point():
            out[key] = first.clone()
            continue
        ms = None if masks is None else [None if m is None else m.get(key) for m in masks]
        fb = None if fallback is None else fallback.get(key)
        out[key] = masked_weighted_average([s[key] for s in states], weights, ms, fb)
    return out
