"""Which evaluation batch size is fastest on this device, and what ``data.eval_batch_size: null`` (the default:
:data:`pl_fedsparse.data.datamodule.AUTO_EVAL_BATCH_SIZE`, 128 on the CPU) saves against the former fixed 512.

1. **Forward cost per image by batch size** (``--sizes``): LeNet-CIFAR and the McMahan CNN in ``eval`` mode under
   inference mode, 2,048 random 3x32x32 images in batches of each size; the sizes alternate within every repeat and
   the minimum CPU time over the repeats is printed per image.
2. **A whole evaluation** (``--config``, default the peers' workload: FedAvg with LeNet on 10 clients of 1,000 test
   images): ``loop.evaluate()`` with ``eval_batch_size`` 512 against the default, alternating, median wall and CPU
   seconds and their ratio; both must give exactly the same metrics.

    OMP_NUM_THREADS=1 python benchmarks/eval_batch.py --data-root data/cifar10 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from eval_streams import same_metrics
from eval_views import build

from pl_fedsparse.allocator import tune_malloc
from pl_fedsparse.data.datamodule import AUTO_EVAL_BATCH_SIZE
from pl_fedsparse.models import LeNetCIFAR, McMahanCNN


def per_image(sizes: list[int], repeats: int, n: int = 2048) -> dict[str, dict[int, float]]:
    """Microseconds of CPU time per image of one forward pass, by model and batch size (minimum over repeats)."""
    torch.manual_seed(0)
    x = torch.randn(n, 3, 32, 32)
    out: dict[str, dict[int, float]] = {}
    for net in (LeNetCIFAR(num_classes=10), McMahanCNN(num_classes=10, in_channels=3, input_size=32)):
        net.eval()
        best: dict[int, float] = {}
        for rep in range(repeats):
            for bs in (sizes if rep % 2 == 0 else sizes[::-1]):
                with torch.inference_mode():
                    t = time.process_time()
                    for i in range(0, n, bs):
                        net(x[i:i + bs])
                    best[bs] = min(best.get(bs, float("inf")), (time.process_time() - t) / n * 1e6)
        out[type(net).__name__] = best
    return out


def whole_evaluation(config: str, data_root: str | None, clients: int | None, repeats: int
                     ) -> dict[str, dict[str, list[float]]]:
    """``loop.evaluate()`` with ``eval_batch_size`` 512 and with the default, alternating (wall and CPU seconds)."""
    times: dict[str, dict[str, list[float]]] = {"512": {"wall": [], "cpu": []}, "default": {"wall": [], "cpu": []}}
    with tempfile.TemporaryDirectory() as tmp:
        loop = build(config, data_root, clients, tmp)
        dm = loop.datamodule
        sizes = [len(dm.client_indices(k, loop.eval_split)) for k in range(loop.num_clients)]
        print(f"\nconfig {Path(config).name}: {loop.num_clients} clients, {sum(sizes)} {loop.eval_split} images "
              f"({min(sizes)}-{max(sizes)} per client), {len(loop.evaluator.views())} view(s); eval batch 512 against "
              f"the default (null: {AUTO_EVAL_BATCH_SIZE[loop.device.type]} on {loop.device.type})", flush=True)
        results: dict[str, Any] = {}
        for rep in range(repeats):
            for name in (["512", "default"] if rep % 2 == 0 else ["default", "512"]):
                dm.eval_batch_size = 512 if name == "512" else None
                w, c = time.perf_counter(), time.process_time()
                results[name] = loop.evaluate()
                times[name]["cpu"].append(time.process_time() - c)
                times[name]["wall"].append(time.perf_counter() - w)
            same = same_metrics(results["512"], results["default"])
            print(f"repeat {rep}: batch 512 {times['512']['wall'][-1]:.3f} s, default "
                  f"{times['default']['wall'][-1]:.3f} s (same metrics: {same})", flush=True)
            if not same:
                raise SystemExit("the evaluation's metrics depend on its batch size")
        loop.reporter.release()
    for clock in ("wall", "cpu"):
        a, b = (statistics.median(times[n][clock]) for n in ("512", "default"))
        print(f"{clock}: median batch 512 {a:.3f} s, default {b:.3f} s, 512 / default = {a / b:.2f}x")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--config", default=str(ROOT / "benchmarks" / "peers" / "fedavg_lenet.yaml"))
    p.add_argument("--data-root", default=None, help="CIFAR-10 folder (default: the config's)")
    p.add_argument("--clients", type=int, default=None, help="data.num_clients (default: the config's)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the raw numbers as JSON here")
    a = p.parse_args()
    tune_malloc()  # as pl-fed does at start-up (glibc's moving mmap threshold otherwise favours whichever side ran last)
    if a.repeats < 1 or min(a.sizes) < 1:
        raise SystemExit(f"error: --repeats={a.repeats} / --sizes={a.sizes} is invalid: expected ints >= 1")
    logging.disable(logging.WARNING)
    print(f"{torch.get_num_threads()} thread(s); CPU microseconds per image of a forward pass (min of {a.repeats})")
    costs = per_image(sorted(a.sizes), a.repeats)
    print("| model | " + " | ".join(f"batch {b}" for b in sorted(a.sizes)) + " | 512 / 128 |")
    print("|---|" + "---|" * (len(a.sizes) + 1))
    for model, by in costs.items():
        ratio = f"{by[512] / by[128]:.2f}" if 512 in by and 128 in by else "-"
        print(f"| {model} | " + " | ".join(f"{by[b]:.0f}" for b in sorted(a.sizes)) + f" | {ratio} |")
    times = whole_evaluation(a.config, a.data_root, a.clients, a.repeats)
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "per_image_us": costs, "times": times}, indent=1))


if __name__ == "__main__":
    main()
