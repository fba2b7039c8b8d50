"""FedEM in a federation: :class:`FedEM` (Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning
under a Mixture of Distributions", NeurIPS 2021; the authors' code ``omarfoq/FedEM``, which pFedGate's code is
built on and runs its FedEM baseline with).

Every client's distribution is a mixture of ``M`` shared components: ``p_t(y|x) = Σ_m π_{t,m} p_m(y|x)``. The M
component networks are one :class:`~pl_fedsparse.models.Mixture` backbone (``model.backbone``), so the loop's
FedAvg averages each component over the participants (Alg. 1's server step), every message carries the M models
(M × d values up and down) and checkpoints hold them; the mixture weights ``π_t`` are client state, never sent.

A round's local fit of client ``t`` (fits of kind ``"train"``; Alg. 1's client update, the code's
``MixtureClient.step``):

1. **E-step**: responsibilities ``q_t(z_i = m) ∝ π_{t,m} · p_m(y_i | x_i)`` under the components the client received
   (:func:`~pl_fedsparse.functional.mixture.e_step`). The code computes them once per round on the client's
   training data, in eval mode, before training; here a frozen copy of the received components (eval mode) gives
   them batch by batch — the same values, without sample indices (with ``data.augment`` they are computed on the
   augmented batch).
2. **M-step for π**: ``π_{t,m} = (1/n_t) Σ_i q_t(z_i = m)`` — the mean of the fit's responsibilities (every training
   sample once per epoch; the same ``q`` in later epochs). The new π is used from the next round on and for
   evaluation, as in the code.
3. **M-step for the components**: each component ``m`` trains on ``(1/B) Σ_i q_t(z_i = m) · CE(h_{θ_m}(x_i), y_i)``
   (:func:`~pl_fedsparse.functional.mixture.weighted_nll`) for ``trainer.local_epochs`` epochs. One optimizer
   steps all components at once; they share no parameter, so SGD (momentum, weight decay) moves each exactly as
   the code's separate per-learner optimizers — except that the code walks the data once per learner, each with
   its own shuffle, and ``trainer.gradient_clip_val`` would clip the components' joint norm (the code clips
   nothing).

Prediction (``"personal"``): ``Σ_m π_{t,m} softmax(h_{θ_m}(x))`` (:class:`~pl_fedsparse.models.Mixture` with the
client's π loaded: ``personal_state``). The ``"global"`` kind is the uniform mixture.

Traffic and compute: the M components down and up each round (π never); the loop charges training FLOPs of the
whole mixture (M forward + backward per sample) and this callback the E-step's M forwards per training sample.
Learning rate: the FedEM code's ``multi_step`` schedule (×0.1 at T/2 and 3T/4, stepped once per round with one
local epoch) is ``lr_milestones: [0.5, 0.75]``.

Example (``configs/cifar10_fedem.yaml``):
    .. code-block:: yaml

        model:
          backbone:
            class_path: pl_fedsparse.models.Mixture
            init_args:
              backbone: {class_path: pl_fedsparse.models.LeNetCIFAR, init_args: {num_classes: 10}}
              num_components: 3
        trainer:
          callbacks:
            - class_path: pl_fedsparse.callbacks.FedEM
              init_args: {num_components: 3, lr_milestones: [0.5, 0.75]}
"""

from __future__ import annotations

import copy
import functools
import math
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from pl_fedsparse.callbacks.base import (
    FederatedCallback,
    graph_outputs_reused,
    outside_graphs,
    replace_methods,
    restore_methods,
)
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.executors.base import load_state
from pl_fedsparse.functional.mixture import component_log_likelihood, e_step, weighted_nll
from pl_fedsparse.models.mixture import Mixture

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["WEIGHTS", "FedEM"]

#: name of the mixture weights in the LightningModule's state dict (``model.backbone`` is the Mixture)
WEIGHTS = "backbone.mixture_weights"


def _num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class FedEM(FederatedCallback):
    """FedEM: a mixture of ``num_components`` shared models with per-client mixture weights learnt by EM (see the
    module docstring). Needs ``model.backbone`` to be a :class:`~pl_fedsparse.models.Mixture` of as many components.
    Owns the ``personal_state`` policy (the global components with the client's π).

    Args:
        num_components: ``M`` (the paper's and pFedGate's comparison: 3); must equal the Mixture's.
        lr_milestones: fractions of ``trainer.num_rounds`` from which the learning rate is multiplied by another
            ``lr_gamma`` (the FedEM code's ``multi_step``: ``[0.5, 0.75]``); ``null``: none.
        lr_gamma: the factor of each milestone (code: 0.1).

    Example:
        .. code-block:: yaml

            trainer:
              callbacks: [{class_path: pl_fedsparse.callbacks.FedEM, init_args: {num_components: 3}}]
    """

    #: per-fit state (the fit's context, the E-step's snapshot and running sums, the module whose forward and loss are
    #: replaced, the methods installed there and what they shadow); what a fit produces leaves in client state
    #: ("weights") and the update
    scratch_attributes = ("_ctx", "_module", "_mixture", "_snapshot", "_weights", "_q_sum", "_q_n",
                          "_label_smoothing", "_captured", "_bound", "_shadowed", "_sum_outside")

    def __init__(self, *, num_components: int = 3, lr_milestones: list[float] | None = None,
                 lr_gamma: float = 0.1) -> None:
        check(isinstance(num_components, int) and not isinstance(num_components, bool) and num_components >= 1,
              "FedEM.num_components", num_components, "an int >= 1")
        check(lr_milestones is None or (isinstance(lr_milestones, (list, tuple))
                                        and all(_num(f) and 0 < f <= 1 for f in lr_milestones)),
              "FedEM.lr_milestones", lr_milestones, "null or a list of fractions of num_rounds in (0, 1]")
        check(_num(lr_gamma) and 0 < lr_gamma <= 1, "FedEM.lr_gamma", lr_gamma, "a number in (0, 1]")
        self.num_components = num_components
        self.lr_milestones = sorted(float(f) for f in lr_milestones) if lr_milestones else []
        self.lr_gamma = float(lr_gamma)
        #: forward FLOPs of the mixture per sample (the E-step's cost), measured when the federation starts
        self.estep_flops = 0.0
        self._num_rounds = 1
        # per fit
        self._ctx: FitContext | None = None
        self._module: pl.LightningModule | None = None
        self._shadowed: dict[str, Any] = {}
        self._mixture: Mixture | None = None
        self._snapshot: Mixture | None = None
        self._weights: Tensor | None = None
        self._q_sum: Tensor | None = None
        self._q_n = 0
        self._sum_outside = False
        self._label_smoothing = 0.0
        self._captured: Tensor | None = None

    def lr_factor(self, lr_round: int) -> float:
        """``lr_gamma ** (milestones passed)`` at round ``lr_round`` (milestone ``f`` is round ``round(f·T)``)."""
        return self.lr_gamma ** sum(1 for f in self.lr_milestones if lr_round >= round(f * self._num_rounds))

    # ---- set-up -----------------------------------------------------------------------------------------------
    @override
    def setup_federation(self, loop: FederationView) -> None:
        model = loop.model
        assert model is not None
        mixture = getattr(model, "backbone", None)
        if not isinstance(mixture, Mixture):
            what = f"model.backbone={type(mixture).__name__}" if mixture is not None else \
                f"model={type(model).__name__} (no backbone attribute)"
            raise ConfigError(f"{what} is invalid for FedEM: expected a module whose `backbone` is a "
                              "pl_fedsparse.models.Mixture (init_args: {backbone: <the network>, num_components: M}); "
                              "FedEM replaces its forward and loss during training")
        check(mixture.num_components == self.num_components, "FedEM.num_components", self.num_components,
              f"{mixture.num_components}, the number of components of model.backbone (a Mixture)")
        check(callable(getattr(model, "loss", None)), "model", type(model).__name__,
              "a FederatedModule (FedEM replaces its loss during training)")
        self._num_rounds = loop.num_rounds
        x = loop.datamodule.example_input(2)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            model(x.to(mixture.mixture_weights.device))
        self.estep_flops = counter.get_total_flops() / int(x.shape[0])
        self.add_client_state(loop, "weights", lambda k: loop.initial_state[WEIGHTS])  # uniform 1/M

    @override
    def on_federation_start(self, loop: FederationView) -> None:
        if loop.global_state is None:
            raise ConfigError("trainer.topology is invalid for FedEM: expected a server (Star); the components are "
                              "averaged by the server")

    # ---- policies ---------------------------------------------------------------------------------------------
    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        if loop.global_state is None:
            raise ConfigError("trainer.topology is invalid for FedEM: expected a server (Star)")
        return {**loop.global_state, WEIGHTS: self.get_client_state(loop, client_idx, "weights")}

    # ---- messages: the M components travel, π never ----------------------------------------------------------
    @staticmethod
    def _strip(message: Message) -> None:
        # new dicts: the downstream message's tensors are the loop's global state itself
        message.tensors = {n: t for n, t in message.tensors.items() if n != WEIGHTS}
        message.masks = {n: m for n, m in message.masks.items() if n != WEIGHTS}

    @override
    def on_client_message(self, loop: FederationView, client_idx: int, message: Message) -> None:
        self._strip(message)

    # ---- a local fit ------------------------------------------------------------------------------------------
    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        self._uninstall()
        self._ctx = context if context.kind == "train" else None
        self._q_sum, self._q_n, self._captured = None, 0, None
        # every fit of a client runs its own mixture: its π over the received components
        load_state(module, {WEIGHTS: self.get_client_state(loop, context.client_idx, "weights")})

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        mixture = getattr(pl_module, "backbone", None)
        assert isinstance(mixture, Mixture)
        # the E-step's components: the ones received this round, frozen, in eval mode (the code's gather_losses)
        snapshot = copy.deepcopy(mixture).eval()
        snapshot.requires_grad_(False)
        self._mixture, self._snapshot = mixture, snapshot
        self._weights = mixture.mixture_weights.detach().clone()
        self._label_smoothing = float(getattr(pl_module, "label_smoothing", 0.0))
        factor = self.lr_factor(ctx.lr_round)
        if factor != 1.0:  # the code's multi_step scheduler
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = group["lr"] * factor
        # the module's forward and loss become the EM ones for this fit (instance attributes shadow the class's and
        # compiled ones, which come back after it); the same bound methods every fit (replace_methods)
        forward, loss = self.__dict__.setdefault("_bound", (self._em_forward, self._em_loss))
        self._shadowed = replace_methods(pl_module, forward=functools.partial(forward, pl_module), loss=loss)
        self._module = pl_module
        # compiled to CUDA graphs, a step's outputs are overwritten by the next step's: the running sum is made
        # outside the graphs (_em_loss)
        self._sum_outside = graph_outputs_reused(pl_module)

    @override
    def vectorized_fit(self) -> Any:
        """The EM fit for a stacked group of fits (:class:`~pl_fedsparse.callbacks.fedem_stacked.StackedFedEM`)."""
        from pl_fedsparse.callbacks.fedem_stacked import StackedFedEM

        return StackedFedEM(self)

    def _em_forward(self, module: pl.LightningModule, x: Tensor) -> Tensor:
        """``[B, 2, M, C]``: the components' logits (trained) and the received components' (the E-step's)."""
        assert self._mixture is not None and self._snapshot is not None
        logits = self._mixture.component_logits(x)
        with torch.no_grad():
            received = self._snapshot.component_logits(x)
        return torch.stack((logits, received.to(logits.dtype)), dim=1)

    def _em_loss(self, out: Tensor, y: Tensor) -> Tensor:
        """E-step on the batch, then the components' responsibility-weighted loss."""
        assert self._weights is not None
        # the responsibilities are constants of the loss (the received components' logits, made without gradients):
        # detached, so no step's graph reaches back into an earlier one through their running sum (a compiled
        # step's autograd node joins every input to its loss)
        logits, received = out[:, 0], out[:, 1].detach()
        q = e_step(component_log_likelihood(received, y), self._weights.to(out.device))
        batch_sum = q.sum(0)
        if self._sum_outside:
            self._q_sum = outside_graphs(_running_sum, self._q_sum, batch_sum)
        else:
            self._q_sum = batch_sum if self._q_sum is None else self._q_sum + batch_sum
        self._q_n += int(y.shape[0])
        return weighted_nll(logits, y, q, self._label_smoothing)

    def _uninstall(self) -> None:
        if self._module is not None:
            restore_methods(self._module, self._shadowed)
        self._module, self._mixture, self._snapshot, self._shadowed = None, None, None, {}

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall()
        if self._ctx is not None and self._q_sum is not None and self._q_n > 0:
            self._captured = (self._q_sum / self._q_n).detach().to("cpu", torch.float32)  # M-step: π = mean q
        self._q_sum = None

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._uninstall()

    #: ``on_client_fit_end`` takes the update where the weights are: it stores the mixture weights as they are
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        self._uninstall()
        ctx, self._ctx = self._ctx, None
        captured, self._captured = self._captured, None
        if ctx is None:
            return
        k = update.client_idx
        if captured is not None:
            self.set_client_state(loop, k, "weights", captured)
        if update.message is not None:
            self._strip(update.message)
        # the E-step: M forwards over the client's training samples (once per round, as the code)
        loop.accounting.charge_flops(k, self.estep_flops * loop.datamodule.num_samples(k, "train"), update)

    @override
    def on_round_end(self, loop: FederationView, round_idx: int, metrics: dict[str, Any]) -> None:
        # how personal the mixtures are: the mean over clients of max_m π_m (1/M: uniform, 1: one component)
        top = [float(self.get_client_state(loop, k, "weights").max()) for k in range(loop.num_clients)]
        metrics["fedem_pi_max"] = sum(top) / len(top) if top else None

    @override
    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        return [("FedEM mean max π", "fedem_pi_max")]


def _running_sum(total: Tensor | None, batch_sum: Tensor) -> Tensor:
    """``total + batch_sum`` (``batch_sum`` itself first), as the compiled step adds it."""
    return batch_sum.clone() if total is None else total + batch_sum
