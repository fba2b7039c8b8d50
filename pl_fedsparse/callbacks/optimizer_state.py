"""Per-client optimizer state across rounds: :class:`KeepOptimizerState`.

Lightning builds a fresh optimizer at every local fit (``configure_optimizers``), so by default momentum buffers
and Adam moments start from zero each round — what the reference code of FedSpa/DisPFL/DM-PFL does. With this
callback each client's optimizer state (not its hyper-parameters: the learning rate still follows the round's
schedule) is saved at the end of its fit into the loop's client-state store and restored at the start of its next
fit, so it is also checkpointed and resumed with the federation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.context import FitContext
from pl_fedsparse.functional.transfer import to_device

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["KeepOptimizerState"]


class KeepOptimizerState(FederatedCallback):
    """Carry each client's optimizer state (momentum, Adam moments) from one of its fits to the next.

    Only a round's local training (fit kind ``"train"``) reads and writes the kept state; fine-tuning and other
    requested fits start from a fresh optimizer, as in the reference code, and do not disturb it.

    Example:
        .. code-block:: yaml

            model: {momentum: 0.9}
            trainer:
              callbacks: [{class_path: pl_fedsparse.callbacks.KeepOptimizerState}]
    """

    #: per-fit state (the optimizer state loaded into the fit and captured at its end: client state)
    scratch_attributes = ("_pending", "_captured")

    def __init__(self) -> None:
        self._pending: dict[str, Tensor] | None = None  # the state to load into this fit's optimizer
        self._captured: dict[str, Tensor] | None = None  # the state at the end of this fit

    @override
    def setup_federation(self, loop: FederationView) -> None:
        self.add_client_state(loop, "state", lambda k: {})

    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        self._pending = self.get_client_state(loop, context.client_idx, "state") if context.kind == "train" else None
        self._captured = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._pending:
            return
        opt = trainer.optimizers[0]
        state: dict[int, dict[str, Tensor]] = {}
        # all buffers to the module's device in one copy (no copy where they are there already)
        moved = to_device(self._pending, pl_module.device)
        for key, value in moved.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = value
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is None:
            return
        state = trainer.optimizers[0].state_dict()["state"]
        # no copy: the buffers are this fit's own (the kept state is loaded from a private copy,
        # ClientStateStore.get) and the optimizer is dropped after the fit; stored from a device, they reach the host
        # with the fit's other entries in one copy when the fit ends (ClientStateStore.flush_writes)
        self._captured = {f"{i}.{name}": v.detach() if isinstance(v, Tensor)
                          else torch.as_tensor(v) for i, entries in state.items() for name, v in entries.items()}

    #: ``on_client_fit_end`` takes the update where the weights are: it stores the optimizer's buffers as they are
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        if self._captured is not None:
            self.set_client_state(loop, update.client_idx, "state", self._captured)
        self._pending = self._captured = None
