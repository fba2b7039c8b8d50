"""The dense baselines every sparse-PFL paper compares against: Local, FedAvg-FT and Ditto.

FedAvg itself needs no callback: it is the loop's default (sample-weighted averaging of dense models, McMahan et al.
2017, with the global model as every client's model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.errors import check
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.metrics import SERVER

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["LocalTraining", "FineTune", "Ditto"]


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


class Ditto(FederatedCallback):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021): FedAvg for the global model plus a λ-regularised personal model per
    client.

    Each sampled client first trains the global model as in FedAvg (Alg. 1 lines 4-5, the loop's default fit and
    aggregation), then trains its personal model ``v_k`` for ``personal_epochs`` epochs on
    ``F_k(v_k) + λ/2 · ‖v_k − w^t‖²`` where ``w^t`` is the global model it received this round (lines 6-7; the
    gradient gets ``λ (v_k − w^t)``). The personal model is what is evaluated as "personal"; it is never uploaded.

    Args:
        lam: λ, the strength of the pull towards the global model (Ditto's CIFAR-10 setting: 0.1; DM-PFL tunes it).
        personal_epochs: epochs of personal training per participation (default ``trainer.local_epochs``).

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.Ditto
                  init_args: {lam: 0.1}
    """

    _STREAM = 19  # random stream of the personal fits

    def __init__(self, *, lam: float = 0.1, personal_epochs: int | None = None) -> None:
        check(isinstance(lam, (int, float)) and not isinstance(lam, bool) and lam >= 0, "Ditto.lam", lam,
              "a number >= 0")
        check(personal_epochs is None or (isinstance(personal_epochs, int) and personal_epochs >= 1),
              "Ditto.personal_epochs", personal_epochs, "an int >= 1 or null")
        self.lam = float(lam)
        self.personal_epochs = personal_epochs
        self._ref: dict[str, Tensor] = {}
        self._ref_dev: list[tuple[Tensor, Tensor]] = []

    @property
    def state_key(self) -> str:
        return self._generate_state_key(lam=self.lam, personal_epochs=self.personal_epochs)

    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))

    @override
    def personal_state(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        return self.get_client_state(loop, client_idx, "weights")

    @override
    def on_before_aggregate(self, loop: FederatedLoop, updates: Sequence[ClientUpdate]) -> None:
        if loop.global_state is None:
            return
        self._ref = loop.global_state  # w^t: the model every participant received this round
        try:
            for u in updates:
                if u.kind != "train":
                    continue
                personal = self.get_client_state(loop, u.client_idx, "weights")
                upd = loop.fit_client(u.client_idx, personal, u.round_idx, epochs=self.personal_epochs,
                                      stream=self._STREAM, kind="personal")
                self.set_client_state(loop, u.client_idx, "weights", upd.state)
        finally:
            self._ref = {}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ref:
            self._ref_dev = [(p, self._ref[n].to(p.device, p.dtype)) for n, p in pl_module.named_parameters()
                             if n in self._ref]

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._ref_dev or self.lam == 0:
            return
        with torch.no_grad():
            for p, ref in self._ref_dev:  # ∇ λ/2 ‖v − w^t‖² = λ (v − w^t)
                if p.grad is not None:
                    p.grad.add_(p - ref, alpha=self.lam)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ref_dev = []
