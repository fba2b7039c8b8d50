"""One stacked training step's gradients (``vmap(grad)`` over K clients, as the VectorizedExecutor takes them) of the
papers' convolutional models: the operators dispatched (on a GPU each is a kernel launch) and the time, with the
convolutions run per client (the default: each client's own bits) and grouped (``convolutions: grouped``).

On a GPU a stacked step of small models waits on its launches, and what still runs once per client is what grows
with the group: this counts it. GroupNorm runs as one kernel for every client in either mode; the linear layers as
one batched product.

    OMP_NUM_THREADS=1 python benchmarks/stacked_layers.py --clients 2 10
    python benchmarks/stacked_layers.py --device cuda --clients 10 100 --batch 32 --repeats 20

Prints, for each model, number of clients and convolution mode, a line ``<model> K=<k> <mode>: <n> operators,
<per> a client more than K=<first>, <ms> ms a step (median of <r>)``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from stacked_ops import OpCounter  # (the kernel-launch rule of the other counts: device_traffic's)

from pl_fedsparse.executors.stacked import exact_linear
from pl_fedsparse.models import VGG11GN, LeNetCIFAR, ResNet18GN

MODELS: dict[str, Any] = {"VGG11-GN": VGG11GN, "ResNet18-GN": ResNet18GN, "LeNet-CIFAR": LeNetCIFAR}


def step_fn(model: torch.nn.Module, k: int, batch: int, device: torch.device, grouped: bool) -> Any:
    """A function running one stacked step's gradients of ``k`` clients (their own weights, their own batch)."""
    params = {n: torch.stack([p.detach() + 1e-3 * i for i in range(k)]).to(device)
              for n, p in model.named_parameters()}
    buffers = {n: b.unsqueeze(0).expand(k, *b.shape).to(device) for n, b in model.named_buffers()}
    g = torch.Generator().manual_seed(k)
    x = torch.randn(k, batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (k, batch), generator=g).to(device)

    def loss(p: dict[str, torch.Tensor], b: dict[str, torch.Tensor], xx: torch.Tensor,
             yy: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(torch.func.functional_call(model, {**p, **b}, (xx,)), yy)

    grads = torch.func.vmap(torch.func.grad(loss))

    def run() -> None:
        with exact_linear(True, **({"grouped_convolutions": True} if grouped else {})):
            grads(params, buffers, x, y)

    return run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--clients", nargs="+", type=int, default=[2, 10])
    ap.add_argument("--batch", type=int, default=8, help="samples per client and step")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps (after one untimed)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--modes", nargs="+", default=["per_client", "grouped"], choices=["per_client", "grouped"],
                    help="how the convolutions run (VectorizedExecutor's convolutions)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"# python benchmarks/stacked_layers.py {' '.join(sys.argv[1:])}  (torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), device {device})")
    for name in args.models:
        torch.manual_seed(0)
        model = MODELS[name]().to(device)
        for mode in args.modes:
            first: tuple[int, int] | None = None
            for k in args.clients:
                run = step_fn(model, k, args.batch, device, mode == "grouped")
                with OpCounter() as counter:
                    run()
                counted = counter.ops
                sync()
                times = []
                for _ in range(args.repeats):
                    t0 = time.perf_counter()
                    run()
                    sync()
                    times.append(time.perf_counter() - t0)
                if first is None:
                    first = (k, counted)
                    more = ""
                else:
                    more = f", {(counted - first[1]) / (k - first[0]):.1f} a client more than K={first[0]}"
                print(f"{name} K={k} {mode}: {counted} operators{more}, "
                      f"{1e3 * statistics.median(times):.1f} ms a step (median of {args.repeats})", flush=True)


if __name__ == "__main__":
    main()
