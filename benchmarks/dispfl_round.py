"""DisPFL's round through pl_fedsparse against a plain PyTorch loop doing the same work, state and data on the device.

A DisPFL round (Dai et al. 2022, Alg. 1): every client starts from the per-coordinate average of its own and its
neighbours' last models over the positions each holds (line 7), masked by its own mask; trains its sparse model
(gradients and weights kept on the mask); then readjusts the mask — drops the ``α_t`` share of its active weights
with the smallest |w| and regrows as many by the largest |dense gradient| of one local batch (lines 9-10, cosine
``α_t``). The plain loop keeps every client's model and mask as dense tensors on the device, and does exactly that
with plain torch (a ``topk`` per masked tensor for the readjustment); pl_fedsparse runs
``GradientRegrow`` + ``Gossip`` on ``RandomPeers`` through ``FederatedLoop.run_round`` (client state on the host
between fits, copies kept on the device, the gossip made on the device where the fits run on one). Both use the same
data module (data on the device with ``--data-device``), the same model, the same neighbours and the same initial
masks; the rounds alternate between the two, and the medians of ``--repeats`` rounds (after one warm-up each) and
their ratio are printed by wall time and by this process's CPU time (the issue's target on a GPU: at most 1.1).

    python benchmarks/dispfl_round.py                                   # CPU, LeNet-CIFAR, 20 clients, synthetic
    python benchmarks/dispfl_round.py --accelerator gpu --data-device cuda --model resnet18 --clients 100 \
        --neighbours 10 --data-root data/cifar10                        # the paper's setting on a GPU

The numbers of the two sides are not compared (the plain loop draws its own batches); the work is the same.

With ``--ops`` it times nothing: it counts the operators each side's rounds dispatch (on a GPU each is a kernel
launch; views and allocations are not counted: ``stacked_ops.py``'s counter), the gossip messages' share apart,
and the engine's reads of a device value on the host, in a device run simulated on the CPU
(:func:`~pl_fedsparse.testing.simulated_device`: the engine takes its GPU paths, the messages made where the fits
run). A DisPFL round on a GPU is far from launch-free on either side; the count says how many launches the engine
adds to the plain loop's, where no GPU is. Every operator counted is an upper bound of the launches (a GPU run does
some of them on the host); those outside the messages that read or write a tensor on "the device" are printed apart,
a lower bound (``stacked_ops.OpCounter``):

    OMP_NUM_THREADS=1 python benchmarks/dispfl_round.py --ops --model resnet18 --clients 12 --neighbours 10 \
        --samples 256 --batch-size 128 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pl_fedsparse import FederatedLoop, FederatedModule
from pl_fedsparse.allocator import tune_malloc
from pl_fedsparse.callbacks import Gossip, GradientRegrow
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.models import LeNetCIFAR, ResNet18GN
from pl_fedsparse.testing import simulated_device
from pl_fedsparse.topology import RandomPeers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import _timed  # (the same (wall, CPU) timer as the FedAvg overhead benchmark)


class PlainDisPFL:
    """DisPFL's round as a plain loop: dense per-client models and masks on the device."""

    def __init__(self, module: torch.nn.Module, dm: FederatedDataModule, masks: list[dict[str, torch.Tensor]],
                 topology: RandomPeers, seed: int, epochs: int, lr: float, weight_decay: float, alpha0: float,
                 total_rounds: int, device: torch.device) -> None:
        self.module, self.dm, self.topology, self.seed = module.to(device), dm, topology, seed
        self.epochs, self.lr, self.wd, self.alpha0, self.total = epochs, lr, weight_decay, alpha0, total_rounds
        self.device = device
        start = {n: t.detach().to(device) for n, t in module.state_dict().items()}
        self.masks = [{n: m.to(device) for n, m in mk.items()} for mk in masks]
        # active entries per masked tensor: readjustment keeps them (as many regrown as dropped), so they are counted
        # once, on the host, as the library counts them from the masks it keeps there
        self.active = [{n: int(m.sum()) for n, m in mk.items()} for mk in masks]
        self.models = [{n: (t * mk[n] if n in mk else t).clone() for n, t in start.items()} for mk in self.masks]

    def round(self, r: int) -> None:
        n = len(self.models)
        snapshot = list(zip(self.models, self.masks))  # every client reads the models of the round's start
        rate = self.alpha0 / 2 * (1 + math.cos(math.pi * min(r, self.total) / self.total))
        new_models, new_masks = [], []
        for k in range(n):
            group = [k, *self.topology.neighbors(r, k, range(n), self.seed)]
            start = self.message(group, snapshot, self.masks[k])
            model, mask = self._fit(k, r, start, self.masks[k], self.active[k], rate)
            new_models.append(model)
            new_masks.append(mask)
        self.models, self.masks = new_models, new_masks

    @staticmethod
    def message(group: list[int], snapshot: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
                own_mask: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The client's start: the per-coordinate average of its group's models, masked by its own mask."""
        start = {}
        for name, t in snapshot[group[0]][0].items():
            if not t.is_floating_point():
                start[name] = t
                continue
            num, den = torch.zeros_like(t), torch.zeros_like(t)
            for j in group:
                m = snapshot[j][1].get(name)
                w = snapshot[j][0][name]
                if m is None:
                    num.add_(w)
                    den.add_(1.0)
                else:
                    mf = m.to(t.dtype)
                    num.addcmul_(w, mf)
                    den.add_(mf)
            avg = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
            start[name] = avg * own_mask[name] if name in own_mask else avg
        return start

    def _fit(self, k: int, r: int, start: dict[str, torch.Tensor], mask: dict[str, torch.Tensor],
             active: dict[str, int], rate: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        module = self.module
        module.load_state_dict(start)
        module.train()
        params = dict(module.named_parameters())
        opt = torch.optim.SGD(module.parameters(), lr=self.lr, weight_decay=self.wd)
        loader = self.dm.train_loader(k, seed=self.seed * 1000 + r * 100 + k)
        for _ in range(self.epochs):
            for x, y in loader:
                x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(module(x), y).backward()
                with torch.no_grad():
                    for name, m in mask.items():
                        params[name].grad.mul_(m)
                opt.step()
                with torch.no_grad():
                    for name, m in mask.items():
                        params[name].mul_(m)
        # regrowth scores: |dense gradient| of one batch at the trained weights (no weight decay)
        x, y = next(iter(self.dm.train_loader(k, seed=self.seed * 7 + r * 100 + k)))
        module.zero_grad(set_to_none=True)
        F.cross_entropy(module(x.to(self.device)), y.to(self.device)).backward()
        new_mask = {}
        with torch.no_grad():
            for name, m in mask.items():
                w, g = params[name], params[name].grad.abs()
                count = int(rate * active[name])
                flat_m = m.reshape(-1).clone()
                if count:
                    drop = torch.where(flat_m, w.abs().reshape(-1), torch.full_like(g.reshape(-1), math.inf))
                    flat_m[torch.topk(drop, count, largest=False).indices] = False
                    grow = torch.where(flat_m, torch.full_like(g.reshape(-1), -math.inf), g.reshape(-1))
                    flat_m[torch.topk(grow, count).indices] = True
                new_mask[name] = flat_m.view(m.shape)
                w.mul_(new_mask[name])
        return {n: t.detach().clone() for n, t in module.state_dict().items()}, new_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=["lenet", "resnet18"], default="lenet")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--neighbours", type=int, default=4)
    ap.add_argument("--density", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--samples", type=int, default=200, help="training samples per client (synthetic data)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--data-root", default=None, help="CIFAR-10 folder; synthetic 3x32x32 data if omitted")
    ap.add_argument("--data-device", default=None, help="keep the data on this device (e.g. cuda)")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ops", action="store_true",
                    help="count each round's operators (GPU kernel launches) instead of timing, in a device run "
                         "simulated on the CPU")
    a = ap.parse_args()
    with simulated_device(strict=False) if a.ops else contextlib.nullcontext():
        _run(a)


def _run(a: argparse.Namespace) -> None:
    tune_malloc()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if a.threads:
        torch.set_num_threads(a.threads)
    common: dict[str, Any] = {"num_clients": a.clients, "partition": "iid", "batch_size": a.batch_size,
                              "test_mode": "global", "augment": False, "device": a.data_device}
    if a.data_root:
        dm = FederatedDataModule(name="cifar10", root=a.data_root, max_train_samples=a.clients * a.samples, **common)
    else:
        dm = FederatedDataModule(name="synthetic", synthetic={"num_train": a.clients * a.samples, "num_test": 200,
                                                              "channels": 3, "size": 32}, **common)
    dm.setup()
    torch.manual_seed(0)
    backbone = LeNetCIFAR(num_classes=10) if a.model == "lenet" else ResNet18GN(num_classes=10)
    module = FederatedModule(backbone, lr=0.1, weight_decay=5e-4)
    rounds = a.repeats + 1
    topology = RandomPeers(k=a.neighbours)
    loop = FederatedLoop(num_rounds=1000, join_ratio=1.0, local_epochs=a.epochs, eval_every=1000, topology=topology,
                         callbacks=[GradientRegrow(density=a.density, alpha0=0.5, total_rounds=rounds), Gossip()],
                         accelerator=a.accelerator, logger=False, enable_progress_bar=False, checkpoint_every=0,
                         default_root_dir="benchmarks/_runs/dispfl_round", overwrite=True)
    loop.setup(module, dm)
    device = loop.device
    plain_module = (LeNetCIFAR(num_classes=10) if a.model == "lenet" else ResNet18GN(num_classes=10))
    plain_module.load_state_dict(module.backbone.state_dict())
    masks = [loop.client_masks(k) or {} for k in range(a.clients)]
    # (the FederatedModule names the backbone's tensors backbone.*; the plain loop trains the backbone itself)
    prefix = "backbone."
    plain = PlainDisPFL(plain_module, dm, [{n.removeprefix(prefix): m for n, m in mk.items()} for mk in masks],
                        topology, loop.seed, a.epochs, 0.1, 5e-4, 0.5, rounds, device)
    params = sum(p.numel() for p in plain_module.parameters())
    print(f"device={device} model={a.model} ({params:,} params) clients={a.clients} neighbours={a.neighbours} "
          f"density={a.density} epochs={a.epochs} samples/client={dm.num_samples(0)} batch={a.batch_size} "
          f"threads={torch.get_num_threads()} data={'cifar10' if a.data_root else 'synthetic'}"
          f"{' on ' + a.data_device if a.data_device else ''}")
    if a.ops:
        _count(a, plain, loop)
        loop.reporter.release()
        return
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "pl_fedsparse": []}
    for rep in range(a.repeats + 1):  # the first pair is a warm-up
        sides = [("plain", lambda r=rep: plain.round(r)), ("pl_fedsparse", lambda r=rep: loop.run_round(r))]
        if rep % 2:
            sides.reverse()
        got = {name: _timed(fn, device) for name, fn in sides}
        print(f"round pair {rep}{' (warm-up)' if rep == 0 else ''}: plain {got['plain'][0]:.3f} s  "
              f"pl_fedsparse {got['pl_fedsparse'][0]:.3f} s", flush=True)
        if rep:
            for name, kept in times.items():
                kept.append(got[name])
    pw, fw = (statistics.median(x[0] for x in times[s]) for s in ("plain", "pl_fedsparse"))
    pc, fc = (statistics.median(x[1] for x in times[s]) for s in ("plain", "pl_fedsparse"))
    print(f"median plain {pw:.3f} s wall / {pc:.3f} s CPU, pl_fedsparse {fw:.3f} s wall / {fc:.3f} s CPU per round")
    print(f"ratio pl_fedsparse / plain = {fw / pw:.3f} wall, {fc / pc:.3f} CPU  (target on a GPU: <= 1.1)")
    loop.reporter.release()


def _count(a: argparse.Namespace, plain: PlainDisPFL, loop: FederatedLoop) -> None:
    """``--ops``: each round's operators on both sides, the messages' apart, and the engine's host reads."""
    from stacked_ops import OpCounter  # (the kernel-launch rule of the pFedGate count)

    counter = OpCounter()
    in_messages = [0, 0]  # (all operators, those on the device)

    def counted(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            before = counter.ops, counter.device_ops
            out = fn(*args, **kwargs)
            in_messages[0] += counter.ops - before[0]
            in_messages[1] += counter.device_ops - before[1]
            return out
        return wrapper

    patches = [(PlainDisPFL, "message"), (Gossip, "client_message")]
    saved = [getattr(cls, name) for cls, name in patches]
    PlainDisPFL.message = staticmethod(counted(PlainDisPFL.message))  # type: ignore[method-assign]
    Gossip.client_message = counted(Gossip.client_message)  # type: ignore[method-assign]
    try:
        for r in range(a.repeats + 1):
            row = {}
            for name, fn in (("plain", lambda r=r: plain.round(r)), ("pl_fedsparse", lambda r=r: loop.run_round(r))):
                counter.ops = counter.device_ops = counter.syncs = in_messages[0] = in_messages[1] = 0
                with counter:
                    fn()
                row[name] = (counter.ops, in_messages[0], counter.syncs, counter.device_ops - in_messages[1])
            (po, pm, _, pd), (fo, fm, fs, fd) = row["plain"], row["pl_fedsparse"]
            n = a.clients
            print(f"round {r}{' (the initial dense models under their first masks)' if r == 0 else ''}: "
                  f"plain {po:,} operators ({pm:,} in messages, {(po - pm) / n:,.0f} a client outside them)  "
                  f"pl_fedsparse {fo:,} ({fm:,} in messages, {(fo - fm) / n:,.0f} a client outside them, {fs} host "
                  f"reads)  ratio {fo / po:.3f}  messages {pm / max(fm, 1):.1f}x fewer  |  outside the messages, "
                  f"on the device: plain {pd / n:,.0f} a client, pl_fedsparse {fd / n:,.0f}", flush=True)
    finally:
        for (cls, name), fn in zip(patches, saved):
            setattr(cls, name, fn)


if __name__ == "__main__":
    main()
