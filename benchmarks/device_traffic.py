"""Device traffic per client fit and per training step, counted on the CPU: what would wait for, or copy across, a
GPU's link.

A run of a method's config (shrunk onto the synthetic task, as ``benchmarks/parity.py`` does) under a counter that
sees every torch call (``torch.overrides.TorchFunctionMode``) and counts, per phase:

* **Trainers built** (``lightning.Trainer.__init__``) and **module moves** (``.to`` / ``.cuda`` / ``.cpu`` on a
  ``LightningModule``) inside client fits;
* **transfers** (of state): ``Tensor.to(<device>)``, ``.cpu()``, ``.cuda()``, ``.pin_memory()`` calls — on a GPU
  each moves a tensor across the host link unless it is already where it is sent (on the CPU every such call is
  counted: an upper bound). Many tensors packed into one copy
  (:func:`~pl_fedsparse.functional.transfer.copy_tensors`) are one transfer; the counter makes the engine pack on the
  CPU as it does from a device (``transfer.ALWAYS_PACK``), and keeps track of what is on "the device": what was moved
  there, and what an operator computed from it (``transfer.PlacementTracker``: a gradient, a mask drawn from the
  trained weights) — so that the engine takes, on the CPU, the path it takes on a GPU (an update that stays on the
  device through the callbacks, ``device_update``), moving such a tensor there again is no transfer, and moving it
  to the host is one. A simulated device run keeps copies on "the device" between fits as a GPU run does
  (``trainer.device_state_budget``, :mod:`~pl_fedsparse.functional.resident`): what is found there does not cross
  again (``--budget 0`` counts without them). **Data transfers** (calls made by ``pl_fedsparse.data``:
  images, labels and batch orders to the loader's device; none once ``data.device`` holds the data there) are
  counted apart. The data's inputs are prepared once where the data is (``data.cache_inputs``, what ``auto`` does on
  an accelerator; ``--cache-inputs false`` counts without), so a batch is one gather;
* **operators** (``ops_per_step``, ``ops_per_fit_outside_steps``): every operator dispatched that is not a view
  or an allocation — on a GPU each is a kernel launch, and a step of small kernels costs what its launches cost
  (pFedGate's round of 10 fits on an H200: 26,515 launches, 3.1 % of the wall time in kernels:
  ``gpu/profile/profile_pfedgate_runner_h200.txt``);
* **synchronising calls**: ``.item()``, ``.tolist()``, ``.numpy()``, ``bool()/int()/float()`` of a tensor,
  ``nonzero``/``argwhere``, ``masked_select``, ``unique`` and indexing by a bool tensor — each makes the host wait
  for the device; and, seen one level down (``TorchDispatchMode``, the operators a GPU runs), any other operator
  that reads a device value on the host: ``_local_scalar_dense`` (a 0-dim tensor used as a Python number or index,
  ``t[i]`` with a tensor ``i``), ``nonzero``, ``masked_select``, ``unique``, ``repeat_interleave``, ``equal``. (pFedGate's
  device knapsack indexed with a 0-dim tensor: 6 waits per step on an H100, 0 in this counter before it looked one
  level down.) ``torch.tensor(data, device=...)`` and ``torch.as_tensor(..., device=...)`` count as a transfer and a
  synchronising call: on a GPU the values cross from pageable host memory, after which PyTorch waits for the stream
  (``transfer.send`` / ``transfer.host_tensor`` send them from pinned memory without the wait: a transfer only).
  Of these, the ones made on a value on "the device" (not a host copy, e.g. of the update after it crossed) are
  also counted as **waits** (``waits_per_fit``): what would make the host wait for a GPU; ``syncs_per_fit`` counts
  every synchronising call in a fit (an upper bound).

Phases: a **fit** (a client's local fit, from ``on_client_fit_start`` to its update), a **step** (one optimisation
step of the fit runner: ``training_step``, backward, ``on_before_optimizer_step`` hooks, the optimizer) and
**readjust** (prune-and-regrow: :func:`~pl_fedsparse.functional.sparse.drop_and_grow_many`, a call per fit,
or :func:`~pl_fedsparse.functional.sparse.drop_and_grow` where the masks are on several devices), **eval** (one evaluation
loader's logits: :meth:`~pl_fedsparse.evaluation.Evaluator.logits`, per loader) and **message** (one client's
message of a round: the ``client_message`` policy and every ``on_client_message``,
``FederatedLoop.client_message``; DisPFL's gossip average is made there, on the fits' device) and **aggregate** (the
server's aggregation of a round, ``FederatedLoop.aggregate``, and the callbacks' ``on_after_aggregate``, where
FedPSE's DPS personalises every client's next update: on the fits' device for the policies that say so and for DPS,
with what they bring back to the host; a copy to the host is counted as a transfer, not as a wait). In the message and aggregate phases a synchronising call on a tensor the
simulation knows to be on the host (neither moved to "the device" nor computed
from what was: e.g. a count read from a mask's packed bytes kept on the host) is not counted: on a GPU it waits for
nothing. In the other phases every such call is counted, as before (an upper bound). Where the engine takes
another path on the CPU than on a device (pFedGate's greedy knapsack, a Python scan on the CPU; prune-and-regrow's
selections, by counting on the CPU and by sorting on a device), the counter makes it take the device's. A GPU's own profile
(``torch.profiler``, ``torch.cuda.set_sync_debug_mode``) is the check on a lent device; this one runs anywhere, and
``tests/test_device_traffic.py`` holds its counts.

    python benchmarks/device_traffic.py                   # every config below, a table
    python benchmarks/device_traffic.py fedavg fedspa     # some of them
    python benchmarks/device_traffic.py --json out.json
    python benchmarks/device_traffic.py --budget 0        # no copies kept on the device between fits (each fit moves
                                                          # its start weights and entries: 2 transfers a fit)
    python benchmarks/device_traffic.py --gpu             # on a CUDA device: torch.profiler's counts per fit and step
    python benchmarks/device_traffic.py --stacked         # the VectorizedExecutor's stacked steps: what one adds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pl_fedsparse.functional import transfer

#: name -> (config, extra arguments); the CIFAR-10 CPU configs run on the synthetic task (benchmarks/parity.py's way)
_SYNTH = ["--data.name", "synthetic", "--data.root", "null", "--data.num_clients", "6", "--data.max_train_samples",
          "null", "--data.augment", "false", "--data.batch_size", "32",
          "--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "10",
          "--model.backbone.init_args.in_channels", "3", "--model.backbone.init_args.input_size", "16",
          "--trainer.accelerator", "cpu", "--trainer.local_epochs", "1"]
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "fedavg": ("configs/synthetic_fedavg.yaml", []),
    "fedspa": ("configs/cifar10_fedspa_dst_cpu.yaml", _SYNTH),
    "dispfl": ("configs/cifar10_dispfl_cpu.yaml", _SYNTH),
    "dmpfl": ("configs/cifar10_dmpfl_plus_cpu.yaml", _SYNTH + ["--trainer.num_rounds", "4"]),
    "pfedgate": ("configs/synthetic_pfedgate.yaml", []),
    # the paper's LeNet (convolution and linear blocks: the per-group budget's two knapsacks) on 32x32 synthetic images
    "pfedgate_lenet": ("configs/synthetic_pfedgate.yaml", [
        "--model.backbone", "pl_fedsparse.models.LeNetCIFAR", "--model.backbone.init_args.num_classes", "10",
        "--model.backbone.init_args.input_size", "32",
        "--data.synthetic", '{"size": 32}', "--data.num_clients", "4"]),
    "fedpse": ("configs/synthetic_fedpse.yaml", []),
}

_SYNC_NAMES = {"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
               "masked_select", "unique", "unique_consecutive"}
_TRANSFER_NAMES = {"cpu", "cuda", "pin_memory"}
#: operators that read a device value on the host (a CUDA stream synchronisation each), seen at the dispatch level;
#: ``repeat_interleave`` only with a tensor of repeats and no ``output_size`` (an int repeat is an expand);
#: ``equal`` answers a Python bool (``torch.equal`` of two device tensors reads its answer on the host)
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive", "repeat_interleave", "equal"}
#: operators that launch no kernel on a GPU (allocation and metadata); every other non-view operator counts as one
#: launch in ``ops_per_step`` / ``ops_per_fit`` (a launch-bound step's cost on a GPU is its number of operators)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "_local_scalar_dense", "lift_fresh", "set_", "resize_",
              "_record_function_enter_new", "_record_function_exit", "is_nonzero", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "_unsafe_view", "reshape", "contiguous"}
_TORCH_DIR = str(Path(torch.__file__).parent)
_DATA_DIR = str(REPO / "pl_fedsparse" / "data") + "/"
_INHERITED = object()


def _is_device(x: Any) -> bool:
    return isinstance(x, (torch.device, str)) and str(x).split(":")[0] in ("cpu", "cuda", "mps", "meta")


#: the code of ``transfer.send`` and ``transfer.host_tensor``: a move they make is counted as their caller's (the
#: data's own moves stay apart)
_SEND_CODES = (transfer.send.__code__, transfer.host_tensor.__code__)

#: phases whose synchronising calls on host tensors are not counted (they wait for nothing on a GPU)
_HOST_AWARE = ("message", "aggregate", "group")


def _on_the_host(args: tuple[Any, ...]) -> bool:
    """Whether the tensor a call reads is a host tensor in the simulated device run (neither moved to "the device"
    nor computed from what was)."""
    from pl_fedsparse.functional import transfer

    t = args[0] if args else None
    return isinstance(t, torch.Tensor) and not transfer.on_a_device([t])


class TrafficCounter(TorchFunctionMode):
    """Counts Trainers, module moves, transfers and synchronising calls by phase (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase: list[str] = ["outside"]
        self.counts: Counter[tuple[str, str]] = Counter()
        self.samples: dict[tuple[str, str], list[str]] = {}
        self.counted_above = 0  # > 0 inside a call counted already (its operators are not counted again)

    def _count(self, kind: str, what: str) -> None:
        key = (self.phase[-1], kind)
        self.counts[key] += 1
        examples = self.samples.setdefault(key, [])
        if len(examples) < 5 and what not in examples:
            examples.append(what)

    def _sync(self, what: str, args: tuple[Any, ...]) -> None:
        """A synchronising call: counted in every phase (an upper bound), and as a *wait* where it reads a value on
        the simulated device (a read of a host copy, e.g. of the update after it crossed, waits for nothing)."""
        self._count("syncs", what)
        if not _on_the_host(args):
            self._count("waits", what)

    @contextlib.contextmanager
    def in_phase(self, name: str) -> Iterator[None]:
        self.phase.append(name)
        try:
            yield
        finally:
            self.phase.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        frame = sys._getframe(1)
        sent = frame.f_code in _SEND_CODES  # (transfer.send: a small host-made value, queued without a wait)
        while frame.f_code in _SEND_CODES and frame.f_back is not None:  # (counted as its caller's)
            frame = frame.f_back
        caller = frame.f_code.co_filename
        if _TORCH_DIR in caller:  # torch's own housekeeping (e.g. clip_grad_norm_'s per-device grouping): not ours
            return func(*args, **kwargs)
        # (the data's own moves counted apart; the engine's sends of small host-made values too: no wait, no state)
        moves = "data_transfers" if _DATA_DIR in caller else "sends" if sent else "transfers"
        counted = True
        if name in _SYNC_NAMES and self.phase[-1] in _HOST_AWARE and _on_the_host(args):
            pass  # (a host tensor's value read on the host: no wait, see "message" in the docstring)
        elif name in _SYNC_NAMES:
            self._sync(name, args)
        elif name in _TRANSFER_NAMES:
            self._count(moves, name)
            if name == "cpu":  # a copy to the host also waits for the device
                self._sync(name, args)
        elif name == "to" and (any(_is_device(a) for a in args[1:]) or _is_device(kwargs.get("device"))):
            self._count(moves, "to(device)")
        elif name in ("tensor", "as_tensor") and _is_device(kwargs.get("device")):
            # made from host values on a device: a copy from pageable memory, after which PyTorch waits for the stream
            self._count(moves, f"{name}(device=)")
            self._count("syncs", f"{name}(device=)")
            self._count("waits", f"{name}(device=)")
        elif name in ("__getitem__", "__setitem__") and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            counted = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
            if counted:
                self._sync(f"{name}[bool]", args)
        else:
            counted = False
        if not counted:
            return func(*args, **kwargs)
        self.counted_above += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counted_above -= 1


class SyncOpCounter(TorchDispatchMode):
    """The operators that make the host wait for the device (``_SYNC_OPS``), counted into ``counter``'s phase unless
    a call the function-level counter counted already made them (``.item()`` is one sync, not two)."""

    def __init__(self, counter: TrafficCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL:
            self.counter.counts[(self.counter.phase[-1], "ops")] += 1
        if name == "repeat_interleave":
            repeats = args[1] if len(args) > 1 else args[0]  # (the Tensor overload: repeats alone)
            syncs = isinstance(repeats, torch.Tensor) and (kwargs or {}).get("output_size") is None
        else:
            syncs = name in _SYNC_OPS
        if syncs and not self.counter.counted_above and not (self.counter.phase[-1] in _HOST_AWARE
                                                             and _on_the_host(args)):
            self.counter._sync(f"aten.{name}", args)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[TrafficCounter]:
    """Count everything inside the block; phases marked by patching the engine's fit, step and readjustment."""
    from pl_fedsparse.callbacks import prune_regrow as pr
    from pl_fedsparse.executors import runner as runner_mod
    from pl_fedsparse.executors.in_process import InProcessExecutor

    counter = TrafficCounter()
    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, wrapper: Any) -> None:
        # the raw attribute (a staticmethod stays one when it is put back), or a note that it was inherited
        raw = vars(owner).get(attr, _INHERITED)
        patches.append((owner, attr, raw))
        setattr(owner, attr, wrapper)

    from pl_fedsparse.evaluation import Evaluator
    from pl_fedsparse.loop import FederatedLoop

    def phased(fn: Any, phase: str, what: str, amount: Any = lambda *a: 1) -> Any:
        """``fn`` counted (``amount`` of its arguments, under ``(phase, what)``) and run in ``phase``."""
        def wrapped(*a: Any, **k: Any) -> Any:
            counter.counts[(phase, what)] += amount(*a)
            with counter.in_phase(phase):
                return fn(*a, **k)
        return wrapped

    call = FederatedLoop.call

    def call_(self: Any, hook: str, *a: Any) -> Any:
        if hook != "on_after_aggregate":
            return call(self, hook, *a)
        with counter.in_phase("aggregate"):  # (the server's work after it: FedPSE's DPS)
            return call(self, hook, *a)

    trainer_init, to, cuda, cpu = pl.Trainer.__init__, torch.nn.Module.to, torch.nn.Module.cuda, torch.nn.Module.cpu

    def init_(self: Any, *a: Any, **k: Any) -> None:
        counter._count("trainers", "Trainer")
        trainer_init(self, *a, **k)

    def mover(fn: Any, name: str) -> Any:
        def moved(self: Any, *a: Any, **k: Any) -> Any:
            if isinstance(self, pl.LightningModule):
                counter._count("module_moves", name)
            return fn(self, *a, **k)
        return moved

    from pl_fedsparse.functional import transfer
    from pl_fedsparse.testing import device_paths

    patch(InProcessExecutor, "run_one", phased(InProcessExecutor.run_one, "fit", "fits"))
    patch(FederatedLoop, "client_message", phased(FederatedLoop.client_message, "message", "messages"))
    patch(FederatedLoop, "aggregate", phased(FederatedLoop.aggregate, "aggregate", "rounds"))
    patch(FederatedLoop, "call", call_)
    patch(runner_mod.FitRunner, "_step", staticmethod(phased(runner_mod.FitRunner._step, "step", "steps")))
    # (one tensor: masks on several devices; every tensor of a fit at once)
    patch(pr, "drop_and_grow", phased(pr.drop_and_grow, "readjust", "calls"))
    patch(pr, "drop_and_grow_many", phased(pr.drop_and_grow_many, "readjust", "calls"))
    patch(Evaluator, "logits", phased(Evaluator.logits, "eval", "loaders"))
    # the VectorizedExecutor: a group's fits begun, stacked, trained and ended is one phase ("group": its updates),
    # its stacked training another inside it, its steps counted (one optimizer update each)
    from pl_fedsparse.executors import vectorized as vec_mod

    vec = vec_mod.VectorizedExecutor
    patch(vec, "_run_group", phased(vec._run_group, "group", "fits", lambda self, requests: len(requests)))
    patch(vec, "_train", phased(vec._train, "stacked", "groups"))

    def stepping(fn: Any) -> Any:
        def step(*a: Any, **k: Any) -> Any:
            counter.counts[("stacked", "steps")] += 1
            return fn(*a, **k)
        return step

    patch(vec_mod, "sgd_step", stepping(vec_mod.sgd_step))
    patch(vec_mod, "adam_step", stepping(vec_mod.adam_step))
    patch(pl.Trainer, "__init__", init_)
    patch(torch.nn.Module, "to", mover(to, "to"))
    patch(torch.nn.Module, "cuda", mover(cuda, "cuda"))
    patch(torch.nn.Module, "cpu", mover(cpu, "cpu"))
    try:
        # count the paths a GPU takes (pFedGate's knapsack and prune-and-regrow's selections on the device, copies
        # to the host packed, one per batch of tensors)
        with device_paths(), counter, SyncOpCounter(counter), transfer.PlacementTracker():
            yield counter
    finally:
        for owner, attr, old in reversed(patches):
            if old is _INHERITED:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


def _counted_run(name: str, rounds: int, common: list[str]) -> TrafficCounter:
    """Config ``name`` run for ``rounds`` rounds (its own count where it sets one) under the counter."""
    from pl_fedsparse.cli import main

    cfg, extra = CONFIGS[name]
    args = ["fit", "--config", str(REPO / cfg), *extra, "--trainer.num_rounds", str(rounds), "--trainer.eval_every",
            str(rounds), "--trainer.enable_progress_bar", "false", *common]
    if "--trainer.num_rounds" in extra:
        args = ["fit", "--config", str(REPO / cfg), *extra, "--trainer.eval_every", "100",
                "--trainer.enable_progress_bar", "false", *common]
    with tempfile.TemporaryDirectory() as tmp, counting() as c:
        try:
            with contextlib.redirect_stdout(sys.stderr):  # (the run's own table stays out of the record)
                code = main([*args, "--trainer.default_root_dir", str(Path(tmp) / name)])
        except SystemExit as e:
            code = int(e.code or 0)
    if code != 0:
        raise RuntimeError(f"{name}: pl-fed exited {code}")
    return c


def measure(name: str, rounds: int = 2, fit_runner: str = "auto", budget: str = "auto",
            cache_inputs: str = "true") -> dict[str, Any]:
    """Run config ``name`` for ``rounds`` rounds under the counter; per-fit and per-step figures. ``budget``:
    ``trainer.device_state_budget`` (``"auto"``: what a simulated device run keeps, ``"0"``: no copy kept on the
    device between fits); ``cache_inputs``: ``data.cache_inputs`` (``"true"``: what ``auto`` does on a GPU)."""
    c = _counted_run(name, rounds, ["--trainer.fit_runner", fit_runner, "--trainer.device_state_budget", budget,
                                    "--data.cache_inputs", cache_inputs])
    fits = max(1, c.counts[("fit", "fits")])
    steps = max(1, c.counts[("step", "steps")])
    per = {}
    for kind in ("trainers", "module_moves", "transfers", "data_transfers", "sends", "syncs", "waits"):
        inside_fit = sum(v for (ph, k), v in c.counts.items() if k == kind and ph in ("fit", "step", "readjust"))
        per[f"{kind}_per_fit"] = round(inside_fit / fits, 2)
    per["syncs_per_step"] = round(c.counts[("step", "syncs")] / steps, 3)
    per["ops_per_step"] = round(c.counts[("step", "ops")] / steps, 1)
    per["ops_per_fit_outside_steps"] = round((c.counts[("fit", "ops")] + c.counts[("readjust", "ops")]) / fits, 1)
    per["transfers_per_step"] = round(c.counts[("step", "transfers")] / steps, 3)
    per["sends_per_step"] = round(c.counts[("step", "sends")] / steps, 3)
    per["readjust_transfers"] = c.counts[("readjust", "transfers")]
    loaders = max(1, c.counts[("eval", "loaders")])
    per["eval_transfers_per_loader"] = round(c.counts[("eval", "transfers")] / loaders, 2)
    per["eval_syncs_per_loader"] = round(c.counts[("eval", "syncs")] / loaders, 2)
    per["readjust_syncs_per_call"] = round(c.counts[("readjust", "syncs")] / max(1, c.counts[("readjust", "calls")]),
                                           2)
    messages = max(1, c.counts[("message", "messages")])
    per["message_transfers_per_message"] = round(c.counts[("message", "transfers")] / messages, 2)
    per["message_syncs_per_message"] = round(c.counts[("message", "syncs")] / messages, 2)
    aggregations = max(1, c.counts[("aggregate", "rounds")])
    per["aggregate_transfers_per_round"] = round(c.counts[("aggregate", "transfers")] / aggregations, 2)
    per["aggregate_syncs_per_round"] = round(c.counts[("aggregate", "syncs")] / aggregations, 2)
    return {"config": name, "fit_runner": fit_runner, "device_state_budget": budget, "cache_inputs": cache_inputs,
            "fits": c.counts[("fit", "fits")],
            "steps": c.counts[("step", "steps")], **per,
            "examples": {f"{ph}/{k}": v for (ph, k), v in c.samples.items()}}


def measure_stacked(name: str, rounds: int = 2) -> dict[str, Any]:
    """Config ``name`` under the ``VectorizedExecutor``: what a stacked step adds, by difference of two runs, one
    local epoch and two (a step's count is the second run's minus the first's over the steps it added; what a group
    does once — stacking, the start and end hooks, reading the losses — cancels)."""
    counts = []
    for epochs in (1, 2):
        c = _counted_run(name, rounds, ["--trainer.executor", "pl_fedsparse.executors.VectorizedExecutor",
                                        "--trainer.local_epochs", str(epochs), "--data.cache_inputs", "true"])
        counts.append(c)
    one, two = counts
    steps = two.counts[("stacked", "steps")] - one.counts[("stacked", "steps")]
    if steps <= 0:
        raise RuntimeError(f"{name}: a second local epoch added no stacked step (local_steps set?)")
    out: dict[str, Any] = {"config": name, "groups": two.counts[("stacked", "groups")],
                           "steps": two.counts[("stacked", "steps")], "steps_added": steps}
    for kind in ("syncs", "transfers", "sends", "data_transfers", "trainers", "module_moves", "ops"):
        added = two.counts[("stacked", kind)] - one.counts[("stacked", kind)]
        out[f"{kind}_per_step"] = round(added / steps, 3 if kind != "ops" else 1)
    # the rest, once a run or a group: the first stacked step's gradient check (it reads its comparisons), each
    # group's losses read at once
    out["syncs_outside_steps"] = round(two.counts[("stacked", "syncs")] - two.counts[("stacked", "steps")]
                                       * out["syncs_per_step"], 2)
    # a group's fits begun and ended around its stacked steps (the start weights into the rows, every update to
    # the host): state crossing the link per group and per fit, synchronising calls on device values per fit
    fits = max(1, two.counts[("group", "fits")])
    out["group_transfers_per_group"] = round(two.counts[("group", "transfers")] / max(1, out["groups"]), 2)
    out["group_transfers_per_fit"] = round(two.counts[("group", "transfers")] / fits, 2)
    out["group_syncs_per_fit"] = round(two.counts[("group", "syncs")] / fits, 2)
    out["sequential_fits"] = two.counts[("fit", "fits")]  # (fits run in process instead: 0 where all stack)
    out["examples"] = {f"{ph}/{k}": v for (ph, k), v in two.samples.items() if ph == "stacked"}
    return out


#: CUDA runtime calls that copy between host and device memory, and those that make the host wait
_RUNTIME_COPIES = ("cudaMemcpyAsync", "cudaMemcpy", "cudaMemcpy2DAsync", "cudaMemcpyPeerAsync")
_RUNTIME_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def measure_gpu(name: str, rounds: int = 2) -> dict[str, Any]:
    """``name`` run on the GPU (``trainer.accelerator gpu``, ``data.device cuda``) under ``torch.profiler``: per fit
    and per training step, the CUDA runtime's copy calls and its waits, and the device's host↔device copies by
    direction over the whole run; syncs inside steps also as ``torch.cuda.set_sync_debug_mode`` sees them."""
    import warnings

    from torch.profiler import ProfilerActivity, profile, record_function

    from pl_fedsparse.cli import main
    from pl_fedsparse.executors import runner as runner_mod
    from pl_fedsparse.executors.in_process import InProcessExecutor

    cfg, extra = CONFIGS[name]
    extra = [a if a != "cpu" else "gpu" for a in extra]  # (the shrunk configs name the accelerator)
    args = ["fit", "--config", str(REPO / cfg), *extra, "--trainer.accelerator", "gpu", "--data.device", "cuda",
            "--trainer.enable_progress_bar", "false", "--trainer.eval_every", "100"]
    if "--trainer.num_rounds" not in extra:
        args += ["--trainer.num_rounds", str(rounds)]
    counts: Counter[str] = Counter()
    sources: Counter[str] = Counter()  # where a synchronising call inside a step came from (file:line)
    run_one, step = InProcessExecutor.run_one, runner_mod.FitRunner._step

    def run_one_(self: Any, request: Any) -> Any:
        counts["fits"] += 1
        with record_function("pl_fed.fit"):
            return run_one(self, request)

    def step_(*a: Any, **k: Any) -> Any:
        counts["steps"] += 1
        with record_function("pl_fed.step"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return step(*a, **k)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    if "synchroniz" in str(w.message):
                        counts["sync_warnings"] += 1
                        sources[f"{Path(w.filename).name}:{w.lineno}"] += 1

    InProcessExecutor.run_one = run_one_  # type: ignore[method-assign]
    runner_mod.FitRunner._step = staticmethod(step_)  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp, profile(activities=[ProfilerActivity.CPU,
                                                                      ProfilerActivity.CUDA]) as prof:
            try:
                with contextlib.redirect_stdout(sys.stderr):  # (the run's own table stays out of the record)
                    code = main([*args, "--trainer.default_root_dir", str(Path(tmp) / name)])
            except SystemExit as e:
                code = int(e.code or 0)
    finally:
        InProcessExecutor.run_one, runner_mod.FitRunner._step = run_one, staticmethod(step)  # type: ignore
    if code != 0:
        raise RuntimeError(f"{name}: pl-fed exited {code}")
    events = list(prof.events())
    ranges = {ph: [(e.time_range.start, e.time_range.end) for e in events if e.name == f"pl_fed.{ph}"]
              for ph in ("fit", "step")}

    def inside(e: Any, ph: str) -> bool:
        return any(a <= e.time_range.start <= b for a, b in ranges[ph])

    runtime = [e for e in events if e.name in _RUNTIME_COPIES + _RUNTIME_WAITS]
    fits, steps = max(1, counts["fits"]), max(1, counts["steps"])
    out: dict[str, Any] = {"config": name, "fits": counts["fits"], "steps": counts["steps"]}
    for kind, names in (("copies", _RUNTIME_COPIES), ("waits", _RUNTIME_WAITS)):
        out[f"{kind}_per_fit"] = round(sum(e.name in names and inside(e, "fit") for e in runtime) / fits, 2)
        out[f"{kind}_per_step"] = round(sum(e.name in names and inside(e, "step") for e in runtime) / steps, 3)
    out["sync_warnings_per_step"] = round(counts["sync_warnings"] / steps, 3)
    # what each wait inside a step was part of: the nearest enclosing operator (aten::…) or the step itself, so a
    # lease's record says which call to remove
    wait_ops: Counter[str] = Counter()
    for e in runtime:
        if e.name in _RUNTIME_WAITS and inside(e, "step"):
            parent = getattr(e, "cpu_parent", None)
            while parent is not None and not str(parent.name).startswith("aten::") and parent.name != "pl_fed.step":
                parent = getattr(parent, "cpu_parent", None)
            wait_ops[str(parent.name) if parent is not None else "?"] += 1
    out["step_wait_ops"] = dict(wait_ops.most_common(5))
    out["step_sync_sources"] = dict(sources.most_common(5))
    for d in ("HtoD", "DtoH", "DtoD"):
        out[f"{d}_per_fit_run"] = round(sum(f"Memcpy {d}" in e.name for e in events) / fits, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--fit-runner", default="auto", choices=["auto", "trainer"])
    ap.add_argument("--budget", default="auto", help="trainer.device_state_budget (0: no device copies kept between "
                    "fits; auto: what a simulated device run keeps)")
    ap.add_argument("--cache-inputs", default="true", choices=["true", "false"],
                    help="data.cache_inputs (true: the inputs prepared once, as auto does on a GPU)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--gpu", action="store_true", help="count on a CUDA device with torch.profiler instead")
    ap.add_argument("--stacked", action="store_true",
                    help="count the VectorizedExecutor's stacked steps instead (by difference of 1 and 2 epochs)")
    a = ap.parse_args()
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if a.gpu:
        if not torch.cuda.is_available():
            print("error: --gpu needs a CUDA device (none is available)", file=sys.stderr)
            raise SystemExit(2)
        gpu_rows = []
        for n in a.configs:
            try:
                gpu_rows.append(measure_gpu(n, a.rounds))
            except Exception as e:  # noqa: BLE001 (one config's failure recorded; the others still run)
                print(f"# {n}: failed: {type(e).__name__}: {e}")
        if gpu_rows:
            gcols = [k for k in gpu_rows[0] if k != "config" and not isinstance(gpu_rows[0][k], dict)]
            print("| config | " + " | ".join(gcols) + " |")
            print("|---|" + "---|" * len(gcols))
            for r in gpu_rows:
                print(f"| {r['config']} | " + " | ".join(str(r[c]) for c in gcols) + " |")
            for r in gpu_rows:  # where the waits inside steps come from (empty: none)
                print(f"# {r['config']}: waits inside steps by operator {r['step_wait_ops']}; "
                      f"synchronising calls by source {r['step_sync_sources']}")
        if a.json:
            Path(a.json).write_text(json.dumps(gpu_rows, indent=1) + "\n")
        return
    if a.stacked:
        srows = [measure_stacked(n, a.rounds) for n in a.configs]
        _report(srows, [k for k in srows[0] if k not in ("config", "examples")], a.json)
        return
    rows = [measure(n, a.rounds, a.fit_runner, a.budget, a.cache_inputs) for n in a.configs]
    cols = ["fits", "steps", "trainers_per_fit", "module_moves_per_fit", "transfers_per_fit",
            "data_transfers_per_fit", "syncs_per_fit",
            "syncs_per_step", "transfers_per_step", "readjust_transfers", "readjust_syncs_per_call",
            "eval_transfers_per_loader", "eval_syncs_per_loader", "message_transfers_per_message",
            "message_syncs_per_message", "aggregate_transfers_per_round", "aggregate_syncs_per_round",
            "ops_per_step", "ops_per_fit_outside_steps", "sends_per_fit", "sends_per_step", "waits_per_fit"]
    _report(rows, cols, a.json)


def _report(rows: list[dict[str, Any]], cols: list[str], json_path: str | None) -> None:
    """``rows`` as a table of ``cols``, then each row's examples of what was counted; all of it as JSON too."""
    print("| config | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['config']} | " + " | ".join(str(r[c]) for c in cols) + " |")
    for r in rows:
        print(f"# {r['config']}: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in r["examples"].items()))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
