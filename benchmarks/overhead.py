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

Prints the two medians and their ratio (target: <= 1.05), by wall time and by this process's CPU time.

``--eval`` also times one evaluation of every client (the engine's ``loop.evaluate()``: every client's personal
model, FedAvg's global one, on its test set, with accuracy, loss and the per-client summaries) against a plain loop
doing the same forward passes and metric maths, alternating the same way, and prints that ratio too.
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


@torch.inference_mode()
def plain_evaluate(module: FederatedModule, dm: FederatedDataModule, state: dict, device: torch.device,
                   precision: str) -> dict:
    """Every client's accuracy and mean loss of ``state`` on its test set, as a plain loop."""
    module.load_state_dict(state)
    module.to(device).eval()
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    accs, losses = [], []
    for k in range(dm.num_clients):
        correct, loss, n = 0, 0.0, 0
        for x, y in dm.eval_loader(k, split="test"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                logits = module(x).float()
            correct += int((logits.argmax(1) == y).sum())
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            n += int(y.numel())
        accs.append(correct / max(n, 1))
        losses.append(loss / max(n, 1))
    module.train()
    return {"acc_mean": statistics.fmean(accs), "loss_mean": statistics.fmean(losses)}


def _timed(fn, device: torch.device) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall, CPU) seconds of ``fn()``."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t, c = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t, time.process_time() - c


def _report(name: str, plain: list[tuple[float, float]], fed: list[tuple[float, float]]) -> None:
    pw, fw = statistics.median(x[0] for x in plain), statistics.median(x[0] for x in fed)
    pc, fc = statistics.median(x[1] for x in plain), statistics.median(x[1] for x in fed)
    print(f"{name}: median plain {pw:.3f} s wall / {pc:.3f} s CPU, pl_fedsparse {fw:.3f} s wall / {fc:.3f} s CPU")
    print(f"{name}: ratio pl_fedsparse / plain = {fw / pw:.3f} wall, {fc / pc:.3f} CPU  (target <= 1.05)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=None, help="CIFAR-10 folder; synthetic data of the same shape if omitted")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--eval", action="store_true", help="also time one evaluation of every client (see above)")
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
    fed_eval, plain_eval = [], []
    for rep in range(args.repeats + 1):  # the first pair is a warm-up
        r = rep
        clients = loop.select_clients(r)
        start = dict(loop.global_state)

        def run_plain() -> None:
            plain_round(module, dm, clients, start, r, loop.seed, 5, device, args.precision)

        def run_fed() -> None:
            loop.global_state = start
            loop.run_round(r)
            loop.global_state = start

        # alternate which path runs first, so neither gains from running second (caches, clocks)
        if rep % 2 == 0:
            tp, tf = _timed(run_plain, device), _timed(run_fed, device)
        else:
            tf, tp = _timed(run_fed, device), _timed(run_plain, device)
        line = f"round {rep}{' (warm-up)' if rep == 0 else ''}: plain {tp[0]:.3f} s  pl_fedsparse {tf[0]:.3f} s"
        if args.eval:
            state = dict(loop.global_state)
            results: dict = {}

            def eval_plain() -> None:
                results["plain"] = plain_evaluate(module, dm, state, device, args.precision)

            def eval_fed() -> None:
                results["fed"] = loop.evaluate()

            if rep % 2 == 0:
                ep, ef = _timed(eval_plain, device), _timed(eval_fed, device)
            else:
                ef, ep = _timed(eval_fed, device), _timed(eval_plain, device)
            same = abs(results["plain"]["acc_mean"] - results["fed"]["acc_mean"]) < 1e-6
            line += f"  | evaluation: plain {ep[0]:.3f} s  pl_fedsparse {ef[0]:.3f} s  (same accuracy: {same})"
            if rep > 0:
                plain_eval.append(ep)
                fed_eval.append(ef)
        if rep > 0:
            plain_times.append(tp)
            fed_times.append(tf)
        print(line, flush=True)
    loop.reporter.release()
    _report("training round", plain_times, fed_times)
    if args.eval:
        _report("evaluation", plain_eval, fed_eval)


if __name__ == "__main__":
    main()
