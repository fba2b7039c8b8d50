"""FedRep's alternating epochs over a stacked group of fits, for :class:`~pl_fedsparse.executors.VectorizedExecutor`:
what :class:`~pl_fedsparse.callbacks.PersonalLayers` (``mode: fedrep``) does inside one client's fit, done for a
round's clients at once.

In process (Collins et al. 2021, Alg. 1) a fit's first ``head_epochs`` epochs train the head with the body frozen,
the others the body with the head frozen: the frozen part has ``requires_grad`` off, so its weights, its momentum
and its weight decay are untouched and it has no place in gradient clipping's norm; the head epochs run at
``personal_lr``. Stacked, every client of a step is in its own epoch (clients of different sizes take different
numbers of steps per epoch), so the part frozen is chosen per client and step from the epoch of its batch
(:attr:`~pl_fedsparse.executors.StackedFit.epochs`): before the gradients the frozen rows are named to the executor
(``frozen_rows``: out of the clipping norm; a tensor frozen in every row of the step — the usual case, the clients
of a step mostly share their phase — is neither differentiated nor stepped, as autograd and ``torch.optim`` skip a
parameter without a gradient, so a head epoch costs the head's gradients only). Where only some rows of a tensor are
frozen, their weights and optimizer state are remembered and put back after the step — a momentum buffer the step
created for them removed again (zero, marked ``fresh``: the row's first real step takes the gradient itself, as
``torch.optim.SGD`` does when a parameter first has one). The head's learning rates are scaled once per fit (each
tensor trains in one phase only). The samples of each phase are counted per client for the callback's FLOP refund.
With Adam, whose bias corrections count each parameter's own steps, the executor keeps a count per tensor and row
(:attr:`~pl_fedsparse.executors.StackedFit.tensor_steps`): a frozen row's count does not move, as a parameter without
a gradient takes no ``torch.optim.Adam`` step; moments the step created for frozen rows are put back to zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pl_fedsparse.context import FitContext
from pl_fedsparse.functional import transfer

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from pl_fedsparse.callbacks.personal_layers import PersonalLayers
    from pl_fedsparse.executors.hooks import StackedFit

__all__ = ["StackedFedRep"]


class StackedFedRep:
    """:class:`~pl_fedsparse.executors.VectorizedFitHooks` of FedRep's head / body epochs (see the module)."""

    def __init__(self, callback: PersonalLayers) -> None:
        self.cb = callback
        self.active: dict[int, bool] = {}  # client row -> a FedRep fit (a round's training after fedavg_rounds)
        self.scale: dict[int, float] = {}  # client row -> the head epochs' learning-rate factor
        self.samples: dict[int, dict[str, int]] = {}  # client row -> samples per phase
        self.saved: dict[str, tuple[Tensor, Tensor, dict[str, Tensor], bool]] = {}  # the frozen rows, by tensor
        self._at: dict[tuple[bool, ...], Tensor] = {}
        self.mine: list[str] = []  # the tensors this step froze in some rows

    def capture(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        cb = self.cb
        self.active[index] = cb._ctx is not None  # (set by on_client_fit_start: FedRep's split is on this fit)
        personal_lr = cb.personal_lr
        self.scale[index] = 1.0 if personal_lr is None else personal_lr / float(module.lr)  # type: ignore[arg-type]
        self.samples[index] = {}

    def start(self, fit: StackedFit) -> None:
        self._at = {}

    def learning_rates(self, fit: StackedFit, lrs: dict[str, list[float]]) -> None:
        """The head's rates times ``personal_lr / lr`` (what ``on_train_epoch_start`` sets in the head epochs; the
        body's stay: it trains only in the body epochs, at the optimizer's own rates)."""
        for name, rates in lrs.items():
            if name in self.cb._personal:
                for i, scale in self.scale.items():
                    if self.active[i] and scale != 1.0:
                        rates[i] = rates[i] * scale

    def _positions(self, frozen: tuple[bool, ...], device: torch.device) -> Tensor:
        """The step rows ``frozen`` marks, as an index tensor on the device (made once per pattern)."""
        if frozen not in self._at:
            self._at[frozen] = transfer.host_tensor([j for j, f in enumerate(frozen) if f], device)
        return self._at[frozen]

    def frozen_rows(self, fit: StackedFit) -> dict[str, list[bool]]:
        """Per tensor, the step's rows whose client has it frozen: the body in a head epoch, the head in a body
        epoch (and each client's samples counted in its phase)."""
        head_epochs, clients = self.cb.head_epochs, fit.clients
        in_head = [self.active[c] and e < head_epochs for c, e in zip(clients, fit.epochs, strict=True)]
        in_body = [self.active[c] and e >= head_epochs for c, e in zip(clients, fit.epochs, strict=True)]
        for c, head, size in zip(clients, in_head, fit.batch_sizes, strict=True):
            if self.active[c]:
                phase = "head" if head else "body"
                self.samples[c][phase] = self.samples[c].get(phase, 0) + size
        out = {}
        for name in fit.params:
            rows = in_body if name in self.cb._personal else in_head
            if any(rows):
                out[name] = list(rows)
        self.mine = list(out)
        return out

    def before_optimizer_step(self, fit: StackedFit) -> None:
        """A tensor frozen in some of the step's rows only: those rows' weights and optimizer state remembered (one
        frozen in every row takes no step at all: the executor skips it)."""
        self.saved = {}
        for name in self.mine:
            rows = fit.no_grad[name]
            if all(rows):
                continue
            at = self._positions(tuple(rows), fit.params[name].device)
            state = fit.step_state.get(name, {})
            self.saved[name] = (at, fit.params[name].index_select(0, at),
                                {k: v.index_select(0, at) for k, v in state.items()}, "momentum_buffer" in state)

    def after_optimizer_step(self, fit: StackedFit) -> None:
        for name, (at, params, state, had_buffer) in self.saved.items():
            fit.params[name].index_copy_(0, at, params)
            now = fit.step_state.get(name, {})
            for key, value in now.items():
                if key == "fresh":
                    continue
                before = state.get(key)
                if before is not None:
                    value.index_copy_(0, at, before)
                else:  # created by this step: not for the frozen rows (no gradient yet; Adam's moments start at 0)
                    value.index_fill_(0, at, 0)
            if "momentum_buffer" not in now:
                continue
            if not had_buffer:  # the frozen rows have no buffer yet: their first step takes the gradient
                flags = torch.zeros(now["momentum_buffer"].shape[0], dtype=torch.bool, device=at.device)
                now["fresh"] = flags.index_fill_(0, at, True)
            elif "fresh" in state:  # (the step cleared every row's flag: the frozen rows keep theirs)
                now["fresh"].index_copy_(0, at, state["fresh"])
        self.saved = {}

    def finish(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        """The client's samples per phase, for the callback's FLOP refund in ``on_client_fit_end``."""
        if self.active.get(index):
            self.cb._samples = self.samples.get(index, {})
