"""Worked example: FedProx (Li et al., MLSys 2020) as one user callback.

Each client minimises ``F_k(w) + μ/2 · ‖w − w^t‖²`` around the model it started its round from (Alg. 2 line 8 of
the paper's "proximal term"): its gradient gets ``μ (w − w^t)``. The term is added in ``on_before_optimizer_step``,
where the gradients are unscaled also under ``16-mixed``, and only to a round's local training (fit kind
``"train"``) — a fine-tuning or personal fit requested by another callback is left alone. With ``μ = 0`` this is
FedAvg, exactly. From the repository root:

.. code-block:: yaml

    trainer:
      callbacks:
        - class_path: callbacks.fedprox.FedProx
          init_args: {mu: 0.01}

(``configs/synthetic_fedprox.yaml``; tested in ``tests/test_user_callbacks.py``.) ``vectorized_fit`` gives the same term
in the form the ``VectorizedExecutor`` applies to many clients' stacked fits at once.
"""

from __future__ import annotations

from typing import Any

import torch

from pl_fedsparse import FederatedCallback, current_fit
from pl_fedsparse.errors import check
from pl_fedsparse.executors import StackedFit, VectorizedFitHooks


class FedProx(FederatedCallback):
    """FedProx's proximal term on every local training fit.

    Args:
        mu: μ, the strength of the pull towards the round's start model (0 = FedAvg).
    """

    #: per-fit state: the start weights, set in on_train_start (checked by the loop, docs/extending.md)
    scratch_attributes = ("anchor",)

    def __init__(self, *, mu: float = 0.01) -> None:
        check(isinstance(mu, (int, float)) and not isinstance(mu, bool) and mu >= 0, "FedProx.mu", mu, "a number >= 0")
        self.mu = float(mu)
        self.anchor: list[tuple[torch.Tensor, torch.Tensor]] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        ctx = current_fit()
        train = ctx is not None and ctx.kind == "train" and self.mu > 0
        self.anchor = [(p, p.detach().clone()) for p in pl_module.parameters()] if train else []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        with torch.no_grad():
            for p, start in self.anchor:  # ∇ μ/2 ‖w − w^t‖² = μ (w − w^t)
                if p.grad is not None:
                    p.grad.add_(p - start, alpha=self.mu)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.anchor = []

    def vectorized_fit(self) -> VectorizedFitHooks:
        return _StackedProx(self.mu)


class _StackedProx(VectorizedFitHooks):
    """The same proximal term on a stacked group of fits: row ``i`` of every tensor is one client."""

    def __init__(self, mu: float) -> None:
        self.mu = mu
        self.anchor: dict[str, torch.Tensor] = {}

    def start(self, fit: StackedFit) -> None:
        train = fit.contexts[0].kind == "train" and self.mu > 0  # a group holds one kind of fit
        self.anchor = {n: p.detach().clone() for n, p in fit.params.items()} if train else {}

    def before_optimizer_step(self, fit: StackedFit) -> None:
        with torch.no_grad():
            for n, start in self.anchor.items():
                if fit.rows is not None:  # some clients have stopped: only the others' rows are here
                    start = start.index_select(0, fit.rows)
                fit.grads[n].add_(fit.params[n] - start, alpha=self.mu)
