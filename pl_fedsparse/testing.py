"""Testing tools: fault injection, to test that a federation survives failing clients (``trainer.on_client_fault``),
a device run simulated on the CPU, to find a tensor left on the wrong side without a GPU (:func:`simulated_device`),
and CUDA graphs' reuse of their outputs simulated on the CPU, to find a step's output kept past the next step without
a GPU (:func:`simulated_cuda_graphs`).

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
from pl_fedsparse.executors import compiling
from pl_fedsparse.functional import gate, sparse, transfer

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["FAULT_KINDS", "SIMULATED_CUDA_GRAPHS", "FaultInjection", "GraphRuns", "device_paths",
           "simulated_cuda_graphs", "simulated_device"]

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


# ---- CUDA graphs' output reuse, on the CPU -------------------------------------------------------------------------
#: the ``torch.compile`` backend :func:`simulated_cuda_graphs` runs (``trainer.compile: {backend: ...}``)
SIMULATED_CUDA_GRAPHS = "pl_fedsparse_simulated_cudagraphs"


class GraphRuns:
    """What :func:`simulated_cuda_graphs` saw: ``calls`` of compiled graphs, ``generations`` begun (a call while no
    call's backward is pending: as CUDA graph trees start one), ``overwritten`` outputs (and gradients) of earlier
    generations."""

    def __init__(self) -> None:
        self.calls = self.generations = self.overwritten = 0
        self._live: list[torch.Tensor] = []
        self._pending = 0

    def _new_generation(self) -> None:
        with torch.no_grad():
            for t in self._live:
                d = t.detach()
                if d.is_floating_point() or d.is_complex():
                    d.fill_(float("nan"))
                elif d.dtype == torch.bool:
                    d.logical_not_()
                else:
                    d.bitwise_not_()
        self.overwritten += len(self._live)
        self._live = []
        self.generations += 1

    def _run(self, gm: Any, args: tuple[Any, ...]) -> Any:
        self.calls += 1
        if self._pending == 0:
            self._new_generation()
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for a in args:  # the gradients a graph's backward gives its parameters live in the graphs' memory too
            if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad and not hasattr(a, _HOOKED):
                setattr(a, _HOOKED, True)
                a.register_post_accumulate_grad_hook(_gradient_made)
        outs = gm(*args)
        leaves = [t for t in (outs if isinstance(outs, (list, tuple)) else [outs]) if isinstance(t, torch.Tensor)]
        with_grad = [t for t in leaves if t.requires_grad]
        if with_grad and torch.is_grad_enabled():  # a backward pending until one of them gets its gradient
            self._pending += 1
            done = [False]

            def backward_ran(grad: torch.Tensor) -> None:
                if not done[0]:
                    done[0] = True
                    self._pending -= 1

            for t in with_grad:
                t.register_hook(backward_ran)
        # outputs in the graph's own memory (not an input's, nor a view of one)
        self._live += [t for t in leaves if t.untyped_storage().data_ptr() not in inputs]
        return outs


_graph_runs: GraphRuns | None = None
#: the mark of a parameter whose gradients the simulation watches (a hook each, once)
_HOOKED = "_pl_fedsparse_simulated_cudagraphs_hook"


def _gradient_made(param: torch.Tensor) -> None:
    """A parameter's gradient, made by a backward, overwritten with the generation's outputs."""
    if _graph_runs is not None and param.grad is not None:
        _graph_runs._live.append(param.grad)


def _simulated_backend(gm: Any, example_inputs: Any) -> Any:
    """The backend: each graph run by torch's own operators (``eager``), its outputs overwritten when the next
    generation begins."""

    def run(*args: Any) -> Any:
        if _graph_runs is None:
            return gm(*args)
        return _graph_runs._run(gm, args)

    return run


@contextlib.contextmanager
def simulated_cuda_graphs() -> Iterator[GraphRuns]:
    """CUDA graphs' reuse of their outputs, on the CPU, for a module compiled with ``trainer.compile: {backend:
    pl_fedsparse_simulated_cudagraphs}`` (:data:`SIMULATED_CUDA_GRAPHS`) inside the block: each compiled graph runs
    by torch's own operators, and when a new generation begins — a compiled graph called while no earlier call's
    backward is pending, CUDA graph trees' rule — every output of the earlier generations is overwritten (NaN,
    flipped bits), and so is every gradient their backwards gave the graphs' parameters, as a replay overwrites them
    on a GPU (where reading one raises "accessing tensor output of CUDAGraphs that has been overwritten"). The
    engine treats the backend as CUDA graphs (:func:`~pl_fedsparse.executors.compiling.graph_outputs_reused`): it
    keeps copies where it keeps a step's outputs. A module or callback that keeps an output past the next step
    without a copy (:func:`~pl_fedsparse.executors.compiling.outside_graphs`) reads garbage: a federation that gives
    other numbers than uncompiled has one. Stricter than CUDA graph trees (they begin a generation per compiled call
    of a frame; here per graph, and a frame broken in two graphs counts twice).

    Example:
        >>> import torch
        >>> f = torch.compile(lambda x: x * 2, backend=SIMULATED_CUDA_GRAPHS)
        >>> with simulated_cuda_graphs() as runs:
        ...     a = f(torch.ones(2)); b = f(torch.ones(2))
        >>> a.isnan().all().item(), b.tolist(), runs.generations
        (True, [2.0, 2.0], 2)
    """
    global _graph_runs
    saved, _graph_runs = _graph_runs, GraphRuns()
    try:
        yield _graph_runs
    finally:
        _graph_runs = saved


torch._dynamo.register_backend(_simulated_backend, name=SIMULATED_CUDA_GRAPHS)
compiling.OUTPUT_REUSING_BACKENDS.add(SIMULATED_CUDA_GRAPHS)
