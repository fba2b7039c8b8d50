"""The dense baselines every sparse-PFL paper compares against: Local and FedAvg-FT.

FedAvg itself needs no callback: it is the loop's default (sample-weighted averaging of dense models, McMahan et al.
2017, with the global model as every client's model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import lightning.pytorch as pl
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.errors import check
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.metrics import SERVER

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["LocalTraining", "FineTune"]


class LocalTraining(FederatedCallback):
    """Local: every client trains its own model on its own data; nothing is communicated and there is no global
    model. All clients start from the same initial weights (one shared initialisation, as in the DisPFL code).

    Which clients train each round follows ``trainer.join_ratio`` (DisPFL's Local: all clients; FedSpa's: 10 %).

    Example:
        .. code-block:: yaml

            trainer:
              join_ratio: 1.0
              callbacks: [{class_path: pl_fedsparse.callbacks.LocalTraining}]
    """

    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))

    @override
    def on_federation_start(self, loop: FederatedLoop) -> None:
        loop.global_state = None

    @override
    def client_message(self, loop: FederatedLoop, client_idx: int) -> Message | None:
        return None

    @override
    def aggregate(self, loop: FederatedLoop, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        return None

    @override
    def personal_state(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        return self.get_client_state(loop, client_idx, "weights")

    @override
    def on_client_fit_end(self, loop: FederatedLoop, module: pl.LightningModule, update: ClientUpdate) -> None:
        update.message = None  # nothing is uploaded
        if update.kind == "train":
            self.set_client_state(loop, update.client_idx, "weights", update.state)


class FineTune(FederatedCallback):
    """Fine-tune a shared model on every client: FedAvg-FT, and D-PSGD-FT with ``start: consensus``.

    After the last round (and, if ``every`` is set, after every ``every``-th round) each client of the federation
    trains the starting model for ``epochs`` local epochs; the result is what the round's evaluation reports as that
    client's personal model (it does not feed back into training). Between fine-tuning rounds the last fine-tuned
    model is reported (the method's own personal model before the first). The learning rate is the current round's
    (the DisPFL code uses ``lr / lr_decay``, i.e. round -1).

    Args:
        epochs: local epochs of fine-tuning (DisPFL's FedAvg-FT: 5, one ordinary local round).
        every: also fine-tune after every ``every``-th round (DisPFL's D-PSGD-FT: 100); ``None``: only after the last.
        start: ``"global"``: the server's global model, sent to every client (counted as downstream traffic;
            FedAvg-FT). ``"consensus"``: the uniform average of all clients' personal models — what the DisPFL code's
            D-PSGD-FT fine-tunes, although no peer could compute it; not counted as traffic.

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.FineTune
                  init_args: {epochs: 5}
    """

    _STREAM = 7  # random stream id of fine-tuning fits

    def __init__(self, *, epochs: int = 1, every: int | None = None,
                 start: Literal["global", "consensus"] = "global") -> None:
        check(isinstance(epochs, int) and epochs >= 1, "FineTune.epochs", epochs, "an int >= 1")
        check(every is None or every >= 1, "FineTune.every", every, "an int >= 1 or null")
        check(start in ("global", "consensus"), "FineTune.start", start, "one of global, consensus")
        self.epochs = epochs
        self.every = every
        self.start = start

    @property
    def state_key(self) -> str:
        return self._generate_state_key(epochs=self.epochs, every=self.every, start=self.start)

    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))

    def _due(self, loop: FederatedLoop) -> bool:
        r = loop.round_idx
        return r == loop.num_rounds - 1 or (self.every is not None and (r + 1) % self.every == 0)

    def _start_state(self, loop: FederatedLoop) -> dict[str, Tensor] | None:
        if self.start == "global":
            return loop.global_state
        states = [loop.personal_state(k) for k in range(loop.num_clients)]
        return weighted_average(states, [1.0] * len(states))

    @override
    def on_after_aggregate(self, loop: FederatedLoop) -> None:
        if not self._due(loop):
            return
        start = self._start_state(loop)
        if start is None:
            return
        message = Message(start)
        for k in range(loop.num_clients):
            if self.start == "global":
                loop.comm.record(SERVER, k, message.nbytes())
            update = loop.fit_client(k, start, loop.round_idx, epochs=self.epochs, stream=self._STREAM,
                                     kind="finetune")
            self.set_client_state(loop, k, "weights", update.state)

    @override
    def on_client_evaluate_start(self, loop: FederatedLoop, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind == "personal" and self.has_client_state(loop, client_idx, "weights"):
            loop.load_state(self.get_client_state(loop, client_idx, "weights"))
