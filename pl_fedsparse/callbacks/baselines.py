"""The dense baselines every sparse-PFL paper compares against: Local, FedAvg-FT and Ditto.

FedAvg itself needs no callback: it is the loop's default (sample-weighted averaging of dense models, McMahan et al.
2017, with the global model as every client's model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitSpec, FitStage, current_fit
from pl_fedsparse.errors import check
from pl_fedsparse.functional.aggregation import weighted_average

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

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
    def setup_federation(self, loop: FederationView) -> None:
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))
        loop.drop_global_model()  # no global model (set here, so other callbacks see it from the start)

    @override
    def client_message(self, loop: FederationView, client_idx: int) -> Message | None:
        return None

    @override
    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        return None

    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        return self.get_client_state(loop, client_idx, "weights")

    #: ``on_client_fit_end`` takes the update where the weights are: the weights are stored from where the update is
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        update.message = None  # nothing is uploaded
        if update.kind == "train":
            self.set_client_state(loop, update.client_idx, "weights", update.state)


class FineTune(FederatedCallback):
    """Fine-tune a shared model on every client: FedAvg-FT, and D-PSGD-FT with ``start: consensus``.

    After the last round (and, if ``every`` is set, after every ``every``-th round) each client of the federation
    trains the starting model for ``epochs`` local epochs — fits of kind ``"finetune"``, requested after aggregation;
    the result is what the round's evaluation reports as that client's personal model (it does not feed back into
    training). Between fine-tuning rounds the last fine-tuned model is reported (the method's own personal model
    before the first).

    Args:
        epochs: local epochs of fine-tuning (DisPFL's FedAvg-FT: 5, one ordinary local round).
        every: also fine-tune after every ``every``-th round (DisPFL's D-PSGD-FT: 100, the schedule of its code;
            rounds before the first fine-tuning report the method's own personal models, D-PSGD's for D-PSGD-FT);
            ``None``: only after the last. The fine-tuned models are only evaluated: training is the same either
            way.
        start: ``"global"``: the server's global model, sent to every client (counted as downstream traffic;
            FedAvg-FT). ``"consensus"``: the uniform average of all clients' personal models — what the DisPFL code's
            D-PSGD-FT fine-tunes, although no peer could compute it; not counted as traffic.
        lr: ``"current"``: the current round's learning rate (``lr · lr_decay^t``); ``"reference"``: the DisPFL
            code's, the rate of round −1 (``lr / lr_decay``: its fine-tuning builds a fresh optimizer at the
            initial rate of the decayed schedule) — after 500 rounds at decay 0.998, 0.100 instead of 0.037.

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.FineTune
                  init_args: {epochs: 5, lr: reference}
    """

    def __init__(self, *, epochs: int = 1, every: int | None = None,
                 start: Literal["global", "consensus"] = "global", lr: Literal["current", "reference"] = "current"
                 ) -> None:
        check(isinstance(epochs, int) and epochs >= 1, "FineTune.epochs", epochs, "an int >= 1")
        check(every is None or (isinstance(every, int) and not isinstance(every, bool) and every >= 1),
              "FineTune.every", every, "an int >= 1 or null")
        check(start in ("global", "consensus"), "FineTune.start", start, "one of global, consensus")
        check(lr in ("current", "reference"), "FineTune.lr", lr, "one of current, reference")
        self.epochs = epochs
        self.every = every
        self.start = start
        self.lr = lr

    @property
    def state_key(self) -> str:
        return self._generate_state_key(epochs=self.epochs, every=self.every, start=self.start)

    @override
    def setup_federation(self, loop: FederationView) -> None:
        self.add_client_state(loop, "weights", lambda k: {})  # {} until the client's first fine-tuning

    def _due(self, loop: FederationView) -> bool:
        r = loop.round_idx
        return r == loop.num_rounds - 1 or (self.every is not None and (r + 1) % self.every == 0)

    def _start_state(self, loop: FederationView) -> dict[str, Tensor] | None:
        if self.start == "global":
            return loop.global_state
        states = [loop.personal_state(k) for k in range(loop.num_clients)]
        return weighted_average(states, [1.0] * len(states))

    @override
    def fit_requests(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> list[FitSpec]:
        if stage != "after_aggregate" or not self._due(loop):
            return []
        start = self._start_state(loop)
        if start is None:
            return []
        download = Message(start) if self.start == "global" else None
        lr_round = -1 if self.lr == "reference" else None
        return [FitSpec(k, "finetune", start, epochs=self.epochs, lr_round=lr_round, download=download)
                for k in range(loop.num_clients)]

    @override
    def on_requested_fits_end(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> None:
        for u in updates:
            self.set_client_state(loop, u.client_idx, "weights", u.state)

    @override
    def evaluation_start_is_shared(self, loop: FederationView, kind: str) -> bool:
        return kind != "personal"  # the client's fine-tuned weights replace its personal model

    @override
    def on_client_evaluate_start(self, loop: FederationView, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        tuned = self.get_client_state(loop, client_idx, "weights")
        if kind == "personal" and tuned:
            loop.load_state(tuned)


class Ditto(FederatedCallback):
    """Ditto (Li, Hu, Beirami, Smith, ICML 2021): FedAvg for the global model plus a λ-regularised personal model per
    client.

    Each sampled client first trains the global model as in FedAvg (Alg. 1 lines 4-5, the loop's default fit and
    aggregation), then trains its personal model ``v_k`` for ``personal_epochs`` epochs on
    ``F_k(v_k) + λ/2 · ‖v_k − w^t‖²`` where ``w^t`` is the global model it received this round (lines 6-7; the
    gradient gets ``λ (v_k − w^t)``, added to the unscaled gradient before each optimizer step). The personal fits
    (kind ``"personal"``) are requested before aggregation. The personal model is what is evaluated as "personal";
    it is never uploaded.

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

    #: per-fit state (device copies of w^t, made in on_train_start)
    scratch_attributes = ("_ref_dev",)

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
    def setup_federation(self, loop: FederationView) -> None:
        self.add_client_state(loop, "weights", lambda k: dict(loop.initial_state))

    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        return self.get_client_state(loop, client_idx, "weights")

    @override
    def fit_requests(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> list[FitSpec]:
        if stage != "before_aggregate" or loop.global_state is None:
            return []
        self._ref = loop.global_state  # w^t: the model every participant received this round
        return [FitSpec(u.client_idx, "personal", self.get_client_state(loop, u.client_idx, "weights"),
                        epochs=self.personal_epochs) for u in updates if u.kind == "train"]

    @override
    def on_requested_fits_end(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> None:
        for u in updates:
            self.set_client_state(loop, u.client_idx, "weights", u.state)
        self._ref = {}

    def _is_personal_fit(self) -> bool:
        ctx = current_fit()
        return ctx is not None and ctx.kind == "personal" and ctx.requester == self.state_key

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ref_dev = []  # (also after a fit that failed before on_train_end)
        if self._ref and self._is_personal_fit():
            self._ref_dev = [(p, self._ref[n].to(p.device, p.dtype)) for n, p in pl_module.named_parameters()
                             if n in self._ref]

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # unscaled gradients here (under 16-mixed, on_after_backward still sees them multiplied by the loss scale)
        if not self._ref_dev or self.lam == 0:
            return
        with torch.no_grad():
            for p, ref in self._ref_dev:  # ∇ λ/2 ‖v − w^t‖² = λ (v − w^t)
                if p.grad is not None:
                    p.grad.add_(p - ref, alpha=self.lam)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ref_dev = []

    @override
    def vectorized_fit(self) -> Any:
        """The proximal gradient λ (v − w^t) on stacked personal fits (one reference ``w^t`` for all)."""
        return _VectorizedProximal(self)


class _VectorizedProximal:
    """Ditto's ``on_before_optimizer_step`` over a stacked group of its personal fits."""

    def __init__(self, ditto: Ditto) -> None:
        self.ditto = ditto
        self.ref: dict[str, Tensor] = {}

    def capture(self, index: int, module: pl.LightningModule, context: Any) -> None:
        pass

    def start(self, fit: Any) -> None:
        ctx = fit.contexts[0]  # a group holds one kind of fit from one requester
        mine = ctx.kind == "personal" and ctx.requester == self.ditto.state_key
        ref = self.ditto._ref if mine and self.ditto.lam != 0 else {}
        self.ref = {n: ref[n].to(p.device, p.dtype).unsqueeze(0) for n, p in fit.params.items() if n in ref}

    def before_optimizer_step(self, fit: Any) -> None:
        with torch.no_grad():
            for n, ref in self.ref.items():  # ∇ λ/2 ‖v − w^t‖² = λ (v − w^t); one w^t for every row
                fit.grads[n].add_(fit.params[n] - ref, alpha=self.ditto.lam)

    def after_optimizer_step(self, fit: Any) -> None:
        pass
