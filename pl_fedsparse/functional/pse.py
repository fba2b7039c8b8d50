"""FedPSE's tensor maths ("FedPSE: Personalized Sparsification with Element-wise Aggregation for Federated
Learning", anonymous ICLR submission): upstream top-k with error feedback (Alg. 1 lines 9-11),
element-wise aggregation (EWA, Alg. 2) and the personalised downstream index selection (DPS, Alg. 3), per tensor as
the paper's example code (App. E, Figs. 9-11) works per layer. Pure functions: tensors in, tensors out.

Choices the paper leaves open, made here (and stated where they apply):

* Top-k keeps ``round((1 − p) · n)`` entries of a tensor with ``n`` entries (``p`` the sparsity ratio: p = 0.9 keeps
  10 %), at least one; ties by ``torch.topk``.
* EWA divides by the summed weights of the clients that sent an element and gives 0 where nobody sent it (the example
  code's ``np.divide`` gives 0/0 = NaN there).
* The correlation distance of a zero vector (a client that sent nothing in a layer) is 0.5 (cosine 0).
* DPS draws ``round(d · (k − k_in))`` of the client's own extra indices and ``round((1 − d) · (k − k_in))`` of the
  server's (Python's round, half to even, as the example code), each capped at what is available; the intersection
  is always kept.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from pl_fedsparse.errors import check

__all__ = ["topk_sparsify", "error_feedback_topk", "elementwise_average", "correlation_distance", "distance_from",
           "personalized_mask", "dps_draws"]


def _keep(n: int, sparsity: float) -> int:
    check(0.0 <= sparsity < 1.0, "sparsity", sparsity, "a number in [0, 1) (p = 0.9 keeps 10 %)")
    return min(n, max(1, int(round((1.0 - sparsity) * n)))) if n else 0


def topk_sparsify(x: Tensor, sparsity: float) -> Tensor:
    """``x`` with all but its ``round((1 − p)·n)`` largest-magnitude entries set to zero (Alg. 1 line 10, "Top-K").

    Example:
        >>> topk_sparsify(torch.tensor([0.1, -3.0, 2.0, 0.5]), 0.5)
        tensor([ 0., -3.,  2.,  0.])
    """
    k = _keep(x.numel(), sparsity)
    out = torch.zeros_like(x)
    if k:
        idx = torch.topk(x.detach().abs().flatten(), k).indices
        out.view(-1)[idx] = x.detach().flatten()[idx]
    return out


def error_feedback_topk(update: Tensor, residual: Tensor, sparsity: float) -> tuple[Tensor, Tensor]:
    """UPS's upload with error feedback (Alg. 1 lines 9-11): ``ΔW = update + e``, send ``Top-K(ΔW)``, keep
    ``e ← ΔW − Top-K(ΔW)``. Returns ``(sent, new_residual)``; ``sent + new_residual == update + residual``.

    Example:
        >>> sent, e = error_feedback_topk(torch.tensor([1.0, 0.2]), torch.tensor([0.0, 0.9]), 0.5)
        >>> sent.tolist(), [round(v, 4) for v in e.tolist()]
        ([0.0, 1.100000023841858], [1.0, 0.0])
    """
    total = update + residual
    sent = topk_sparsify(total, sparsity)
    return sent, total - sent


def elementwise_average(updates: Sequence[Tensor], weights: Sequence[float]) -> Tensor:
    """EWA (Alg. 2): per element, the weighted mean over the clients that sent it (a non-zero value):
    ``Σ nᵢ·ΔŴᵢ ⊘ Σ nᵢ·1[ΔŴᵢ ≠ 0]``, and 0 where nobody sent it. With dense updates this is FedAvg's weighted mean.

    Example (an element sent by all, by two, by one and by no client; weights 1, 1, 2):
        >>> u = [torch.tensor([1.0, 2.0, 0.0, 0.0]), torch.tensor([3.0, 0.0, 0.0, 0.0]),
        ...      torch.tensor([2.0, 5.0, 7.0, 0.0])]
        >>> elementwise_average(u, [1.0, 1.0, 2.0])
        tensor([2., 4., 7., 0.])
    """
    check(len(updates) == len(weights) and len(updates) > 0, "updates", len(updates),
          f"a non-empty list with one weight each ({len(weights)} weights)")
    num = torch.zeros_like(updates[0], dtype=torch.float64)
    den = torch.zeros_like(updates[0], dtype=torch.float64)
    for u, w in zip(updates, weights):
        num.add_(u.double(), alpha=float(w))
        den.add_((u != 0).double(), alpha=float(w))
    out = torch.where(den > 0, num / den.clamp_min(1e-300), torch.zeros_like(num))
    return out.to(updates[0].dtype)


def correlation_distance(a: Tensor, b: Tensor) -> float:
    """DPS's ``d = 0.5 − 0.5 · cos(a, b)`` over the flattened tensors, in [0, 1] (0: same direction, 1: opposite;
    0.5 when either is zero).

    Example:
        >>> correlation_distance(torch.tensor([1.0, 0.0]), torch.tensor([2.0, 0.0])), \\
        ...     correlation_distance(torch.tensor([1.0, 0.0]), torch.tensor([-1.0, 0.0]))
        (0.0, 1.0)
    """
    a64, b64 = a.detach().double().flatten(), b.detach().double().flatten()
    return distance_from(float(a64.norm()), float(b64.norm()), float(a64 @ b64))


def distance_from(na: float, nb: float, dot: float) -> float:
    """:func:`correlation_distance` from the norms of the two tensors and their dot product (float64 values read
    off a device all at once: the same number).

    Example:
        >>> distance_from(1.0, 2.0, -2.0), distance_from(0.0, 1.0, 0.0)
        (1.0, 0.5)
    """
    if na == 0.0 or nb == 0.0:
        return 0.5
    cos = dot / (na * nb)
    return min(1.0, max(0.0, 0.5 - 0.5 * cos))


def personalized_mask(server_mask: Tensor, client_mask: Tensor, distance: float,
                      generator: torch.Generator) -> Tensor:
    """DPS's index selection (Alg. 3 lines 6-14) for one tensor: keep ``M_in = M_s ∩ M_i``; of the remaining
    ``k − k_in`` (``k = |M_s|``) add ``round(d·(k − k_in))`` random indices of ``M_i − M_in`` and
    ``round((1 − d)·(k − k_in))`` of ``M_s − M_in`` (each capped at what exists), drawn with ``generator``.

    Example:
        >>> s = torch.tensor([True, True, True, False, False, False])
        >>> c = torch.tensor([True, False, False, True, True, True])
        >>> g = torch.Generator().manual_seed(0)
        >>> [int(personalized_mask(s, c, d, g).sum()) for d in (0.0, 0.5, 1.0)]  # always k = 3 here
        [3, 3, 3]
        >>> bool(personalized_mask(s, c, 1.0, g)[3:].sum() == 2)  # d = 1: both extras from the client
        True
    """
    check(server_mask.shape == client_mask.shape, "client_mask", tuple(client_mask.shape),
          f"the server mask's shape {tuple(server_mask.shape)}")
    s, c = server_mask.bool().flatten(), client_mask.bool().flatten()
    inter = s & c
    pools = (c & ~inter, s & ~inter)
    draws = dps_draws(int(s.sum()) - int(inter.sum()), [int(p.sum()) for p in pools], distance, generator)
    out = inter.clone()
    for pool, drawn in zip(pools, draws):
        if drawn is not None:
            out[torch.nonzero(pool).flatten()[drawn]] = True
    return out.view(server_mask.shape)


def dps_draws(extra: int, pool_sizes: Sequence[int], distance: float, generator: torch.Generator
              ) -> list[Tensor | None]:
    """The random part of :func:`personalized_mask`, on the host: for the client's pool (``M_i − M_in``) and the
    server's (``M_s − M_in``), in that order, the positions drawn among the pool's entries (in their index order)
    — ``round(d·extra)`` and ``round((1 − d)·extra)``, each capped at the pool's size — or ``None`` when none is
    drawn. From the counts alone, so a device can count its masks, hand the counts over at once and apply the draws
    (the same numbers: the same generator calls).

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> [None if d is None else len(d) for d in dps_draws(4, [1, 10], 0.5, g)]
        [1, 2]
    """
    check(0.0 <= distance <= 1.0 and math.isfinite(distance), "distance", distance, "a number in [0, 1]")
    out: list[Tensor | None] = []
    for size, count in zip(pool_sizes, (round(distance * extra), round((1.0 - distance) * extra))):
        take = min(int(count), int(size))
        out.append(torch.randperm(int(size), generator=generator)[:take] if take else None)
    return out
