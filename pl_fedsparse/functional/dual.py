"""Dual masking maths of DM-PFL (Zhang, Zhou, Wang, Tong, KDD 2023): Eq. 4 composition and the global-mask rule.

Pure tensor functions; :class:`~pl_fedsparse.callbacks.DualMask` holds the state and calls them. Eq. 5 (the
per-coordinate, sample-weighted server average with uncovered positions kept) is
:func:`~pl_fedsparse.functional.aggregation.masked_weighted_average` with ``fallback`` = the old global weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["compose_personal", "mask_coverage", "select_global_mask"]


def compose_personal(w_g: Tensor, m_g: Tensor, w_c: Tensor, m_c: Tensor) -> Tensor:
    """Eq. 4: ``θ_c = w_g ⊙ (m_g ∩ m_c) + w_c ⊙ (m_c − m_g)``.

    Example:
        >>> w_g, w_c = torch.tensor([1., 2., 3., 4.]), torch.tensor([10., 20., 30., 40.])
        >>> m_g, m_c = torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 1, 0])
        >>> compose_personal(w_g, m_g, w_c, m_c)
        tensor([ 1.,  0., 30.,  0.])
    """
    g, c = m_g.bool(), m_c.bool()
    return torch.where(g & c, w_g, torch.where(c, w_c, torch.zeros_like(w_c)))


def mask_coverage(masks: Sequence[Tensor]) -> Tensor:
    """Number of masks holding each position (int32).

    Example:
        >>> mask_coverage([torch.tensor([1, 0, 1]), torch.tensor([1, 0, 0])]).tolist()
        [2, 0, 1]
    """
    cov = torch.zeros(masks[0].shape, dtype=torch.int32, device=masks[0].device)  # (where the masks are)
    for m in masks:
        cov += (m if m.device == cov.device else m.to(cov.device)).to(torch.int32)
    return cov


def select_global_mask(weights: Mapping[str, Tensor], coverage: Mapping[str, Tensor], num_clients: int,
                       counts: Mapping[str, int], threshold: float = 0.3,
                       scope: Literal["layer", "model"] = "layer") -> dict[str, Tensor]:
    """The new global mask (DM-PFL §3.3.2 "Aggregate m_g"): the positions with the largest ``|w_g|``, ignoring
    positions held by no more than ``threshold`` of the ``num_clients`` sampled clients.

    Args:
        weights: aggregated global weights ``w_g`` per masked tensor.
        coverage: per tensor, how many sampled clients' masks hold each position (:func:`mask_coverage`).
        num_clients: number of sampled clients.
        counts: positions to keep per tensor (``round((1 − S) · numel)`` at the tensor's layer density).
        threshold: a position is eligible iff ``coverage > threshold · num_clients`` (the paper's 30 %).
        scope: ``"layer"``: top ``counts[name]`` within each tensor; ``"model"``: top ``Σ counts`` over all
            tensors together (one magnitude threshold for the model).

    Returns:
        bool masks; a tensor with fewer eligible positions than its count keeps only the eligible ones.

    Example:
        >>> w = {"a": torch.tensor([5., 4., 3., 2.])}
        >>> cov = {"a": torch.tensor([1, 3, 3, 2])}   # of 4 clients: 25 %, 75 %, 75 %, 50 %
        >>> select_global_mask(w, cov, num_clients=4, counts={"a": 2})["a"].tolist()
        [False, True, True, False]
    """
    eligible = {}
    for k, w in weights.items():  # (moved only where the coverage is elsewhere: none on the aggregation's device)
        c = coverage[k] if coverage[k].device == w.device else coverage[k].to(w.device)
        eligible[k] = c > threshold * num_clients
    out: dict[str, Tensor] = {}
    # the top ``count`` scores, ineligible positions scored −1, then only the eligible ones kept: the top
    # ``min(count, #eligible)`` of the eligible positions as one set, without reading ``#eligible`` on the host (a
    # wait on a device). Equal to ``topk(min(count, #eligible))``: the eligible scores (≥ 0, or NaN) all rank above −1
    if scope == "layer":
        for k, w in weights.items():
            score = torch.where(eligible[k], w.abs().float(), torch.full_like(w, -1.0, dtype=torch.float32)).flatten()
            out[k] = _top_eligible(score, int(counts[k])).view(w.shape)
        return out
    names = list(weights)
    flat = torch.cat([torch.where(eligible[k], weights[k].abs().float(),
                                  torch.full_like(weights[k], -1.0, dtype=torch.float32)).flatten() for k in names])
    keep = _top_eligible(flat, sum(int(counts[k]) for k in names))
    offset = 0
    for k in names:
        numel = weights[k].numel()
        out[k] = keep[offset:offset + numel].view(weights[k].shape)
        offset += numel
    return out


def _top_eligible(score: Tensor, count: int) -> Tensor:
    """Bool mask of the ``count`` largest of ``score`` (flat; −1 marks the ineligible), the ineligible dropped."""
    keep = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
    count = min(count, score.numel())
    if count > 0:
        idx = torch.topk(score, count, sorted=False).indices
        keep[idx] = ~(score[idx] < 0)  # (NaN, like any eligible score, stays)
    return keep
