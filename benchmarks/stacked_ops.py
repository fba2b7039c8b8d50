"""Operators a pFedGate round's training dispatches — on a GPU each is a kernel launch — with its fits one by one (the
in-process executor) and stacked (the VectorizedExecutor), counted on the CPU.

pFedGate's round on a GPU is launch-bound: an H200 spent 3.1 % of a round in kernels while the host launched 26,515 of
them for 10 fits (``gpu/profile/profile_pfedgate_runner_h200.txt``). Stacking a round's fits makes every operator of
a step serve all its clients, so the launches per round fall from about (clients × steps × operators a step) to
(steps × operators a stacked step) plus what stays per client (its fit's start and end, the model's convolutions,
which the stacked step still runs per client to keep each client's bits). This script counts them where no GPU is:
``configs/cifar10_pfedgate.yaml`` as it is (gated LeNet-CIFAR, batch 128, all clients every round) on synthetic
32×32 images of the same size, ``--clients`` clients of about 300 training images each; one round to warm up, then
every operator dispatched while the executor trains the next round's fits is counted (views and allocations, which
launch no kernel, are not: ``benchmarks/device_traffic.py``'s rule), with the operators that read a value on "the
device" from the host (each a wait on a GPU). Both runs are device runs simulated on the CPU
(:func:`~pl_fedsparse.testing.simulated_device`): the engine takes the paths it takes on a GPU (pFedGate's knapsack
as tensor operations, state packed across the link) and what is on "the device" is tracked.

    OMP_NUM_THREADS=1 python benchmarks/stacked_ops.py --clients 10
    OMP_NUM_THREADS=1 python benchmarks/stacked_ops.py --clients 10 50 --out ops.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from device_traffic import _NO_KERNEL, _SYNC_OPS

from pl_fedsparse.cli import FedCLI
from pl_fedsparse.functional import transfer
from pl_fedsparse.testing import simulated_device

EXECUTORS = {"in_process": None, "vectorized": "pl_fedsparse.executors.VectorizedExecutor"}


class OpCounter(TorchDispatchMode):
    """Every dispatched operator that launches a kernel on a GPU (``ops``), those of them that read or write a tensor
    on "the device" of a simulated device run (``device_ops``), and those that make the host wait (``syncs``).

    ``ops`` also counts what a GPU run does on the host (e.g. a fit's state split into tensors of its own after its
    one copy out): an upper bound of the launches. ``device_ops`` leaves out an operator that makes a tensor from no
    tensor where its ``device=`` names the device (the simulation places it only after the operator returns): a
    lower bound. The launches lie between the two."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.device_ops = self.syncs = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS and not (name == "repeat_interleave" and (not isinstance(
                args[1] if len(args) > 1 else args[0], torch.Tensor) or (kwargs or {}).get("output_size") is not None)):
            # (repeat_interleave waits only for a tensor of repeats without its output_size: device_traffic's rule)
            leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if any(transfer.placed_on(t) is not None for t in leaves):  # a value on "the device" read on the host
                self.syncs += 1
        out = func(*args, **(kwargs or {}))
        if not func.is_view and name not in _NO_KERNEL:
            self.ops += 1
            # (what the operator wrote is placed by now: the simulation's tracker sits below this mode)
            if any(transfer.placed_on(t) is not None for t in tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor)):
                self.device_ops += 1
        return out


def count_round(executor: str | None, clients: int) -> dict[str, Any]:
    """One warm-up round, then the operators of the next round's fits (the executor's ``run``)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--config", str(ROOT / "configs" / "cifar10_pfedgate.yaml"), "--data.name", "synthetic",
                "--data.root", "null", "--data.num_clients", str(clients), "--data.cache_inputs", "true",
                "--data.synthetic", json.dumps({"num_train": 500 * clients, "num_test": 100, "size": 32,
                                                "channels": 3}),
                "--trainer.num_rounds", "2", "--trainer.eval_every", "1000", "--trainer.checkpoint_every", "0",
                "--trainer.logger", "false", "--trainer.enable_progress_bar", "false", "--trainer.accelerator",
                "cpu", "--trainer.default_root_dir", tmp]
        if executor:
            argv += ["--trainer.executor", executor]
        counted: dict[str, Any] = {}
        with contextlib.redirect_stdout(io.StringIO()), simulated_device():
            cli = FedCLI(args=argv, run=False)
            loop = cli.trainer
            real_run = loop.run_round

            def run_round(r: int) -> dict[str, Any]:
                if r != 1:
                    return real_run(r)
                ex = loop.executor
                real_fits = ex.run

                def fits(requests: Any) -> Any:
                    counter = OpCounter()
                    with counter:
                        out = real_fits(requests)
                    counted.update(ops=counter.ops, device_ops=counter.device_ops, syncs=counter.syncs,
                                   fits=len(requests))
                    return out

                ex.run = fits  # type: ignore[method-assign]
                try:
                    return real_run(r)
                finally:
                    ex.run = real_fits  # type: ignore[method-assign]

            loop.run_round = run_round  # type: ignore[method-assign]
            loop.fit(cli.model, cli.datamodule)
        steps = sum(int(-(-cli.datamodule.num_samples(k) // cli.datamodule.batch_size))
                    for k in range(cli.datamodule.num_clients))
        rows = loop.history
    return {**counted, "client_steps": steps, "acc": rows[-1].get("acc_mean")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, nargs="+", default=[10])
    p.add_argument("--out", default=None, help="write the counts as JSON here")
    a = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = []
    for k in a.clients:
        res = {n: count_round(ex, k) for n, ex in EXECUTORS.items()}
        ref, vec = res["in_process"], res["vectorized"]
        print(f"pFedGate round, {k} clients ({ref['fits']} fits, {ref['client_steps']} client steps):")
        for n, r in res.items():
            print(f"  {n:<11} {r['ops']:>9,} operators ({r['ops'] / r['fits']:,.1f} a fit)   {r['syncs']} syncs   "
                  f"{r['device_ops']:,} of them on the device")
        print(f"  operators in process / stacked: {ref['ops'] / vec['ops']:.1f}x   "
              f"final accuracy {ref['acc']:.6f} / {vec['acc']:.6f}", flush=True)
        results.append({"clients": k, **res})
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
