"""What an evaluation over many views costs: the engine's ``loop.evaluate()`` against a plain loop doing the same
forward passes over the same data.

The workload is a config's final evaluation (by default the DM-PFL design card, ``configs/cifar10_dmpfl.yaml``: 100
clients, the personal and the global model of each, the clean view plus 5 shift levels and 9 corruptions x 5
severities: 51 views). The federation is set up from the config (its round counter put at the last round, so that
views meant for the end are due) without training: the timing does not depend on the weights. The clients'
personal models (DM-PFL: masked) are taken as the evaluator sees them (its ``on_client_evaluate_start`` hooks applied).

* **pl_fedsparse**: ``loop.evaluate()`` — per client, every view's test data built (shifted samples drawn, images
  corrupted), every model kind's logits on every view, the per-client metrics, the summaries;
* **plain**: the views' test data built beforehand (untimed: a plain script would read CIFAR-10-C from disk), the
  same models, the same forward passes (the evaluator's batch size) with accuracy and summed cross-entropy per
  client, kind and view.

Runs alternate (plain first, then pl_fedsparse first, ...); the script prints the median seconds of each and the
ratio, and checks that both give the same clean accuracy of every client (a fast wrong answer cannot pass).

    OMP_NUM_THREADS=1 python benchmarks/eval_views.py --data-root data/cifar10 --max-train-samples 5000 --repeats 3
    OMP_NUM_THREADS=1 python benchmarks/eval_views.py --data-root data/cifar10 --repeats 1   # the whole card: ~1 h
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pl_fedsparse.cli import FedCLI
from pl_fedsparse.evaluation import CLEAN
from pl_fedsparse.executors.base import load_state


def build(config: str, data_root: str | None, clients: int | None, tmp: str, samples: int | None = None) -> Any:
    """The config's loop, set up on its data, at its last round, untrained."""
    argv = ["--config", config, "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
            "--trainer.default_root_dir", tmp, "--trainer.checkpoint_every", "0"]
    if data_root:
        argv += ["--data.root", data_root]
    if clients:
        argv += ["--data.num_clients", str(clients)]
    if samples:
        argv += ["--data.max_train_samples", str(samples)]
    with contextlib.redirect_stdout(io.StringIO()):
        cli = FedCLI(args=argv, run=False)
    loop = cli.trainer
    loop.setup(cli.model, cli.datamodule)
    loop.round_idx = loop.num_rounds - 1  # "when: last" views are due
    return loop


def prepared(loop: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The views and, per client, the data of every view (as tensors) and the weights of every model kind as the
    evaluator uses them (after ``on_client_evaluate_start``)."""
    ev = loop.evaluator
    views = ev.views()
    has_global = loop.global_state is not None and loop.eval_global
    split = loop.eval_split
    out = []
    for k in range(loop.num_clients):
        data = {}
        for v in views.values():
            if v.key not in data:
                loader = ev.loader(k, "train" if v.split == "train" else split, v.shift, v.corruption, v.severity)
                batches = list(loader)
                data[v.key] = (torch.cat([x for x, _ in batches]) if batches else None,
                               torch.cat([y for _, y in batches]) if batches else None)
        kinds = {}
        for kind, st in [("personal", loop.personal_state(k))] + ([("global", loop.global_state)] if has_global
                                                                   else []):
            load_state(loop.model, st)
            loop.call("on_client_evaluate_start", loop.model, k, kind)
            kinds[kind] = {n: t.detach().clone() for n, t in loop.model.state_dict().items()}
        out.append({"data": data, "kinds": kinds})
    return views, out


@torch.inference_mode()
def plain_evaluate(module: torch.nn.Module, views: dict[str, Any], clients: list[dict[str, Any]],
                   batch: int) -> list[float]:
    """Accuracy and summed cross-entropy of every kind on every view, per client; returns the clean personal
    accuracies."""
    module.eval()
    clean = []
    for c in clients:
        for kind, state in c["kinds"].items():
            module.load_state_dict(state)
            for key, (x, y) in c["data"].items():
                if x is None:
                    continue
                correct, loss = 0, 0.0
                for i in range(0, len(x), batch):
                    logits = module(x[i:i + batch]).float()
                    correct += int((logits.argmax(1) == y[i:i + batch]).sum())
                    loss += float(F.cross_entropy(logits, y[i:i + batch], reduction="sum"))
                if kind == "personal" and key == CLEAN.key:
                    clean.append(correct / len(x))
    module.train()
    return clean


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "cifar10_dmpfl.yaml"))
    p.add_argument("--data-root", default=None)
    p.add_argument("--clients", type=int, default=None, help="data.num_clients (default: the config's)")
    p.add_argument("--max-train-samples", type=int, default=None,
                   help="data.max_train_samples: a subset of the training images (the clients' test splits shrink "
                        "with it); the full design card's evaluation is ~1.3 M forward passes, ~15 min on one thread")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the raw times as JSON here")
    a = p.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        loop = build(a.config, a.data_root, a.clients, tmp, a.max_train_samples)
        views, clients = prepared(loop)
        batch = loop.datamodule.eval_batch()
        n_images = sum(len(x) for c in clients for x, _ in c["data"].values() if x is not None)
        print(f"config {Path(a.config).name}: {loop.num_clients} clients, {len(views)} views "
              f"({len({v.key for v in views.values()})} distinct), {len(clients[0]['kinds'])} model kinds, "
              f"{n_images} test images over all views, eval batch {batch}, {torch.get_num_threads()} thread(s)",
              flush=True)
        times: dict[str, list[float]] = {"plain": [], "pl_fedsparse": []}
        result: dict[str, Any] = {}

        def run(name: str) -> None:
            t = time.perf_counter()
            if name == "plain":
                result["plain"] = plain_evaluate(loop.model, views, clients, batch)
            else:
                result["fed"] = loop.evaluate()["client_acc"]
            times[name].append(time.perf_counter() - t)

        for rep in range(a.repeats):
            for name in (["plain", "pl_fedsparse"] if rep % 2 == 0 else ["pl_fedsparse", "plain"]):
                run(name)
            same = max(abs(x - y) for x, y in zip(result["plain"], result["fed"], strict=True)) < 1e-9
            print(f"repeat {rep}: plain {times['plain'][-1]:.2f} s, pl_fedsparse {times['pl_fedsparse'][-1]:.2f} s "
                  f"(same clean accuracy per client: {same})", flush=True)
            if not same:
                raise SystemExit("the plain loop and the evaluator disagree on a client's clean accuracy")
        loop.reporter.release()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"median plain {med['plain']:.2f} s, pl_fedsparse {med['pl_fedsparse']:.2f} s")
    print(f"ratio pl_fedsparse / plain = {med['pl_fedsparse'] / med['plain']:.2f}  (target <= 3)")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "times": times}, indent=1))


if __name__ == "__main__":
    main()
