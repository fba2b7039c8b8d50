"""FedEM's local fits over a stacked group of fits, for :class:`~pl_fedsparse.executors.VectorizedExecutor`: what
:class:`~pl_fedsparse.callbacks.FedEM` does inside one client's fit (``on_train_start``, the EM forward and loss,
``on_train_end``), done for a round's clients at once.

Every step, for the ``K`` clients of the step together (``vmap`` over the clients, each with its own rows): the
components' logits under the trained weights and under the ones received this round (the E-step's frozen copy,
kept from the group's start), the responsibilities ``q`` from the client's own mixture weights π (Alg. 1's E-step,
:func:`~pl_fedsparse.functional.mixture.e_step`) and the responsibility-weighted loss of the components (the M-step,
:func:`~pl_fedsparse.functional.mixture.weighted_nll`), whose gradients go back to the executor, which clips and
steps the components as for any module (the learning rates scaled by the milestones' factor, as ``on_train_start``
scales them). Each client's ``q`` sums over its batches and its sample count are kept per row and handed to its
``on_client_fit_end`` as the new π (the mean ``q``) — so the update, its bytes and its FLOPs are the callback's own
code's. Under ``bf16-mixed`` the forward and the loss run under autocast, as Lightning runs ``training_step``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from pl_fedsparse.context import FitContext
from pl_fedsparse.executors.hooks import VectorizedFitHooks
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.mixture import component_log_likelihood, e_step, weighted_nll

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from pl_fedsparse.callbacks.fedem import FedEM
    from pl_fedsparse.executors.hooks import StackedFit

__all__ = ["StackedFedEM"]


class _Components(nn.Module):
    """The module's mixture as a module whose ``forward`` is its components' logits ``[B, M, C]`` (what
    :func:`torch.func.functional_call` can call), the module's tensors under ``module.``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Tensor) -> Tensor:
        return self.module.backbone.component_logits(x)  # type: ignore[union-attr, operator]


class StackedFedEM(VectorizedFitHooks):
    """:class:`~pl_fedsparse.executors.VectorizedFitHooks` of FedEM's EM fit (see the module)."""

    def __init__(self, callback: FedEM) -> None:
        from pl_fedsparse.callbacks.fedem import WEIGHTS

        self.cb, self.weights_key = callback, WEIGHTS
        self.active: dict[int, bool] = {}  # client row -> a round's training fit (the EM fit)
        self.factor: dict[int, float] = {}  # client row -> the milestones' learning-rate factor
        self.smoothing = 0.0
        self.components: _Components | None = None
        self.received: dict[str, Tensor] = {}  # the group's start weights: the E-step's components
        self.q_sum: Tensor | None = None  # [K, M]
        self.q_n: list[int] = []
        self.pi = torch.zeros(0)  # [K, M] on the host, after the last step

    def capture(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        ctx = self.cb._ctx  # (set by on_client_fit_start: a round's training fit)
        self.active[index] = ctx is not None
        self.factor[index] = self.cb.lr_factor(ctx.lr_round) if ctx is not None else 1.0
        self.smoothing = float(getattr(module, "label_smoothing", 0.0))
        if self.components is None or self.components.module is not module:
            self.components = _Components(module)

    def start(self, fit: StackedFit) -> None:
        self.received = {n: p.detach().clone() for n, p in fit.params.items()}
        self.q_sum = torch.zeros(len(fit.contexts), self.cb.num_components, dtype=torch.float32, device=fit.device)
        self.q_n = [0] * len(fit.contexts)

    def learning_rates(self, fit: StackedFit, lrs: dict[str, list[float]]) -> None:
        """Every rate times the round's milestone factor (what ``on_train_start`` sets on the optimizer)."""
        for rates in lrs.values():
            for i, factor in self.factor.items():
                if self.active[i] and factor != 1.0:
                    rates[i] = rates[i] * factor

    def gradients(self, fit: StackedFit, params: dict[str, Tensor], fixed: dict[str, Tensor], xs: Tensor, ys: Tensor,
                  rows: list[int]) -> tuple[dict[str, Tensor], Tensor, None] | None:
        """The EM loss's gradients of the step's clients ``rows`` (every one a round's training fit; otherwise the
        module's own loss, ``None``)."""
        if not all(self.active[i] for i in rows):
            return None
        components, key, smoothing = self.components, self.weights_key, self.smoothing
        assert components is not None and self.q_sum is not None
        everyone = rows == list(range(len(fit.contexts)))  # (the usual step: every client's rows, in order)
        at = None if everyone else transfer.host_tensor(rows, xs.device)
        received = self.received if at is None else {n: t.index_select(0, at) for n, t in self.received.items()}
        autocast = fit.precision == "bf16-mixed"

        def loss(p: dict[str, Tensor], f: dict[str, Tensor], r: dict[str, Tensor], x: Tensor,
                 y: Tensor) -> tuple[Tensor, Tensor]:
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = torch.func.functional_call(components, {f"module.{n}": t for n, t in {**p, **f}.items()},
                                                    (x,))
                with torch.no_grad():
                    old = torch.func.functional_call(components, {f"module.{n}": t for n, t in {**r, **f}.items()},
                                                     (x,))
                q = e_step(component_log_likelihood(old.to(logits.dtype), y), f[key])
                return weighted_nll(logits, y, q, smoothing), q.sum(0)

        grads, (losses, q_sums) = torch.func.vmap(torch.func.grad_and_value(loss, has_aux=True))(
            params, fixed, received, xs, ys)
        if at is None:
            self.q_sum.add_(q_sums.detach())
        else:
            self.q_sum.index_add_(0, at, q_sums.detach())
        for i in rows:
            self.q_n[i] += int(ys.shape[1])
        return grads, losses, None

    def end(self, fit: Any) -> None:
        """Every client's new π, the mean of its fit's responsibilities (what ``on_train_end`` computes), brought
        to the host in one copy for the group (one wait, not one per client)."""
        assert self.q_sum is not None
        counts = transfer.host_tensor(self.q_n, self.q_sum.device, torch.float32).view(-1, 1)
        self.pi = (self.q_sum / counts).to("cpu", torch.float32)  # (a row without samples is never read)
        self.received = {}

    def finish(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        """The client's new π (what ``on_train_end`` captures)."""
        if self.active.get(index) and self.q_n[index] > 0:
            self.cb._captured = self.pi[index].clone()
