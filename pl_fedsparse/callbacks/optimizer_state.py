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

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["KeepOptimizerState"]


class KeepOptimizerState(FederatedCallback):
    """Carry each client's optimizer state (momentum, Adam moments) from one of its fits to the next.

    Example:
        .. code-block:: yaml

            model: {momentum: 0.9}
            trainer:
              callbacks: [{class_path: pl_fedsparse.callbacks.KeepOptimizerState}]
    """

    def __init__(self) -> None:
        self._loop: FederatedLoop | None = None
        self._client: int | None = None

    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        self._loop = loop
        self.add_client_state(loop, "state", lambda k: {})

    @override
    def on_client_fit_start(self, loop: FederatedLoop, module: pl.LightningModule, client_idx: int) -> None:
        self._client = client_idx

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loop is None or self._client is None:
            return
        flat: dict[str, Tensor] = self.get_client_state(self._loop, self._client, "state")
        if not flat:
            return
        opt = trainer.optimizers[0]
        state: dict[int, dict[str, Tensor]] = {}
        for key, value in flat.items():
            idx, name = key.split(".", 1)
            state.setdefault(int(idx), {})[name] = value.to(pl_module.device)
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._loop is None or self._client is None:
            return
        state = trainer.optimizers[0].state_dict()["state"]
        flat = {f"{i}.{name}": v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else torch.as_tensor(v)
                for i, entries in state.items() for name, v in entries.items()}
        self.set_client_state(self._loop, self._client, "state", flat)
        self._client = None
