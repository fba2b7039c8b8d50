"""The in-fit hook protocol: which Lightning hooks run inside a local fit, and the vectorised form
(:class:`VectorizedFitHooks` over a :class:`StackedFit`) a callback gives for them so that
:class:`~pl_fedsparse.executors.vectorized.VectorizedExecutor` can train many clients at once.

A small, low module: callbacks import it without importing any executor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from pl_fedsparse.context import FitContext

__all__ = ["IN_FIT_HOOKS", "StackedFit", "VectorizedFitHooks", "in_fit_hooks"]

#: Lightning callback hooks that run inside a local fit: a callback overriding any of them must say what it does to a
#: stacked fit (``vectorized_fit``)
IN_FIT_HOOKS: tuple[str, ...] = (
    "setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
    "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_backward", "on_after_backward",
    "on_before_optimizer_step", "on_before_zero_grad",
)


def in_fit_hooks(callback: Any) -> list[str]:
    """The in-fit Lightning hooks (:data:`IN_FIT_HOOKS`) ``callback``'s class overrides.

    Example:
        >>> class Clip(pl.Callback):
        ...     def on_before_optimizer_step(self, trainer, pl_module, optimizer): ...
        >>> in_fit_hooks(Clip())
        ['on_before_optimizer_step']
    """
    return [h for h in IN_FIT_HOOKS if getattr(type(callback), h, None) is not getattr(pl.Callback, h, None)]


@dataclass
class StackedFit:
    """A group of fits trained together, as the vectorised hooks see it.

    Attributes:
        contexts: the fits' contexts, in stacking order (row ``i`` of every tensor is ``contexts[i]``'s client).
        params: trainable parameters by name, stacked ``[K, *shape]`` on the device (updated in place).
        grads: their gradients, same shapes (valid in ``before_optimizer_step``; none for a tensor frozen in every
            row of the step, see ``frozen_rows``).
        device: where the stacked tensors live.
        rows: during a step, which clients ``params`` and ``grads`` hold — ``None``: all of them, in order; else
            the indices (into ``contexts``) of the clients that still have a batch, ``params`` and ``grads`` holding
            only their rows, in that order. A hook's own per-client tensors are indexed with it
            (``mask.index_select(0, fit.rows)``).
        optimizer_state: the module optimizer's state by parameter name, each entry stacked ``[K, *shape]`` under
            ``torch.optim``'s own key (SGD ``"momentum_buffer"``; Adam ``"exp_avg"``, ``"exp_avg_sq"``) — empty
            until a step makes it, or filled in :meth:`VectorizedFitHooks.start` to continue an earlier fit's (with
            SGD, a bool ``"fresh"`` row flag ``[K]`` marks the rows that have no buffer yet: their first step takes
            the gradient itself, as ``torch.optim.SGD`` does).
        optimizer_index: each trained parameter's index in ``torch.optim``'s ``state_dict()["state"]`` of the
            client's optimizer (``"0.momentum_buffer"`` is parameter 0's buffer).
        steps: ``[K]`` int64 on the host, every client's optimizer steps so far (Adam's bias corrections count from
            it: set it in ``start`` to continue an earlier fit's count).
        tensor_steps: Adam's step counts per trained tensor, ``{name: [K] int64 on the host}``, where they differ
            from ``steps`` — ``torch.optim.Adam`` counts each parameter's own steps, and a tensor frozen in some rows
            (``frozen_rows``) takes none there. ``None`` while every tensor steps with its client; the executor
            makes them at the first step that freezes a tensor in some rows, or a hook sets them in ``start`` to
            continue an earlier fit's counts (they then take the place of ``steps`` for the bias corrections).
        precision: the run's ``trainer.precision`` (``"32-true"`` or ``"bf16-mixed"``).
        step_state: during a step, the optimizer state of the rows ``params`` holds (the same dictionaries as
            ``optimizer_state`` while every client steps; else copies of those rows, written back after
            :meth:`VectorizedFitHooks.after_optimizer_step`); an entry the step creates appears here.
        clients: during a step, the clients of ``params``' rows (indices into ``contexts``), in row order (what
            ``rows`` holds, on the host).
        epochs: during a step, the epoch (from 0) each of ``params``' rows takes its batch from, in row order.
        batch_sizes: during a step, each row's batch size, in row order.
        no_grad: during a step, what the forms' ``frozen_rows`` returned: per trained tensor's name, per row, ``True``
            where that client has no gradient for it at this step (a parameter frozen in process): left out of
            gradient clipping's per-client norm, as ``clip_grad_norm_`` leaves it out.
        optimizer: the optimizer's kind, ``"sgd"`` or ``"adam"``.
    """

    contexts: list[FitContext]
    params: dict[str, Tensor]
    grads: dict[str, Tensor] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    rows: Tensor | None = None
    optimizer_state: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    optimizer_index: dict[str, int] = field(default_factory=dict)
    steps: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    tensor_steps: dict[str, Tensor] | None = None
    precision: str = "32-true"
    step_state: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    clients: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    no_grad: dict[str, list[bool]] = field(default_factory=dict)
    optimizer: str = "sgd"


class VectorizedFitHooks:
    """What a callback does inside a fit, over a stacked group of fits (all of one kind and one requester).

    A callback whose Lightning in-fit hooks matter returns one of these from ``vectorized_fit()``. The executor calls
    :meth:`capture` right after each client's ``on_client_fit_start`` (the callback's per-fit attributes are that
    client's then), :meth:`start` once the group is stacked, and per step :meth:`before_optimizer_step` (Lightning's
    ``on_before_optimizer_step``: gradients unscaled, before clipping) and :meth:`after_optimizer_step` (Lightning's
    ``on_train_batch_end``); after the last step, :meth:`end` once (everything still stacked), then :meth:`finish`
    for each client right before its ``on_client_fit_end`` (the callback's per-fit attributes are that client's
    again: set what its ``on_train_end`` would have). Every method edits the stacked tensors in place, row ``i`` for
    client ``i`` — or, once some clients have stopped, only the rows of those still training
    (:attr:`StackedFit.rows`). :meth:`end` and :meth:`finish` are optional (the executor calls them where defined).

    More optional members, for a callback that changes the fit itself (pFedGate's gated model does, FedRep's
    alternating epochs do):

    * ``supports(context) -> bool``: ``False`` runs that fit in process instead (e.g. a kind of fit the form does
      not stack);
    * ``frozen_rows(fit) -> {name: [bool per row]}``: per step, before the gradients (``fit.clients``, ``fit.epochs``,
      ``fit.batch_sizes`` set), the trained tensors some of the step's clients have frozen (no gradient in process):
      they are left out of gradient clipping's norm for those rows (``fit.no_grad``), and a tensor frozen in every row
      is neither differentiated nor stepped (as autograd and ``torch.optim`` skip a parameter without a gradient;
      ``fit.grads`` then has no entry for it). Rows frozen in a tensor that others train are the form's to put back
      after the step (FedRep's form does); with Adam their step counts do not move (``StackedFit.tensor_steps``);
    * an attribute ``optimizers``: the optimizer kinds the form takes (e.g. ``("sgd",)``); with another, the executor
      refuses the run in one line when the federation starts (or runs every fit in process, ``unsupported:
      sequential``);
    * ``learning_rates(fit, lrs)``: after :meth:`start`, edit each client's module learning rates in place
      (``lrs[name][i]``: what the callback's ``on_train_start`` would set on the optimizer);
    * ``gradients(fit, params, fixed, xs, ys, rows)``: compute a step's gradients itself — ``params`` the trained
      parameters of clients ``rows`` (indices into ``fit.contexts``) stacked ``[k, ...]``, ``fixed`` their other
      tensors, ``xs``/``ys`` their batches ``[k, B, ...]`` — and return ``(grads, losses, skip)``: the gradients of
      ``params`` by name, the losses ``[k]`` and, per row, whether that client makes no optimizer step at this batch
      (or ``None``); or return ``None`` for the executor's own ``loss(forward(x), y)``. At most one callback may.
      With an attribute ``ragged`` true after :meth:`start` the form also takes clients whose batches differ in size
      in one step (and must then return their gradients, not ``None``): ``xs``/``ys`` padded after each client's own samples (with copies of its first one) to the longest, and
      ``gradients(..., sizes=[...])`` given every row's own size (without it, such clients are stepped in sub-groups
      of one size each — a client's last, shorter batch alone).
    """

    def capture(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        """Client ``index``'s fit has started (its start weights are in ``module``)."""

    def start(self, fit: StackedFit) -> None:
        """The group is stacked (``fit.params`` hold every client's start weights)."""

    def before_optimizer_step(self, fit: StackedFit) -> None:
        """Edit ``fit.grads`` (e.g. mask them, add a proximal term)."""

    def after_optimizer_step(self, fit: StackedFit) -> None:
        """Edit ``fit.params`` after the optimizer step (e.g. re-apply masks)."""

    def end(self, fit: StackedFit) -> None:
        """The group's last step is done (``fit.params``, ``fit.optimizer_state`` and ``fit.steps`` hold every
        client's final rows)."""

    def finish(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        """Client ``index``'s fit is about to end (its ``on_client_fit_end`` comes next)."""
