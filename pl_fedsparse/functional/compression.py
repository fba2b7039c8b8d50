"""Update compression of FedPSE's two baselines. Pure functions: tensors in, tensors out.

* **FedSTC** (Sattler, Wiedemann, Müller, Samek, "Robust and Communication-Efficient Federated Learning from
  Non-i.i.d. Data", IEEE TNNLS 2019/2020, Alg. 1 "STC_p"): keep the top-k entries by magnitude, replace each kept value
  by ``μ · sign(value)`` with ``μ`` the mean magnitude of the kept values — a ternary tensor ``{−μ, 0, μ}`` that travels
  as one float, one sign bit per kept entry and the positions (:func:`ternarize`).
* **FedSCR** (Wu, Yao, Wang, "FedSCR: Structure-based Communication Reduction for Federated Learning", IEEE TPDS
  32(7) 2021): sum the update's magnitudes over each filter (dim 0: a conv filter, a linear layer's output row) and
  over each channel (dim 1: a conv input channel, a linear layer's input column); drop every filter and every channel
  whose sum is below a threshold (:func:`structured_mask`). FedSCR uses one absolute threshold; the FedPSE comparison
  fixes the share sent instead (p = 0.9 for every method), so the threshold may also be chosen per tensor as the
  smallest one that keeps at most ``(1 − p)`` of the entries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pl_fedsparse.errors import check

__all__ = ["ternarize", "structured_mask"]


def ternarize(x: Tensor) -> Tensor:
    """STC's quantisation of a sparse tensor (Sattler et al., Alg. 1 lines 4-6): ``μ · sign(x)`` on the non-zeros of
    ``x``, with ``μ`` the mean magnitude of those non-zeros (zeros stay zero; an all-zero tensor stays all-zero).

    Example:
        >>> ternarize(torch.tensor([0.0, -3.0, 1.0, 0.0]))
        tensor([ 0., -2.,  2.,  0.])
    """
    nz = x != 0
    if not bool(nz.any()):
        return torch.zeros_like(x)
    mu = x[nz].abs().float().mean().to(x.dtype)
    return torch.sign(x) * mu


def _structure_sums(x: Tensor) -> tuple[Tensor, Tensor]:
    a = x.detach().abs().float()
    rows = a.sum(dim=tuple(d for d in range(a.dim()) if d != 0))
    cols = a.sum(dim=tuple(d for d in range(a.dim()) if d != 1))
    return rows, cols


def _mask_at(rows: Tensor, cols: Tensor, tau: float, shape: torch.Size) -> Tensor:
    keep = (rows >= tau)[:, None] & (cols >= tau)[None, :]
    return keep.reshape(keep.shape + (1,) * (len(shape) - 2)).expand(shape)


def structured_mask(x: Tensor, *, threshold: float | None = None, sparsity: float | None = None) -> Tensor:
    """FedSCR's keep-mask of an update tensor with at least two dimensions: an entry is kept when both its filter's
    (dim 0) and its channel's (dim 1) summed magnitude reach the threshold.

    Args:
        x: the update (``ΔW + residual``), shape ``(out, in, ...)``.
        threshold: FedSCR's absolute threshold on the summed magnitudes.
        sparsity: instead of ``threshold``: the smallest threshold (among the structure sums) that keeps at most
            ``round((1 − p) · numel)`` entries — the share FedPSE's comparison fixes (p = 0.9 keeps ≤ 10 %); when even
            the largest sum keeps more, that one is used (one filter × one channel).

    Example:
        >>> x = torch.tensor([[1.0, 0.1, 2.0], [0.1, 0.1, 0.1]])
        >>> structured_mask(x, threshold=0.5).int().tolist()  # row sums 3.1, 0.3; column sums 1.1, 0.2, 2.1
        [[1, 0, 1], [0, 0, 0]]
        >>> structured_mask(x, sparsity=0.8).int().tolist()   # keep at most round(0.2 * 6) = 1 entry
        [[0, 0, 1], [0, 0, 0]]
    """
    check(x.dim() >= 2, "x.dim()", x.dim(), "at least 2 (filters x channels x ...)")
    check((threshold is None) != (sparsity is None), "threshold/sparsity", (threshold, sparsity),
          "exactly one of them")
    rows, cols = _structure_sums(x)
    if threshold is not None:
        check(threshold >= 0, "threshold", threshold, "a number >= 0")
        return _mask_at(rows, cols, float(threshold), x.shape)
    assert sparsity is not None
    check(0.0 <= sparsity < 1.0, "sparsity", sparsity, "a number in [0, 1) (p = 0.9 keeps 10 %)")
    budget = int(round((1.0 - sparsity) * x.numel()))
    candidates = torch.unique(torch.cat([rows, cols]))  # sorted ascending; kept(τ) falls as τ grows
    sorted_rows, sorted_cols = torch.sort(rows).values, torch.sort(cols).values

    def kept(tau: Tensor) -> int:
        n_rows = rows.numel() - int(torch.searchsorted(sorted_rows, tau))
        n_cols = cols.numel() - int(torch.searchsorted(sorted_cols, tau))
        return n_rows * n_cols * (x.numel() // (rows.numel() * cols.numel()))

    lo, hi = 0, candidates.numel() - 1  # smallest index with kept <= budget (hi if none)
    while lo < hi:
        mid = (lo + hi) // 2
        if kept(candidates[mid]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return _mask_at(rows, cols, float(candidates[lo]), x.shape)
