"""Per-fit engine overhead: milliseconds per client fit when the fit itself is almost free.

A round of 20 clients of the tiny synthetic task (MLP 64→16→4), one optimizer step each, through
``FederatedLoop.run_round``: what remains is the engine's own cost per fit (the fit runner or a fresh Lightning
``Trainer``, hooks, loading and copying state, accounting). Compute-bound benchmarks (``overhead.py``) cannot resolve
differences of a few milliseconds per fit on a noisy 2-core machine; this one can.

    OMP_NUM_THREADS=1 python benchmarks/fit_overhead.py [--fit-runner auto|trainer] [--steps N] [--vs-plain]

``--vs-plain`` alternates each engine round with the same round written as a plain PyTorch FedAvg loop (per client:
load the global weights, build its loader, ``configure_optimizers``, the steps, copy the weights out; then the
weighted average) and prints both per fit and the engine's excess, the median of the round-by-round differences
(CPU and wall): the engine's own fixed cost per fit.

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner_overhead import plain_fit  # noqa: E402


def _plain_round(module: torch.nn.Module, dm: object, start: dict[str, torch.Tensor], clients: int, steps: int,
                 round_idx: int) -> dict[str, torch.Tensor]:
    """One FedAvg round of ``clients`` fits in plain PyTorch: the floor the engine's round is compared with."""
    states, weights = [], []
    for k in range(clients):
        module.load_state_dict(start)
        loader = dm.train_loader(k, seed=1000 * round_idx + k)  # type: ignore[attr-defined]
        plain_fit(module, loader, steps)
        states.append({n: t.detach().clone() for n, t in module.state_dict().items()})
        weights.append(float(dm.num_samples(k)))  # type: ignore[attr-defined]
    total = sum(weights)
    return {n: sum(w / total * s[n] for w, s in zip(weights, states)) for n in states[0]}


def main(rounds: int = 9, clients: int = 20, fit_runner: str = "auto", steps: int = 1, vs_plain: bool = False
         ) -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    loop = FederatedLoop(num_rounds=1000, local_steps=steps, eval_every=1000, fit_runner=fit_runner, accelerator="cpu", logger=False,
                         enable_progress_bar=False, checkpoint_every=0, default_root_dir="benchmarks/_runs/fit_overhead",
                         overwrite=True)
    loop.setup(tiny_module(), tiny_datamodule(num_clients=clients))
    start = dict(loop.global_state or {})
    times, plain, diffs, cpu_diffs = [], [], [], []
    for r in range(rounds + 1):  # round 0 warms up
        loop.global_state = dict(start)
        t, c = time.perf_counter(), time.process_time()
        loop.run_round(r)
        t, c = (time.perf_counter() - t) / clients, (time.process_time() - c) / clients
        if vs_plain:
            assert loop.model is not None
            tp, cp = time.perf_counter(), time.process_time()
            _plain_round(loop.model, loop.datamodule, start, clients, steps, r)
            tp, cp = (time.perf_counter() - tp) / clients, (time.process_time() - cp) / clients
            if r:
                plain.append(tp)
                diffs.append(t - tp)
                cpu_diffs.append(c - cp)
        if r:
            times.append(t)
    loop.reporter.release()
    print(f"median per client fit: {1000 * statistics.median(times):.2f} ms ({clients} clients x {rounds} rounds, "
          f"{steps} step(s) each, fit_runner={fit_runner})")
    if vs_plain:
        print(f"plain PyTorch loop per client fit: {1000 * statistics.median(plain):.2f} ms; engine - plain per fit: "
              f"{1000 * statistics.median(diffs):.3f} ms wall, {1000 * statistics.median(cpu_diffs):.3f} ms CPU "
              f"(median of {len(diffs)} alternated round pairs)")


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fit-runner", default="auto", choices=["auto", "fast", "trainer"])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--vs-plain", action="store_true", help="alternate with a plain PyTorch FedAvg round")
    a = ap.parse_args()
    main(rounds=a.rounds, fit_runner=a.fit_runner, steps=a.steps, vs_plain=a.vs_plain)
