"""Per-client optimizer state across rounds: :class:`KeepOptimizerState`.

Lightning builds a fresh optimizer at every local fit (``configure_optimizers``), so by default momentum buffers
and Adam moments start from zero each round — what the reference code of FedSpa/DisPFL/DM-PFL does. With this
callback each client's optimizer state (not its hyper-parameters: the learning rate still follows the round's
schedule) is saved at the end of its fit into the loop's client-state store and restored at the start of its next
fit, so it is also checkpointed and resumed with the federation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.context import FitContext
from pl_fedsparse.functional.transfer import clone_tensors, host_tensor, to_device

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

    @override
    def vectorized_fit(self) -> Any:
        """The kept state continued in stacked fits (:class:`_VectorizedKeptState`)."""
        return _VectorizedKeptState(self)


#: ``torch.optim``'s per-parameter state keys, in its order: SGD's, Adam's (``step`` is its count, a host scalar)
_KEYS = ("momentum_buffer", "step", "exp_avg", "exp_avg_sq")


class _VectorizedKeptState:
    """:class:`KeepOptimizerState`'s ``on_train_start`` and ``on_train_end`` over a stacked group of fits: every
    client's kept buffers become its rows of the group's optimizer state before the first step (a client with none
    starts as a fresh ``torch.optim`` one: SGD's first step takes the gradient, Adam's moments start at zero), and
    its rows are kept again when its fit ends — its loaded state unchanged when it made no step, as in process; Adam's
    count per tensor where the tensors' counts differ (:attr:`~pl_fedsparse.executors.StackedFit.tensor_steps`)."""

    def __init__(self, keep: KeepOptimizerState) -> None:
        self.keep = keep
        self.pending: dict[int, dict[str, Tensor] | None] = {}
        self.fit: Any = None
        self.first: Tensor | None = None

    def capture(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        self.pending[index] = self.keep._pending  # None: not a round's training; {}: nothing kept yet

    def start(self, fit: Any) -> None:
        self.fit, self.first = fit, fit.steps.clone()
        K = len(fit.contexts)
        kept = [self.pending.get(i) or {} for i in range(K)]
        if not any(kept):
            return  # every optimizer fresh: the executor makes its state at the first step, as torch.optim does
        moved = to_device({f"{i}/{key}": t for i, d in enumerate(kept) for key, t in d.items()}, fit.device)
        counts: dict[str, list[int]] = {}  # Adam's count, one per parameter (as torch.optim's): per tensor and row
        for name, idx in fit.optimizer_index.items():
            p = fit.params[name]
            for key in _KEYS:
                have = [moved.get(f"{i}/{idx}.{key}") for i in range(K)]
                if key == "step":
                    counts[name] = [0 if t is None else int(t) for t in have]  # (host scalars: no wait)
                    continue
                if all(t is None for t in have):
                    continue
                zero = p.new_zeros(p.shape[1:])
                fit.optimizer_state[name][key] = torch.stack([zero if t is None else t.to(p.dtype) for t in have])
                if key == "momentum_buffer" and any(t is None for t in have):
                    fit.optimizer_state[name]["fresh"] = host_tensor([t is None for t in have], p.device)
        rows = list(zip(*counts.values(), strict=True))
        if all(len(set(row)) == 1 for row in rows):  # every tensor of a client at one count: the client's
            for i, row in enumerate(rows):
                fit.steps[i] = row[0]
        else:  # (tensors frozen for part of a fit, as FedRep's: each its own)
            fit.tensor_steps = {n: torch.tensor(c, dtype=torch.long) for n, c in counts.items()}

    def before_optimizer_step(self, fit: Any) -> None:
        pass

    def after_optimizer_step(self, fit: Any) -> None:
        pass

    def finish(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        pending = self.pending.pop(index, None)
        if pending is None:
            return  # not a round's training: nothing read or kept (as in process)
        fit, first = self.fit, self.first
        assert fit is not None and first is not None
        if int(fit.steps[index]) == int(first[index]):
            self.keep._captured = pending  # no step: the loaded state, unchanged
            return
        names, rows, steps = [], [], {}
        for name, idx in sorted(fit.optimizer_index.items(), key=lambda item: item[1]):
            state = fit.optimizer_state[name]
            for key in _KEYS:
                if key == "step":
                    if "exp_avg" in state:  # Adam's count: a host scalar, as torch.optim's
                        count = fit.steps if fit.tensor_steps is None else fit.tensor_steps[name]
                        names.append(f"{idx}.step")
                        steps[f"{idx}.step"] = torch.tensor(float(count[index]))
                elif key in state:
                    names.append(f"{idx}.{key}")
                    rows.append(state[key][index])
        # the client's own copies (not views of the group's stacked state), in one multi-tensor copy
        copies = iter(clone_tensors(rows))
        self.keep._captured = {n: steps[n] if n in steps else next(copies) for n in names}
