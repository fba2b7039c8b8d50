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

``--eval`` makes every round a whole round and prints three ratios from the same alternating rounds:

* **training round**: the fits and the aggregation (pl_fedsparse: ``run_round`` without its evaluation);
* **evaluation**: every client evaluated (pl_fedsparse: the round's ``loop.evaluate()`` — every client's personal
  model, FedAvg's global one, on its test set, with accuracy, loss and the per-client summaries; plain: a loop doing
  the same forward passes and metric maths);
* **whole round**: training + evaluation + reporting + checkpoint (pl_fedsparse: ``run_round`` with its evaluation,
  the row appended to ``metrics.jsonl``, the federation checkpoint written atomically; plain: its training, its
  evaluation, a JSON line appended and its model saved with ``torch.save`` through a temporary file).

Both paths evaluate the model their own round trained; the line of each round says whether the two accuracies agree.

    python benchmarks/overhead.py --data-root data/cifar10 --repeats 7 --threads 1 --eval
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pl_fedsparse import FederatedLoop, FederatedModule
from pl_fedsparse.allocator import tune_malloc
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
                        scaler.scale(loss).backward()
                        scaler.step(opt)
                        scaler.update()
                    else:
                        loss.backward()
                        opt.step()
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


def plain_save(state: dict, round_idx: int, acc: float, out: Path) -> None:
    """What a plain script does at the end of a round: its metrics line appended, its model saved (atomically)."""
    with open(out / "plain_metrics.jsonl", "a") as f:
        f.write(json.dumps({"round": round_idx, "acc_mean": acc}) + "\n")
    tmp = out / "plain_last.pt.tmp"
    torch.save({"round": round_idx, "model": state}, tmp)
    os.replace(tmp, out / "plain_last.pt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=None, help="CIFAR-10 folder; synthetic data of the same shape if omitted")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--eval", action="store_true",
                    help="also time the evaluation and the whole round (see above): three ratios")
    args = ap.parse_args()
    tune_malloc()  # as pl-fed does at start-up: both paths get the same allocator (a fixed mmap threshold)
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
    root = Path("benchmarks/_runs/overhead")
    loop = FederatedLoop(num_rounds=1000, clients_per_round=10, local_epochs=5, eval_every=1000,
                         accelerator=args.accelerator, precision=args.precision, logger=False,
                         enable_progress_bar=False, checkpoint_every=0, default_root_dir=str(root), overwrite=True)
    loop.setup(module, dm)
    device = loop.device
    print(f"device={device} precision={args.precision} threads={torch.get_num_threads()} "
          f"data={'cifar10' if args.data_root else 'synthetic'} samples/client={dm.num_samples(0)}")

    evaluations: list[tuple[float, float]] = []  # (wall, CPU) of each loop.evaluate() call in a round
    real_evaluate = loop.evaluate

    def timed_evaluate(split: str | None = None) -> dict:
        out: dict = {}
        evaluations.append(_timed(lambda: out.update(real_evaluate(split)), device))
        return out

    loop.evaluate = timed_evaluate  # type: ignore[method-assign]
    times: dict[str, dict[str, list[tuple[float, float]]]] = {
        part: {"plain": [], "fed": []} for part in ("training round", "evaluation", "whole round")}
    for rep in range(args.repeats + 1):  # the first pair is a warm-up
        r = rep
        clients = loop.select_clients(r)
        start = dict(loop.global_state)
        parts: dict[str, dict[str, tuple[float, float]]] = {"plain": {}, "fed": {}}
        results: dict[str, Any] = {}

        def run_plain() -> None:
            parts["plain"]["training round"] = _timed(
                lambda: results.update(plain_state=plain_round(module, dm, clients, start, r, loop.seed, 5, device,
                                                               args.precision)), device)
            if args.eval:
                parts["plain"]["evaluation"] = _timed(
                    lambda: results.update(plain=plain_evaluate(module, dm, results["plain_state"], device,
                                                                args.precision)), device)
                plain_save(results["plain_state"], r, results["plain"]["acc_mean"], root)

        def run_fed() -> None:
            loop.global_state = start
            loop.eval_every = 1 if args.eval else 1000  # the round evaluates, as every round of a run evaluating
            evaluations.clear()
            w, c = _timed(lambda: results.update(row=loop.run_round(r)), device)
            ew, ec = evaluations[0] if evaluations else (0.0, 0.0)
            parts["fed"]["training round"] = (w - ew, c - ec)  # the round without its evaluation
            if args.eval:
                parts["fed"]["evaluation"] = (ew, ec)
                results["fed"] = {"acc_mean": results["row"]["acc_mean"]}
                loop.reporter.log_row(results["row"])  # metrics.jsonl (TensorBoard off, as in the plain loop)
                loop.save_checkpoint()
            loop.global_state = start

        # alternate which path runs first, so neither gains from running second (caches, clocks)
        order = [("plain", run_plain), ("fed", run_fed)] if rep % 2 == 0 else [("fed", run_fed), ("plain", run_plain)]
        for name, fn in order:
            parts[name]["whole round"] = _timed(fn, device)
        fed, plain = parts["fed"], parts["plain"]
        line = (f"round {rep}{' (warm-up)' if rep == 0 else ''}: plain {plain['training round'][0]:.3f} s  "
                f"pl_fedsparse {fed['training round'][0]:.3f} s")
        if args.eval:
            same = abs(results["plain"]["acc_mean"] - results["fed"]["acc_mean"]) < 1e-6
            line += (f"  | evaluation: plain {plain['evaluation'][0]:.3f} s  pl_fedsparse "
                     f"{fed['evaluation'][0]:.3f} s  (same accuracy: {same})  | whole round: plain "
                     f"{plain['whole round'][0]:.3f} s  pl_fedsparse {fed['whole round'][0]:.3f} s")
        if rep > 0:
            for part in times:
                if part == "training round" or args.eval:
                    times[part]["plain"].append(parts["plain"][part])
                    times[part]["fed"].append(fed[part])
        print(line, flush=True)
    loop.reporter.release()
    tp, tf = times["training round"]["plain"], times["training round"]["fed"]
    print(f"median plain loop   : {statistics.median(x[0] for x in tp):.3f} s/round")
    print(f"median pl_fedsparse : {statistics.median(x[0] for x in tf):.3f} s/round")
    for part in times:
        if part == "training round" or args.eval:
            _report(part, times[part]["plain"], times[part]["fed"])


if __name__ == "__main__":
    main()
