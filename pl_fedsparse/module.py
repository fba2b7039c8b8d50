"""The working :class:`~lightning.pytorch.LightningModule` that every client's local fit runs.

One instance is shared by all clients: the loop loads a client's weights into it, Lightning fits it, and the loop
copies the result out. The module therefore holds no per-client state of its own; what a method needs per client is
declared on its callbacks and kept by the loop's client-state store.
"""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pl_fedsparse.context import current_fit
from pl_fedsparse.errors import check
from pl_fedsparse.executors.compiling import graph_outputs_reused
from pl_fedsparse.metrics import StepLosses

__all__ = ["FederatedModule"]


class FederatedModule(pl.LightningModule):
    """A classifier trained with SGD (or Adam) whose learning rate decays per *round*.

    The optimizer is created afresh at every local fit (``configure_optimizers`` runs on each ``Trainer.fit``), as in
    the reference code of FedSpa/DisPFL/DM-PFL; the learning rate of round ``t`` is ``lr · lr_decay ** t``
    (DisPFL/FedSpa: 0.1 · 0.998^t).

    Args:
        backbone: the network (see :mod:`pl_fedsparse.models`).
        optimizer: ``"sgd"`` or ``"adam"``.
        lr: learning rate at round 0.
        lr_decay: multiplicative decay per round.
        momentum: SGD momentum (the papers' code uses 0).
        weight_decay: L2 penalty inside the optimizer.
        label_smoothing: passed to the cross-entropy loss.

    Example:
        .. code-block:: yaml

            model:
              backbone: {class_path: pl_fedsparse.models.LeNetCIFAR, init_args: {num_classes: 10}}
              lr: 0.1
              lr_decay: 0.998
              weight_decay: 5.0e-4
    """

    def __init__(
        self,
        backbone: nn.Module,
        *,
        optimizer: Literal["sgd", "adam"] = "sgd",
        lr: float = 0.01,
        lr_decay: float = 1.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        label_smoothing: float = 0.0,
    ) -> None:
        super().__init__()
        check(isinstance(backbone, nn.Module), "model.backbone", backbone, "a torch.nn.Module")
        check(optimizer in ("sgd", "adam"), "model.optimizer", optimizer, "one of sgd, adam")
        check(lr > 0, "model.lr", lr, "a number > 0")
        check(0 < lr_decay <= 1, "model.lr_decay", lr_decay, "a number in (0, 1]")
        check(0 <= momentum < 1, "model.momentum", momentum, "a number in [0, 1)")
        check(weight_decay >= 0, "model.weight_decay", weight_decay, "a number >= 0")
        check(0 <= label_smoothing < 1, "model.label_smoothing", label_smoothing, "a number in [0, 1)")
        self.backbone = backbone
        self.optimizer_name = optimizer
        self.lr = lr
        self.lr_decay = lr_decay
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.label_smoothing = label_smoothing
        #: the round whose learning rate is used outside a federated fit (inside one, the fit's context decides)
        self.round_idx = 0
        #: the fit's per-step losses, summed when it ends (fit_metrics): no operator per step for the record
        self._step_losses = StepLosses()

    def forward(self, x: Tensor) -> Tensor:
        return self.backbone(x)

    def current_lr(self) -> float:
        """Learning rate of the running fit: ``lr · lr_decay ** r`` with ``r`` the fit's ``lr_round``
        (:func:`~pl_fedsparse.context.current_fit`; normally its round), or :attr:`round_idx` outside a fit."""
        ctx = current_fit()
        r = ctx.lr_round if ctx is not None else self.round_idx
        return self.lr * self.lr_decay**r

    def loss(self, logits: Tensor, y: Tensor) -> Tensor:
        """The training loss (cross-entropy); override to change it."""
        return F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)

    def on_fit_start(self) -> None:
        self._step_losses.reset()
        # compiled to CUDA graphs, a step's loss is overwritten by the next step's: the fit keeps copies
        self._step_losses.copy = graph_outputs_reused(self)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = self.loss(self(x), y)
        # kept where it is (no host sync, no operator per step), summed once the fit ends
        self._step_losses.add(loss, int(y.shape[0]))
        return loss

    def fit_metrics(self) -> dict[str, float]:
        """Mean training loss and number of samples processed by the last fit."""
        return self._step_losses.metrics()

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adam":
            return torch.optim.Adam(params, lr=self.current_lr(), weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=self.current_lr(), momentum=self.momentum, weight_decay=self.weight_decay)
