"""FedSpa's server update (Huang et al., "Achieving Personalized Federated Learning with Sparse Local Models", 2022).

Each sampled client k trains ``m_k ⊙ W`` under its mask and returns the sparse update
``U_k = m_k ⊙ W − w_k`` (its masked start minus its trained weights) and its next mask; the server keeps a dense
``W`` and applies **Eq. 4**: ``W ← W − (1/|S_t|) Σ_{k∈S_t} U_k`` — the division is by the number of participants,
not by a per-coordinate count, so a coordinate held by 3 of 10 clients moves by 3/10 of their mean update (the paper
contrasts this with Sub-FedAvg's "average on the intersection"). Clients that were not sampled keep their masks; a
regrown coordinate starts from the dense global value, since the next download is ``m_{k,t+1} ⊙ W``.

FedSpa = this aggregation + :class:`~pl_fedsparse.callbacks.GradientRegrow` (DST: ERK, same initial mask, cosine
prune rate from α₀ = 0.5) or + a static :class:`~pl_fedsparse.callbacks.SparseMask` (RSM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.errors import check

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["FedSpaAggregation"]


class FedSpaAggregation(FederatedCallback):
    """FedSpa's Eq. 4 server update (owns the ``aggregate`` policy).

    Args:
        weighting: ``"participants"`` (Eq. 4: ``1/|S_t|``) or ``"samples"`` (each ``U_k`` weighted by its client's
            share of the round's training samples; with all-ones masks this is exactly FedAvg).

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.GradientRegrow
                  init_args: {density: 0.5, distribution: erk, alpha0: 0.5}
                - class_path: pl_fedsparse.callbacks.FedSpaAggregation
    """

    def __init__(self, *, weighting: Literal["participants", "samples"] = "participants") -> None:
        check(weighting in ("participants", "samples"), "FedSpaAggregation.weighting", weighting,
              "one of participants, samples")
        self.weighting = weighting

    #: ``aggregate`` runs on the fits' device where they run on one (float64 there too; the same arithmetic)
    device_aggregate = True

    @override
    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        glob = loop.global_state
        if glob is None or not updates:
            return glob
        total = sum(u.n_samples for u in updates)
        new: dict[str, Tensor] = {}
        for name, w in glob.items():
            if not w.is_floating_point():
                new[name] = w
                continue
            step = torch.zeros_like(w, dtype=torch.float64)
            for u in updates:
                m = (u.masks or {}).get(name)
                start = w if m is None else w * m.to(w.dtype)
                coef = 1.0 / len(updates) if self.weighting == "participants" else u.n_samples / total
                step.add_((start - u.state[name]).double(), alpha=coef)  # U_k = m_k ⊙ W − w_k
            new[name] = (w.double() - step).to(w.dtype)
        return new
