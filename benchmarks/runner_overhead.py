"""The fit runner's own cost against a plain PyTorch loop: per fit and per step, CPU and wall time, alternated.

One client fit of the tiny synthetic model (MLP 64 -> 16 -> 4, batches of 16 already in memory) is run three ways,
in turn, ``--pairs`` times:

* **plain**: ``for x, y in loader: loss = module.loss(module(x), y); opt.zero_grad(); loss.backward(); opt.step()``
  with the optimizer from ``configure_optimizers`` — the floor;
* **runner**: :class:`~pl_fedsparse.executors.runner.FitRunner` (``trainer.fit_runner: auto``), with the callbacks
  the engine adds to such a fit (none for this module: it keeps its own ``fit_metrics``; a ``FitMeter`` otherwise);
* **trainer**: a fresh ``lightning.Trainer`` per fit, as the reference path builds it.

Each is timed at ``--short`` and ``--long`` steps per fit; the per-step cost is the slope between them, the per-fit
fixed cost the intercept. The three paths alternate fit by fit (each first in turn); the excess over the plain loop
is the median of the fit-by-fit differences (what a noisy shared machine leaves comparable). Printed per pair and as
medians.

    OMP_NUM_THREADS=1 python benchmarks/runner_overhead.py --pairs 7
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_datamodule, tiny_module  # noqa: E402

from pl_fedsparse.executors.base import FitMeter  # noqa: E402
from pl_fedsparse.executors.runner import FitRunner  # noqa: E402


def plain_fit(module: Any, loader: Any, steps: int) -> None:
    """``steps`` optimizer steps of ``module`` over ``loader`` in plain PyTorch (the floor both overhead scripts
    compare the engine with)."""
    opt = module.configure_optimizers()
    done = 0
    while done < steps:
        for x, y in loader:
            loss = module.loss(module(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            if done >= steps:
                break


def _meters(module: Any) -> list[Any]:
    """The callbacks the engine adds to a fit of ``module``: a :class:`FitMeter` only where the module has no
    ``fit_metrics`` of its own (as the in-process executor decides)."""
    return [] if callable(getattr(module, "fit_metrics", None)) else [FitMeter()]


def _runner(runner: FitRunner, module: Any, loader: Any, steps: int) -> None:
    runner.fit(module, loader, _meters(module), max_epochs=-1, max_steps=steps)


def _trainer(module: Any, loader: Any, steps: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=-1, max_steps=steps, callbacks=_meters(module),
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)


def _once(fn: Any) -> tuple[float, float]:
    """Wall and CPU seconds of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--short", type=int, default=1)
    ap.add_argument("--long", type=int, default=101)
    ap.add_argument("--reps", type=int, default=20, help="fits per timing (the median is taken)")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    module = tiny_module()
    dm = tiny_datamodule(num_clients=2)
    dm.setup("fit")
    loader = dm.train_loader(0, seed=0)
    runner = FitRunner(torch.device("cpu"))
    ways = {"plain": lambda s: plain_fit(module, loader, s), "runner": lambda s: _runner(runner, module, loader, s),
            "trainer": lambda s: _trainer(module, loader, s)}
    for fn in ways.values():  # warm up
        fn(a.short)
    d = a.long - a.short
    keys = ("fit_wall", "fit_cpu", "step_wall", "step_cpu")
    res: dict[str, dict[str, list[float]]] = {k: {m: [] for m in keys} for k in ways}
    excess: dict[str, dict[str, list[float]]] = {k: {m: [] for m in keys} for k in ("runner", "trainer")}
    print(f"# per fit: {a.short} step(s); per step: slope between {a.short} and {a.long} steps; "
          f"median of {a.reps} fits per timing, the three paths alternated fit by fit; ms")
    for p in range(a.pairs):
        rep: dict[str, dict[str, list[float]]] = {k: {m: [] for m in keys} for k in ways}
        for r in range(a.reps):
            names = list(ways)[r % 3:] + list(ways)[:r % 3]  # each path first in turn
            for name in names:
                fn = ways[name]
                (sw, sc), (lw, lc) = _once(lambda: fn(a.short)), _once(lambda: fn(a.long))  # noqa: B023 (called now)
                for m, v in zip(keys, (sw, sc, (lw - sw) / d, (lc - sc) / d)):
                    rep[name][m].append(v * 1e3)
        row = []
        for name in ways:
            for m in keys:
                res[name][m].append(statistics.median(rep[name][m]))
            row.append(f"{name}: fit {res[name]['fit_wall'][-1]:.3f} / step {res[name]['step_wall'][-1]:.4f}")
        for name in excess:  # the difference fit by fit (the same moment of a noisy machine), then its median
            for m in keys:
                excess[name][m].append(statistics.median(x - y for x, y in zip(rep[name][m], rep["plain"][m])))
        print(f"pair {p}: " + "; ".join(row), flush=True)
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    for name, m in med.items():
        print(f"{name:8s} per fit {m['fit_wall']:.3f} ms wall {m['fit_cpu']:.3f} ms CPU; "
              f"per step {m['step_wall']:.4f} ms wall {m['step_cpu']:.4f} ms CPU")
    for name, r in excess.items():  # medians over pairs of the fit-by-fit differences
        e = {m: statistics.median(v) for m, v in r.items()}
        print(f"{name} - plain: per fit {e['fit_wall']:.3f} ms wall ({e['fit_cpu']:.3f} CPU); per step "
              f"{e['step_wall']:.4f} ms wall ({e['step_cpu']:.4f} CPU)")


if __name__ == "__main__":
    main()
