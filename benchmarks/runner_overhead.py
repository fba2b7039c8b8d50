"""The fit runner's own cost against a plain PyTorch loop: per fit and per step, CPU and wall time, alternated.

One client fit of the tiny synthetic model (MLP 64 -> 16 -> 4, batches of 16 already in memory) is run three ways,
in turn, ``--pairs`` times:

* **plain**: ``for x, y in loader: loss = module.loss(module(x), y); opt.zero_grad(); loss.backward(); opt.step()``
  with the optimizer from ``configure_optimizers`` — the floor;
* **runner**: :class:`~pl_fedsparse.executors.runner.FitRunner` (``trainer.fit_runner: auto``), with the meter
  callback the engine adds;
* **trainer**: a fresh ``lightning.Trainer`` per fit, as the reference path builds it.

Each is timed at ``--short`` and ``--long`` steps per fit; the per-step cost is the slope between them, the per-fit
fixed cost the intercept. Printed per pair and as medians, with the runner's excess over the plain loop.

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


def _plain(module: Any, loader: Any, steps: int) -> None:
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


def _runner(runner: FitRunner, module: Any, loader: Any, steps: int) -> None:
    runner.fit(module, loader, [FitMeter()], max_epochs=-1, max_steps=steps)


def _trainer(module: Any, loader: Any, steps: int) -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=-1, max_steps=steps, callbacks=[FitMeter()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=loader)


def _time(fn: Any, reps: int) -> tuple[float, float]:
    """Median wall and CPU seconds of one call over ``reps`` calls."""
    walls, cpus = [], []
    for _ in range(reps):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return statistics.median(walls), statistics.median(cpus)


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
    ways = {"plain": lambda s: _plain(module, loader, s), "runner": lambda s: _runner(runner, module, loader, s),
            "trainer": lambda s: _trainer(module, loader, s)}
    for fn in ways.values():  # warm up
        fn(a.short)
    res: dict[str, dict[str, list[float]]] = {k: {"fit_wall": [], "fit_cpu": [], "step_wall": [], "step_cpu": []}
                                              for k in ways}
    print(f"# per fit: {a.short} step(s); per step: slope between {a.short} and {a.long} steps; "
          f"median of {a.reps} fits per timing; ms")
    for p in range(a.pairs):
        row = []
        for name, fn in ways.items():
            reps_long = max(3, a.reps // 4) if name == "trainer" else a.reps
            s_wall, s_cpu = _time(lambda: fn(a.short), a.reps)
            l_wall, l_cpu = _time(lambda: fn(a.long), reps_long)
            d = a.long - a.short
            r = res[name]
            r["fit_wall"].append(s_wall * 1e3)
            r["fit_cpu"].append(s_cpu * 1e3)
            r["step_wall"].append((l_wall - s_wall) / d * 1e3)
            r["step_cpu"].append((l_cpu - s_cpu) / d * 1e3)
            row.append(f"{name}: fit {s_wall * 1e3:.3f} / step {(l_wall - s_wall) / d * 1e3:.4f}")
        print(f"pair {p}: " + "; ".join(row), flush=True)
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in res.items()}
    for name, m in med.items():
        print(f"{name:8s} per fit {m['fit_wall']:.3f} ms wall {m['fit_cpu']:.3f} ms CPU; "
              f"per step {m['step_wall']:.4f} ms wall {m['step_cpu']:.4f} ms CPU")
    pr, pp, pt = med["runner"], med["plain"], med["trainer"]
    print(f"runner - plain: per fit {pr['fit_wall'] - pp['fit_wall']:.3f} ms wall "
          f"({pr['fit_cpu'] - pp['fit_cpu']:.3f} CPU); per step {pr['step_wall'] - pp['step_wall']:.4f} ms wall "
          f"({pr['step_cpu'] - pp['step_cpu']:.4f} CPU)")
    print(f"trainer - plain: per fit {pt['fit_wall'] - pp['fit_wall']:.3f} ms wall "
          f"({pt['fit_cpu'] - pp['fit_cpu']:.3f} CPU); per step {pt['step_wall'] - pp['step_wall']:.4f} ms wall "
          f"({pt['step_cpu'] - pp['step_cpu']:.4f} CPU)")


if __name__ == "__main__":
    main()
