"""What evaluating a shared model as one stream saves: ``loop.evaluate()`` with the evaluator's per-client path
(``Evaluator.stream_shared = False``: every client's data in its own short run of batches) against the streamed path
(the default: a model that is the same for every client — FedAvg's global and personal model, D-PSGD's consensus,
DM-PFL's global model — evaluated over every client's rows of a view at once).

The federation is set up from a config without training (the timing does not depend on the weights), at its last
round so that views meant for the end are due. Runs alternate (per-client first, then streamed first, ...); the
script prints the median wall and CPU seconds of each and their ratios, and checks that both paths give exactly the
same metrics (every key of ``loop.evaluate()``, every client's accuracy).

    OMP_NUM_THREADS=1 python benchmarks/eval_streams.py --data-root data/cifar10 --repeats 7
    OMP_NUM_THREADS=1 python benchmarks/eval_streams.py --config configs/cifar10_dpsgd_cpu.yaml --data-root data/cifar10
"""

from __future__ import annotations

import argparse
import json
import logging
import math
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

from eval_views import build

from pl_fedsparse.allocator import tune_malloc
from pl_fedsparse.evaluation import Evaluator


def same_metrics(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-6 (relative): on one thread the two sides are bitwise equal; with several, a kernel may
    split another batch differently and move a logit's last bits."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_metrics(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_metrics(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return a == b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "cifar10_fedavg.yaml"))
    p.add_argument("--data-root", default=None, help="CIFAR-10 folder (default: the config's)")
    p.add_argument("--clients", type=int, default=None, help="data.num_clients (default: the config's)")
    p.add_argument("--max-train-samples", type=int, default=None, help="data.max_train_samples")
    p.add_argument("--eval-batch-size", type=int, default=None, help="data.eval_batch_size (default: the config's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="write the raw times as JSON here")
    a = p.parse_args()
    tune_malloc()  # as pl-fed does at start-up (glibc's moving mmap threshold otherwise favours whichever side ran last)
    if a.repeats < 1:
        raise SystemExit(f"error: --repeats={a.repeats} is invalid: expected an int >= 1")
    logging.disable(logging.WARNING)
    times: dict[str, dict[str, list[float]]] = {"per_client": {"wall": [], "cpu": []},
                                                "streamed": {"wall": [], "cpu": []}}
    with tempfile.TemporaryDirectory() as tmp:
        loop = build(a.config, a.data_root, a.clients, tmp, a.max_train_samples)
        dm = loop.datamodule
        if a.eval_batch_size is not None:
            dm.eval_batch_size = a.eval_batch_size
        sizes = [len(dm.client_indices(k, loop.eval_split)) for k in range(loop.num_clients)]
        print(f"config {Path(a.config).name}: {loop.num_clients} clients, {sum(sizes)} {loop.eval_split} images "
              f"({min(sizes)}-{max(sizes)} per client), {len(loop.evaluator.views())} view(s), eval batch "
              f"{dm.eval_batch()}, {torch.get_num_threads()} thread(s)", flush=True)
        results: dict[str, Any] = {}
        for rep in range(a.repeats):
            for name in (["per_client", "streamed"] if rep % 2 == 0 else ["streamed", "per_client"]):
                Evaluator.stream_shared = name == "streamed"
                w, c = time.perf_counter(), time.process_time()
                results[name] = loop.evaluate()
                times[name]["cpu"].append(time.process_time() - c)
                times[name]["wall"].append(time.perf_counter() - w)
            same = same_metrics(results["per_client"], results["streamed"])
            print(f"repeat {rep}: per-client {times['per_client']['wall'][-1]:.3f} s, streamed "
                  f"{times['streamed']['wall'][-1]:.3f} s (same metrics: {same})", flush=True)
            if not same:
                raise SystemExit("the streamed evaluation's metrics differ from the per-client evaluation's")
        Evaluator.stream_shared = True
        loop.reporter.release()
    for clock in ("wall", "cpu"):
        a_med, b_med = (statistics.median(times[n][clock]) for n in ("per_client", "streamed"))
        print(f"{clock}: median per-client {a_med:.3f} s, streamed {b_med:.3f} s, "
              f"per-client / streamed = {a_med / b_med:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "times": times}, indent=1))


if __name__ == "__main__":
    main()
