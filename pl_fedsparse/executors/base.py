"""Client execution's common base: the seam between the federation's orchestration and the local fits.

The loop hands every fit of a stage to a :class:`ClientExecutor` as a list of :class:`FitRequest` s and gets one
:class:`~pl_fedsparse.client.ClientUpdate` per request back. Everything a fit needs travels in the request — the
:class:`~pl_fedsparse.context.FitContext` (client, round, kind, stream and seed, learning-rate round, epochs), the
start tensors and that client's declared state — and everything it produces comes back in the update (trained
state, upload, masks, metrics, FLOPs, the client's state after the fit). An out-of-process executor (Ray workers,
one process per GPU) is therefore a second implementation of :meth:`ClientExecutor.run` that ships the requests to
workers holding a replica of the module and the callbacks; :class:`InProcessExecutor` runs them here, in order, on
the loop's working module.

Fits are order-independent: each seeds the torch RNG, the shuffling and the augmentation from its own stream, so
running the requests in another order or in parallel gives the same updates.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import traceback
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from pl_fedsparse.client import ClientUpdate, Message, TensorTree, to_cpu_state
from pl_fedsparse.context import FitContext
from pl_fedsparse.data.loaders import batch_to
from pl_fedsparse.errors import ConfigError, RunStoppedError, UserCodeError, debugging, raised_in
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.transfer import to_device
from pl_fedsparse.metrics import StepLosses
from pl_fedsparse.protocol import check_model, training_loss

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = [
    "NO_LOSS_STEPS",
    "ClientExecutor",
    "ClientFaultError",
    "FitMeter",
    "FitRequest",
    "begin_fit",
    "check_environment",
    "end_fit",
    "find_fault",
    "fit_update",
    "load_state",
    "local_gradients",
    "quiet_lightning",
    "seed_fit",
]


@dataclass
class FitRequest:
    """One local fit to run.

    Attributes:
        context: client, round, kind, stream/seed, learning-rate round, epochs.
        start: the full state dict the fit starts from.
        client_state: the client's declared state (``ClientStateStore.export_client``).
    """

    context: FitContext
    start: Mapping[str, Tensor]
    client_state: dict[str, TensorTree]


#: ``update.extras`` key: a fit whose every step had no loss (``training_step`` returned ``None``), by step count
NO_LOSS_STEPS = "no_loss_steps"


class ClientFaultError(RunStoppedError, RuntimeError):
    """A client's fit failed and ``trainer.on_client_fault`` is ``"raise"``."""


class ClientExecutor(ABC):
    """Runs local fits: ``run(requests) -> updates`` (one update per request, same order)."""

    def setup(self, loop: FederationView) -> None:
        """Called once when the federation is set up (the loop's module, data and callbacks are ready)."""

    @abstractmethod
    def run(self, requests: Sequence[FitRequest]) -> list[ClientUpdate]:
        """Run ``requests`` and return their updates, in the order of ``requests``."""

    def teardown(self) -> None:
        """Called when the federation ends (also when it stops with an error)."""

    @property
    def message_device(self) -> torch.device | None:
        """The device this executor's fits run on, in this process — where the round's messages may be computed
        and handed to the fits as they are (DisPFL's gossip: :func:`~pl_fedsparse.callbacks.base.message_device`);
        ``None`` (the default) when the fits run elsewhere (other processes): their messages are made on the host,
        from where they travel. An executor of one's own keeps the default unless its fits read tensors on that
        device from the requests."""
        return None

    def forward_clients(self, clients: Sequence[int], split: str, views: Mapping[str, Any], has_global: bool
                        ) -> list[tuple[dict[str, dict[str, Tensor]], dict[str, Tensor]]] | None:
        """Evaluation's forward passes (:meth:`pl_fedsparse.evaluation.Evaluator.forward` of every client in
        ``clients``, in that order) run elsewhere, or ``None`` to let the evaluator run them in this process (the
        default)."""
        return None

    def round_metrics(self) -> dict[str, Any]:
        """Figures of the round that just ended for its metrics row (e.g. ``worker_retries``); then reset."""
        return {}


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-Trainer info lines and per-fit warnings (one Trainer per client fit)."""
    names = ["lightning.pytorch", "lightning.fabric", "lightning.pytorch.utilities.rank_zero",
             "lightning.pytorch.accelerators.cuda"]
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"lightning\..*")
        warnings.filterwarnings("ignore", message=r".*(num_workers|log_every_n_steps|does not have many workers).*")
        try:
            yield
        finally:
            for n, lv in levels.items():
                logging.getLogger(n).setLevel(lv)


def load_state(module: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy a (full or partial) state dict into ``module`` in place (no re-allocation, any device/dtype); from the
    host to a device, all of it in one copy across the link."""
    _load_into(module.state_dict(keep_vars=True), state)


def _load_into(own: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> None:
    """:func:`load_state` into a module's ``state_dict(keep_vars=True)``."""
    with torch.no_grad():
        devices = {t.device for t in own.values()}
        if len(devices) == 1:
            state = to_device(state, devices.pop())
            # (one multi-tensor copy: on a GPU a launch or a few, not one per tensor)
            transfer.copy_into([own[k] for k in state], list(state.values()))
            return
        for k, v in state.items():
            own[k].copy_(v)


def local_gradients(module: pl.LightningModule, batches: Iterable[Any], names: Iterable[str], device: torch.device,
                    max_batches: int) -> tuple[dict[str, Tensor], int]:
    """Sum of the dense gradients of ``names`` over the first ``max_batches`` batches, at the module's current
    weights, in training mode; returns the gradients (on ``device``) and the number of samples used.

    The loss is the module's optional ``loss(logits, y)`` (:mod:`pl_fedsparse.protocol`), else cross-entropy.
    Gradients of other parameters are discarded; the module's ``.grad`` fields are left empty.
    """
    if getattr(module, "device", None) != device:  # (a LightningModule knows its device: no move when there)
        module.to(device)
    module.train()
    params = dict(module.named_parameters())
    grads = {n: torch.empty_like(params[n]) for n in names if n in params}
    if grads:  # (zeros, then each batch's gradients added: a multi-tensor operation each, not one per tensor)
        torch._foreach_zero_(list(grads.values()))
    seen = 0
    for i, (x, y) in enumerate(batches):
        if i >= max_batches:
            break
        x, y = batch_to(x, y, device)
        module.zero_grad(set_to_none=True)
        loss = training_loss(module, module(x), y)
        loss.backward()
        pairs = [(g, grad) for n, g in grads.items() for grad in (params[n].grad,) if grad is not None]
        if pairs and all(grad.layout == torch.strided for _, grad in pairs):
            torch._foreach_add_([g for g, _ in pairs], [grad for _, grad in pairs])
        else:  # (a sparse gradient, e.g. an embedding's: added one by one)
            for g, grad in pairs:
                g.add_(grad)
        seen += int(y.shape[0])
    module.zero_grad(set_to_none=True)
    return grads, seen


class FitMeter(pl.Callback):
    """Mean training loss and samples seen of one fit, for a module without ``fit_metrics`` (the optional protocol
    method, :mod:`pl_fedsparse.protocol`): the loss each ``training_step`` returned, weighted by the number of labels
    in its batch (the batch's last element, or its ``"y"``/``"label"``/``"labels"`` entry), kept per step and summed
    when the fit ends (:class:`~pl_fedsparse.metrics.StepLosses`: no host sync, no operator per step)."""

    def __init__(self) -> None:
        # (float32 products of each step's loss and batch size, summed from the first: kept per step, summed when
        # the fit ends — no operator per step)
        self._losses = StepLosses(cast_float=True, start_at_zero=False)

    @staticmethod
    def batch_size(batch: Any) -> int:
        """Number of samples in a batch: the length of its labels (or of its first tensor)."""
        if isinstance(batch, Mapping):
            for key in ("y", "label", "labels", "target", "targets"):
                if isinstance(batch.get(key), Tensor):
                    return int(batch[key].shape[0])
            batch = list(batch.values())
        if isinstance(batch, (list, tuple)) and batch:
            last = batch[-1]
            if isinstance(last, Tensor) and last.ndim >= 1:
                return int(last.shape[0])
            batch = batch[0]
        return int(batch.shape[0]) if isinstance(batch, Tensor) and batch.ndim >= 1 else 1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if not isinstance(loss, Tensor):
            return  # a manual-optimisation step that returned nothing: no loss to record
        self._losses.add(loss, self.batch_size(batch))

    @property
    def losses(self) -> StepLosses:
        """The fit's losses as kept so far."""
        return self._losses

    def metrics(self) -> dict[str, float]:
        """``{"train_loss", "samples_seen"}`` of the fit."""
        return self._losses.metrics()


def begin_fit(loop: FederationView, request: FitRequest, load: bool = True) -> tuple[Any, int]:
    """The start of every local fit, whatever runs it: the client's state in the store, the start weights in the
    working module (unless ``load`` is false: the caller takes them from the request itself), the torch RNG seeded
    from the fit's stream, the callback contract's watch begun. Returns the watch and the client's number of
    training samples."""
    assert loop.model is not None
    ctx, k = request.context, request.context.client_idx
    loop.client_store.import_client(k, request.client_state)  # no-op in process: the same objects
    if load:
        own = loop.model.state_dict(keep_vars=True)
        devices = {t.device for t in own.values()}
        device = next(iter(devices)) if len(devices) == 1 else None
        start = request.start
        if device is not None and (transfer.ALWAYS_PACK or device.type != "cpu"):
            # the start weights and the client's stored entries cross in one copy (the entries for the callbacks
            # that move them to the device during the fit: ClientStateStore.prefetch); start weights there already
            # (a message computed on the device: Gossip) stay as they are
            start = dict(zip(start, loop.client_store.prefetch(k, device, extra=list(start.values()))))
        _load_into(own, start)
    seed_fit(ctx.seed)
    n_samples = int(loop.datamodule.num_samples(k, "train"))
    # the callback contract (pl_fedsparse.contract): what a fit sets on a callback never leaves a worker, and the
    # client's stored state (exported before the fit, by reference) is never written in place — a fit reads private
    # copies and replaces entries — so a failed fit is rolled back by putting those objects back
    return loop.contract.watch(loop.callbacks, request.client_state), n_samples


def seed_fit(seed: int) -> None:
    """Seed torch's global RNG for one fit: the CPU generator, and the accelerator's when it is in use.

    ``torch.manual_seed`` also queues a seed for every device type not initialised yet, with a formatted stack trace
    each time (about 1 ms per call here, and the queue grows with every fit); a run on the CPU needs none of it.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # (is_available() would query the driver through NVML at every fit)
        torch.cuda.manual_seed_all(seed)
    if torch.backends.mps.is_built() and torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)


def fit_update(module: torch.nn.Module | None, ctx: FitContext, n_samples: int, metrics: Mapping[str, Any],
               state: Mapping[str, Tensor] | None = None, on_device: bool = False) -> ClientUpdate:
    """The update of a finished fit: the module's trained state (or ``state``), copied to the CPU, uploaded whole
    until a callback's ``on_client_fit_end`` says otherwise.

    ``on_device``: copied where the weights are instead (on a device, a copy made there); the update reaches the
    host when the fit ends, in one copy with the client's new entries (:func:`end_fit`) — for fits whose callbacks
    all take the update where the weights are (:func:`~pl_fedsparse.callbacks.base.takes_device_update`)."""
    state = module.state_dict() if state is None else state  # type: ignore[union-attr]
    if on_device and transfer.on_a_device(state.values()):
        state = dict(zip(state, transfer.clone_tensors(list(state.values()))))
        metrics = dict(metrics)  # (tensor-valued ones cross in the update's one copy: update_to_host)
    else:
        state = to_cpu_state(state)
        metrics = _as_floats(metrics)  # (read after the state's copy, for callbacks that take the update on the host)
    return ClientUpdate(client_idx=ctx.client_idx, round_idx=ctx.round_idx, n_samples=n_samples, state=state,
                        message=Message(state), metrics=metrics, kind=ctx.kind, context=ctx)


def _as_floats(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``metrics`` with each tensor-valued one read as a float (``fit_metrics`` may return scalar tensors)."""
    return {k: float(v) if isinstance(v, Tensor) else v for k, v in metrics.items()}


#: ``update.metrics`` (and the round's row): what a fit's ``self.log`` recorded, by name after this prefix
LOGGED = "logged/"


def logged_metrics(trainer: Any) -> dict[str, Any]:
    """What the fit's ``self.log`` / ``self.log_dict`` calls recorded (``trainer.callback_metrics``: the last value
    of each name, as Lightning keeps it), as ``{"logged/<name>": value}`` for the update's metrics — numbers and
    one-element tensors (read with the update's copy), where they are. The round's row holds each name's mean over
    the round's fits (:meth:`~pl_fedsparse.loop.FederatedLoop.run_round`).

    Example:
        >>> from types import SimpleNamespace
        >>> logged_metrics(SimpleNamespace(callback_metrics={"acc": torch.tensor(0.5), "n": 3, "v": torch.ones(2)}))
        {'logged/acc': tensor(0.5000), 'logged/n': 3}
    """
    found = getattr(trainer, "callback_metrics", None) or {}
    out: dict[str, Any] = {}
    for name, value in found.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            out[LOGGED + name] = value.detach().reshape(())
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[LOGGED + name] = value
    return out


def fit_owners(loop: FederationView) -> list[Any]:
    """The objects whose code a fit runs: the module, the data module, the callbacks (:func:`raised_in`)."""
    return [loop.model, loop.datamodule, *loop.callbacks]


def fault_to_raise(loop: FederationView, ctx: FitContext, error: Exception) -> Exception:
    """What ``trainer.on_client_fault: raise`` stops the run with when a fit raised ``error``: the engine's own
    one-line errors as they are; anything else as one :class:`ClientFaultError` line naming the user's class and
    hook (its traceback printed on ``PL_FED_DEBUG=1``: it is the ``__cause__``)."""
    if isinstance(error, (ConfigError, UserCodeError, RunStoppedError, OSError)):
        return error
    fault = ClientFaultError(f"round {ctx.round_idx}: client {ctx.client_idx}'s {ctx.kind} fit failed (exception: "
                             f"{raised_in(error, fit_owners(loop))}); trainer.on_client_fault=raise")
    fault.__cause__ = error
    return fault


def end_fit(loop: FederationView, request: FitRequest, watch: Any, n_samples: int, update: ClientUpdate | None,
            error: Exception | None, finite: Iterable[int] = ()) -> ClientUpdate:
    """The end of every local fit: the contract checked, the compute charged, faults found and rolled back (the
    client keeps its previous state), the client's state exported into the update. ``finite``: ids of tensors the
    caller has already found finite (:func:`find_fault`)."""
    ctx, k = request.context, request.context.client_idx
    loop.client_store.end_prefetch(k)
    # the entries the fit set on the device, and an update still there (fit_update's on_device), to the host in
    # one copy
    update_to_host(update, lambda ts: loop.client_store.flush_writes(k, extra=ts))
    if error is not None or update is None:
        update = ClientUpdate(client_idx=k, round_idx=ctx.round_idx, n_samples=n_samples, state={}, message=None,
                              kind=ctx.kind, context=ctx, fault="exception",
                              fault_detail=raised_in(error, fit_owners(loop)) if error is not None
                              else "the fit ended without an update")
        if error is not None and debugging():  # PL_FED_DEBUG=1: the fit's traceback, as it happened
            sys.stderr.write(f"PL_FED_DEBUG: client {k}'s {ctx.kind} fit (round {ctx.round_idx}) raised:\n")
            traceback.print_exception(error, file=sys.stderr)
    else:
        loop.contract.check_fit(watch, ctx)  # the user's error, not a client fault
        samples = update.metrics.get("samples_seen", update.n_samples * (ctx.epochs or loop.local_epochs))
        loop.accounting.charge_training(update, samples)
        update.fault, update.fault_detail = find_fault(update, finite)
    if update.fault:  # the client keeps its previous state: every entry the fit set is put back
        loop.client_store.restore_client(k, request.client_state)
    loop.contract.check_client_state(watch, ctx)
    update.client_state = request.client_state if update.fault else loop.client_store.export_client(k)
    return update

def update_to_host(update: ClientUpdate | None, copy: Callable[[list[Tensor]], list[Tensor]]) -> None:
    """Every tensor of ``update`` that is on a device — its state, message, masks, extras and tensor-valued metrics
    (read as floats here) — replaced by its host copy, all moved by one call of ``copy`` (which may move more
    alongside them and returns their copies in order); a tensor held in several places stays one tensor."""
    message = update.message if update is not None else None
    trees = () if update is None else (update.state, update.masks, update.extras, update.metrics,
                                       *((message.tensors, message.masks) if message is not None else ()),
                                       [tensors for tensors, _ in update.pending])
    found = {id(t): t for t in transfer.tensors_in(trees) if transfer.on_a_device([t])}
    host = dict(zip(found, copy(list(found.values()))))
    if update is not None:
        update.resolve_pending(host)  # (the reads put off until now: ClientUpdate.on_host)
    if update is None or not (host or any(isinstance(v, Tensor) for v in update.metrics.values())):
        return  # (the CPU's path: nothing to swap)

    def swap(tree: Any) -> Any:
        return tree_map(lambda t: host.get(id(t), t) if isinstance(t, Tensor) else t, tree)

    update.state, update.masks, update.extras = swap(update.state), swap(update.masks), swap(update.extras)
    update.metrics = _as_floats(swap(update.metrics))
    if update.message is not None:
        update.message.tensors, update.message.masks = swap(update.message.tensors), swap(update.message.masks)


def find_fault(update: ClientUpdate, finite: Iterable[int] = ()) -> tuple[str | None, str | None]:
    """The first problem of a finished fit, as ``(kind, detail)`` (``(None, None)`` when healthy): ``no_loss``
    (``training_step`` returned ``None`` at every step, seen by the fit runner), ``no_data`` (it trained on no
    sample), ``nonfinite_loss``, ``nonfinite_weights`` (also what NaN gradients lead to) or ``nonfinite_upload``.

    Example:
        >>> u = ClientUpdate(0, 0, 1, {"w": torch.tensor([1.0, float("nan")])}, metrics={"train_loss": 0.5})
        >>> find_fault(u)
        ('nonfinite_weights', 'w')
    """
    no_loss = update.extras.get(NO_LOSS_STEPS)
    if no_loss:
        return "no_loss", f"training_step returned None for all {no_loss} batches (no loss to optimise)"
    seen = update.metrics.get("samples_seen")
    if seen is not None and seen == 0:
        return "no_data", "no training sample"
    loss = update.metrics.get("train_loss")
    if loss is not None and not math.isfinite(loss):
        return "nonfinite_loss", f"train_loss={loss}"
    known = set(finite)  # tensors the executor has already checked (e.g. all clients' weights at once)
    weights = [(n, t) for n, t in update.state.items() if id(t) not in known and t.is_floating_point()]
    checked = {id(t) for t in update.state.values()}  # an upload of the trained weights is checked once
    upload = [(n, t) for n, t in (update.message.tensors.items() if update.message is not None else [])
              if id(t) not in checked and t.is_floating_point()]
    bad = _first_nonfinite([t for _, t in weights + upload])
    if bad is None:
        return None, None
    return ("nonfinite_weights", weights[bad][0]) if bad < len(weights) else \
        ("nonfinite_upload", upload[bad - len(weights)][0])


def _first_nonfinite(tensors: list[Tensor]) -> int | None:
    """The index of the first tensor holding a NaN or an infinity, or ``None``: a few multi-tensor operations on
    each device, whatever the number of tensors, and one wait for all of them (not one per tensor)."""
    if not tensors:
        return None
    by_device: dict[tuple[torch.device, bool], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():  # (an empty tensor holds nothing non-finite)
            by_device.setdefault((t.device, transfer.on_a_device([t])), []).append(i)
    bad = []
    for (_, on_device), idx in by_device.items():
        finite = _finite_flags([tensors[i] for i in idx], on_device)
        if not bool(finite.all()):  # the one sync (per device)
            bad.append(min(idx[j] for j in range(len(idx)) if not bool(finite[j])))
    return min(bad) if bad else None


def _finite_flags(tensors: list[Tensor], on_device: bool) -> Tensor:
    """Whether each of ``tensors`` (non-empty, floating point, on one device) is finite, as one bool tensor.

    On the CPU the largest ``|value|`` of each (NaN propagates; a maximum cannot overflow): half the cost of an
    ``isfinite`` per tensor on small models. On a device, whose multi-tensor maximum is not documented to propagate
    NaN, each tensor times 0 — 0 where a value is finite, NaN where it is NaN or ±inf — summed: exactly 0, or NaN
    (two multi-tensor launches for every tensor, where an ``isfinite`` and an ``all`` per tensor were two each)."""
    if not on_device:
        return torch.stack(torch._foreach_norm(tensors, float("inf"))).isfinite()
    return torch.stack(torch._foreach_norm(torch._foreach_mul(tensors, 0.0), 1)).isfinite()


def check_environment(loop: FederationView) -> None:
    """Validate the device, the precision and the model protocol on the data
    (:func:`~pl_fedsparse.protocol.check_model`; one-line ConfigErrors)."""
    if loop.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"trainer.accelerator={loop.accelerator!r} is invalid: expected cpu or auto "
                          "(no CUDA device is available)")
    if loop.device.type == "cpu" and loop.precision == "16-mixed":
        raise ConfigError("trainer.precision='16-mixed' is invalid on CPU: expected 32-true or bf16-mixed")
    assert loop.model is not None
    dm = loop.datamodule
    check_model(loop.model, dm.example_input(2), int(dm.num_classes), dm.source_label())
