"""Fault injection, to test that a federation survives failing clients (``trainer.on_client_fault``).

:class:`FaultInjection` breaks one client's fit in chosen rounds, the way real clients fail: NaN weights (a
diverged or corrupted model), NaN gradients, an infinite value in the upload, an exception (a crashed device), or no
training data. Put it **last** in ``trainer.callbacks`` so that it sees the upload the method built. From the CLI:

.. code-block:: yaml

    trainer:
      on_client_fault: skip          # the default: the faulty update is left out, the round completes
      callbacks:
        - class_path: pl_fedsparse.testing.FaultInjection
          init_args: {client: 3, rounds: [2], kind: nan_weights}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext, current_fit
from pl_fedsparse.errors import check

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["FaultInjection", "FAULT_KINDS"]

FaultKind = Literal["nan_weights", "nan_gradients", "inf_upload", "exception", "empty_data"]
FAULT_KINDS = ("nan_weights", "nan_gradients", "inf_upload", "exception", "empty_data")


class FaultInjection(FederatedCallback):
    """Make ``client``'s local training fit fail in ``rounds``.

    Args:
        client: the client whose fit fails.
        rounds: the rounds in which it fails (0-based).
        kind: ``nan_weights`` (one weight tensor set to NaN at the end of the fit), ``nan_gradients`` (every
            gradient NaN in the first step), ``inf_upload`` (one uploaded tensor +inf), ``exception`` (the fit raises
            in its first step) or ``empty_data`` (the fit skips every batch).
    """

    scratch_attributes = ("injected",)  # a record of this process, not state of the run

    def __init__(self, *, client: int = 0, rounds: list[int] | None = None, kind: FaultKind = "nan_weights") -> None:
        check(isinstance(client, int) and client >= 0, "FaultInjection.client", client, "an int >= 0")
        check(kind in FAULT_KINDS, "FaultInjection.kind", kind, "one of " + ", ".join(FAULT_KINDS))
        self.client = client
        self.rounds = sorted(set(rounds if rounds is not None else [0]))
        self.kind = kind
        self.injected: list[int] = []  #: rounds in which a fault was injected (this process)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(client=self.client, rounds=self.rounds, kind=self.kind)

    def _target(self, ctx: FitContext | None = None) -> bool:
        """Whether ``ctx`` (default: the running fit) is the round's training fit of the faulty client."""
        ctx = ctx if ctx is not None else current_fit()
        return ctx is not None and ctx.kind == "train" and ctx.client_idx == self.client and ctx.round_idx in self.rounds

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.kind == "empty_data" and self._target():
            trainer.limit_train_batches = 0  # the fit sees no training batch, as a client without data

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.kind == "exception" and batch_idx == 0 and self._target():
            self.injected.append(current_fit().round_idx)  # type: ignore[union-attr]
            raise RuntimeError(f"injected fault in client {self.client}")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kind == "nan_gradients" and self._target() and trainer.global_step == 0:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kind == "nan_weights" and self._target():
            with torch.no_grad():
                next(iter(pl_module.parameters())).fill_(float("nan"))

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        if update.context is None or not self._target(update.context):
            return
        if self.kind != "exception":
            self.injected.append(update.round_idx)
        if self.kind == "inf_upload" and update.message is not None:
            tensors = dict(update.message.tensors)
            name = next(n for n, t in tensors.items() if t.is_floating_point())
            tensors[name] = torch.full_like(tensors[name], float("inf"))
            update.message = Message(tensors, dict(update.message.masks))
