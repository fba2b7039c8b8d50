"""Per-fit engine overhead: milliseconds per client fit when the fit itself is almost free.

A round of 20 clients of the tiny synthetic task (MLP 64→16→4), one optimizer step each, through
``FederatedLoop.run_round``: what remains is the engine's own cost per fit (the fit runner or a fresh Lightning
``Trainer``, hooks, loading and copying state, accounting). Compute-bound benchmarks (``overhead.py``) cannot resolve
differences of a few milliseconds per fit on a noisy 2-core machine; this one can.

    OMP_NUM_THREADS=1 python benchmarks/fit_overhead.py [--fit-runner auto|trainer] [--steps N]

``--steps N`` gives each fit N optimizer steps: the difference between two step counts, divided by the extra steps,
is the per-step cost (``benchmarks/runner_overhead.py`` does that and compares with a plain PyTorch loop).
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import tiny_datamodule, tiny_module  # noqa: E402

from pl_fedsparse import FederatedLoop  # noqa: E402


def main(rounds: int = 9, clients: int = 20, fit_runner: str = "auto", steps: int = 1) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    loop = FederatedLoop(num_rounds=1000, local_steps=steps, eval_every=1000, fit_runner=fit_runner, accelerator="cpu", logger=False,
                         enable_progress_bar=False, checkpoint_every=0, default_root_dir="benchmarks/_runs/fit_overhead",
                         overwrite=True)
    loop.setup(tiny_module(), tiny_datamodule(num_clients=clients))
    start = dict(loop.global_state or {})
    times = []
    for r in range(rounds + 1):  # round 0 warms up
        loop.global_state = dict(start)
        t = time.perf_counter()
        loop.run_round(r)
        if r:
            times.append((time.perf_counter() - t) / clients)
    loop.reporter.release()
    print(f"median per client fit: {1000 * statistics.median(times):.2f} ms ({clients} clients x {rounds} rounds, "
          f"{steps} step(s) each, fit_runner={fit_runner})")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit-runner", default="auto", choices=["auto", "fast", "trainer"])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    main(rounds=a.rounds, fit_runner=a.fit_runner, steps=a.steps)
