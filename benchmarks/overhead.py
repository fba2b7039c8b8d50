"""Engine overhead: one FedAvg round through pl_fedsparse vs a plain PyTorch loop doing the same math.

Workload (issue: "CIFAR-10/LeNet, 10 clients x 5 local epochs, batch 64, ~500 samples each"): LeNet-CIFAR
(256,830 params), 100 clients of ~500 CIFAR-10 training images (IID), 10 clients per round, 5 local epochs, batch 64,
SGD lr 0.05 wd 5e-4. Both paths use the same in-memory batch loader (pl_fedsparse's TensorBatchLoader), the same
clients and seeds, and end with the same sample-weighted average; pl_fedsparse runs each client through a Lightning
``Trainer.fit`` with its hooks, message/byte accounting and FLOPs accounting. Rounds alternate between the two paths
and the median of ``--repeats`` rounds is reported (which path runs first alternates between rounds).

    python benchmarks/overhead.py --data-root data/cifar10            # real CIFAR-10 (ImageFolder or torchvision)
    python benchmarks/overhead.py                                      # synthetic 3x32x32 data of the same size
    python benchmarks/overhead.py --accelerator gpu --precision bf16-mixed   # GPU

Prints the two medians and their ratio (target: <= 1.05).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

from pl_fedsparse import FederatedLoop, FederatedModule
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.functional import weighted_average
from pl_fedsparse.streams import stream_seed
from pl_fedsparse.models import LeNetCIFAR


def plain_round(module: FederatedModule, dm: FederatedDataModule, clients: list[int], start: dict, round_idx: int,
                seed: int, epochs: int, device: torch.device, precision: str) -> dict:
    """The same math as a FedAvg round, written as a plain PyTorch loop."""
    states, weights = [], []
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None
    for k in clients:
        module.load_state_dict(start)
        module.to(device).train()
        opt = torch.optim.SGD(module.parameters(), lr=module.current_lr(), weight_decay=module.weight_decay)
        fit_seed = stream_seed(seed, 2, round_idx, k, 0)
        torch.manual_seed(fit_seed)
        loader = dm.train_loader(k, seed=fit_seed)
        for _ in range(epochs):
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                opt.zero_grad(set_to_none=True)
                if dtype is None:
                    F.cross_entropy(module(x), y).backward()
                    opt.step()
                else:
                    with torch.autocast(device.type, dtype=dtype):
                        loss = F.cross_entropy(module(x), y)
                    if scaler is not None:
                        scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
                    else:
                        loss.backward(); opt.step()
        states.append({n: t.detach().to("cpu", copy=True) for n, t in module.state_dict().items()})
        weights.append(dm.num_samples(k, "train"))
    return weighted_average(states, weights)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=None, help="CIFAR-10 folder; synthetic data of the same shape if omitted")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.data_root:
        dm = FederatedDataModule(name="cifar10", root=args.data_root, num_clients=100, partition="iid",
                                 batch_size=64, test_mode="global")
    else:
        dm = FederatedDataModule(name="synthetic", num_clients=100, partition="iid", batch_size=64, test_mode="global",
                                 synthetic={"num_train": 50000, "num_test": 1000, "channels": 3, "size": 32})
    dm.setup()
    torch.manual_seed(0)
    module = FederatedModule(LeNetCIFAR(num_classes=10), lr=0.05, weight_decay=5e-4)
    loop = FederatedLoop(num_rounds=1000, clients_per_round=10, local_epochs=5, eval_every=1000,
                         accelerator=args.accelerator, precision=args.precision, logger=False,
                         enable_progress_bar=False, checkpoint_every=0, default_root_dir="benchmarks/_runs/overhead",
                         overwrite=True)
    loop.setup(module, dm)
    device = loop.device
    print(f"device={device} precision={args.precision} threads={torch.get_num_threads()} "
          f"data={'cifar10' if args.data_root else 'synthetic'} samples/client={dm.num_samples(0)}")

    fed_times, plain_times = [], []
    for rep in range(args.repeats + 1):  # the first pair is a warm-up
        r = rep
        clients = loop.select_clients(r)
        start = dict(loop.global_state)

        def time_plain() -> float:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            plain_round(module, dm, clients, start, r, loop.seed, 5, device, args.precision)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - t

        def time_fed() -> float:
            loop.global_state = start
            t = time.perf_counter()
            loop.run_round(r)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t
            loop.global_state = start
            return elapsed

        # alternate which path runs first, so neither gains from running second (caches, clocks)
        if rep % 2 == 0:
            tp, tf = time_plain(), time_fed()
        else:
            tf, tp = time_fed(), time_plain()
        if rep > 0:
            plain_times.append(tp)
            fed_times.append(tf)
        print(f"round {rep}{' (warm-up)' if rep == 0 else ''}: plain {tp:.3f} s  pl_fedsparse {tf:.3f} s")
    loop.reporter.release()
    p, f = statistics.median(plain_times), statistics.median(fed_times)
    print(f"median plain loop   : {p:.3f} s/round")
    print(f"median pl_fedsparse : {f:.3f} s/round")
    print(f"ratio pl_fedsparse / plain = {f / p:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
