"""Per-fit engine overhead: milliseconds per client fit when the fit itself is almost free.

A round of 20 clients of the tiny synthetic task (MLP 64→16→4), one optimizer step each, through
``FederatedLoop.run_round``: what remains is the engine's own cost per fit (a fresh Lightning ``Trainer``, hooks,
loading and copying state, accounting). Compute-bound benchmarks (``overhead.py``) cannot resolve differences of a few
milliseconds per fit on a noisy 2-core machine; this one can.

    OMP_NUM_THREADS=1 python benchmarks/fit_overhead.py
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


def main(rounds: int = 9, clients: int = 20) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    loop = FederatedLoop(num_rounds=1000, local_steps=1, eval_every=1000, accelerator="cpu", logger=False,
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
    print(f"median per client fit: {1000 * statistics.median(times):.1f} ms ({clients} clients x {rounds} rounds)")


if __name__ == "__main__":
    main()
