"""Testing tools: fault injection, to test that a federation survives failing clients (``trainer.on_client_fault``),
and a device run simulated on the CPU, to find a tensor left on the wrong side without a GPU (:func:`simulated_device`).

:class:`FaultInjection` breaks one client's fit in chosen rounds, the way real clients fail: NaN weights (a
diverged or corrupted model), NaN gradients, an infinite value in the upload, an exception (a crashed device), or no
training data. Put it **last** in ``trainer.callbacks`` so that it sees the upload the method built. From the CLI:

.. code-block:: yaml

    trainer:
      on_client_fault: skip          # the default: the faulty update is left out, the round completes
      callbacks:
        - class_path: pl_fedsparse.testing.FaultInjection
          init_args: {client: 3, rounds: [2], kind: nan_weights}
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext, current_fit
from pl_fedsparse.errors import check
from pl_fedsparse.functional import gate, sparse, transfer

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["FAULT_KINDS", "FaultInjection", "device_paths", "simulated_device"]

FaultKind = Literal["nan_weights", "nan_gradients", "inf_upload", "exception", "empty_data"]
FAULT_KINDS = ("nan_weights", "nan_gradients", "inf_upload", "exception", "empty_data")


class FaultInjection(FederatedCallback):
    """Make ``client``'s local training fit fail in ``rounds``.

    Args:
        client: the client whose fit fails.
        rounds: the rounds in which it fails (0-based).
        kind: ``nan_weights`` (one weight tensor set to NaN at the end of the fit), ``nan_gradients`` (every
            gradient NaN in the first step), ``inf_upload`` (one uploaded tensor +inf), ``exception`` (the fit raises
            in its first step) or ``empty_data`` (the fit skips every batch).
    """

    scratch_attributes = ("injected",)  # a record of this process, not state of the run

    def __init__(self, *, client: int = 0, rounds: list[int] | None = None, kind: FaultKind = "nan_weights") -> None:
        check(isinstance(client, int) and client >= 0, "FaultInjection.client", client, "an int >= 0")
        check(kind in FAULT_KINDS, "FaultInjection.kind", kind, "one of " + ", ".join(FAULT_KINDS))
        self.client = client
        self.rounds = sorted(set(rounds if rounds is not None else [0]))
        self.kind = kind
        self.injected: list[int] = []  #: rounds in which a fault was injected (this process)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(client=self.client, rounds=self.rounds, kind=self.kind)

    def _target(self, ctx: FitContext | None = None) -> bool:
        """Whether ``ctx`` (default: the running fit) is the round's training fit of the faulty client."""
        ctx = ctx if ctx is not None else current_fit()
        return ctx is not None and ctx.kind == "train" and ctx.client_idx == self.client and ctx.round_idx in self.rounds

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.kind == "empty_data" and self._target():
            trainer.limit_train_batches = 0  # the fit sees no training batch, as a client without data

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.kind == "exception" and batch_idx == 0 and self._target():
            self.injected.append(current_fit().round_idx)  # type: ignore[union-attr]
            raise RuntimeError(f"injected fault in client {self.client}")

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kind == "nan_gradients" and self._target() and trainer.global_step == 0:
            for p in pl_module.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.kind == "nan_weights" and self._target():
            with torch.no_grad():
                next(iter(pl_module.parameters())).fill_(float("nan"))

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        if update.context is None or not self._target(update.context):
            return
        if self.kind != "exception":
            self.injected.append(update.round_idx)
        if self.kind == "inf_upload" and update.message is not None:
            tensors = dict(update.message.tensors)
            name = next(n for n, t in tensors.items() if t.is_floating_point())
            tensors[name] = torch.full_like(tensors[name], float("inf"))
            update.message = Message(tensors, dict(update.message.masks))


class _Moves(TorchFunctionMode):
    """Moves as on an accelerator. ``Tensor.cpu()`` makes a host copy (on the CPU it returns the tensor itself). The
    device of a tensor on "the device" (``t.device``) is remembered, so that ``Tensor.to`` with it, and a tensor made
    with ``device=`` it, are on the device too; ``.to`` with any other device (a name, ``torch.device("cpu")``) is
    taken for the host, as are the data layer's own moves (to ``data.device``: a batch reaches "the device" where the
    engine moves it there)."""

    def __init__(self) -> None:
        super().__init__()
        # id -> a device object read from a tensor on "the device" (held, so that no other object takes its id)
        self.devices: dict[int, torch.device] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu and transfer.placed_on(args[0]) is not None:
            (out,) = transfer.copy_tensors([args[0]], "cpu", force=True)
            return out
        out = func(*args, **kwargs)
        if getattr(func, "__self__", None) is _DEVICE and func.__name__ == "__get__":
            if transfer.placed_on(args[0]) is not None:
                self.devices[id(out)] = out
        elif isinstance(out, torch.Tensor) and any(isinstance(a, torch.device) and id(a) in self.devices
                                                   for a in (*args[1:2], kwargs.get("device"))):
            if out is args[0]:  # (on the CPU ``.to`` returns the tensor itself; on a device it is a copy there)
                out = out.clone()
            transfer.mark_placed([out], out.device)
        return out


#: ``Tensor.device`` (a function mode sees its getter, ``__get__`` of this descriptor)
_DEVICE = torch.Tensor.device


@contextlib.contextmanager
def simulated_device(strict: bool = True) -> Iterator[None]:
    """Run what is inside as a run on an accelerator would, on the CPU: every host↔device copy the engine makes on a
    device is made (packed, :data:`~pl_fedsparse.functional.transfer.ALWAYS_PACK`), the kernels take their device
    paths (prune-and-regrow's selections by sorting, pFedGate's knapsack as tensor operations), and the tensors on
    "the device" are tracked (:class:`~pl_fedsparse.functional.transfer.PlacementTracker`: what was moved there —
    ``Tensor.to`` with a device, the batches — and what an operator computed from them; ``Tensor.cpu()`` makes a host
    copy).

    With ``strict`` (the default), an operator given a tensor on the device and a host tensor of one dimension or
    more raises :class:`~pl_fedsparse.functional.transfer.DeviceMismatch`, as CUDA's "Expected all tensors to be on
    the same device" would: how a callback that keeps a host tensor (a mask, a running statistic) and meets the
    update on the device (``device_update = True``) is found without a GPU. A tensor made from no tensor
    (``torch.arange(8, device=x.device)``, ``torch.tensor(data, device=...)``) may meet either side: the CPU cannot
    tell which device its ``device=`` names. Numbers are the same as without it.

    Example:
        >>> from pl_fedsparse.functional.transfer import DeviceMismatch, to_device
        >>> with simulated_device():
        ...     w = to_device({"w": torch.ones(3)}, "cpu")["w"]      # moved to "the device"
        ...     ok = w * torch.arange(3.0)                           # made from nothing: either side
        ...     try:
        ...         w * w.cpu()                                     # a host copy meets the device
        ...     except DeviceMismatch as e:
        ...         print(str(e).split(" was")[0])
        aten::mul
    """
    with device_paths(), _Moves(), transfer.PlacementTracker(strict=strict):
        yield


@contextlib.contextmanager
def device_paths() -> Iterator[None]:
    """The engine's device paths on the CPU: copies packed as from a device
    (:data:`~pl_fedsparse.functional.transfer.ALWAYS_PACK`), prune-and-regrow's selections by sorting, pFedGate's
    knapsack as tensor operations (the same numbers as the CPU's own paths); the library's per-device caches dropped
    on the way in and out (on the CPU the host's would be handed to "the device"). Part of :func:`simulated_device`;
    the device-traffic counter uses it with its own tracker."""
    saved = transfer.ALWAYS_PACK, gate.HOST_KNAPSACK_ON_CPU, sparse.HOST_SELECTION_ON_CPU
    transfer.ALWAYS_PACK, gate.HOST_KNAPSACK_ON_CPU, sparse.HOST_SELECTION_ON_CPU = True, False, False
    _clear_device_caches()
    try:
        yield
    finally:
        transfer.ALWAYS_PACK, gate.HOST_KNAPSACK_ON_CPU, sparse.HOST_SELECTION_ON_CPU = saved
        transfer._placed.clear()
        _clear_device_caches()


def _clear_device_caches() -> None:
    """Drop the library's tensors cached per device (pFedGate's block tables)."""
    gate.block_span_tensors.cache_clear()
    gate._device_groups.cache_clear()
    gate._device_capacities.cache_clear()
    sparse.segment_layout.cache_clear()
