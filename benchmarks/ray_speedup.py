"""Wall time per round in process vs Ray workers, Ray's own overhead, and the glibc
allocator tuning's effect on round time and system CPU.

Workloads (CIFAR-10, LeNet-CIFAR, batch 64, lr 0.05 / 0.1, 5 local epochs, no evaluation inside the timed rounds):

* ``lenet`` — ``benchmarks/overhead.py``'s FedAvg workload: 100 clients of ~500 IID images, 10 per round.
* ``dispfl`` — a 20-client DisPFL round (``configs/cifar10_dispfl_cpu.yaml``: 20 clients × 500 images, Dir(0.3),
  RandomPeers k = 4, GradientRegrow d = 0.5 ERK, Gossip, gradient clipping at 10): every client trains every round.

Modes: ``inprocess`` (the default executor; torch's intra-op threads = ``--threads``, default 2 = both cores) and
``ray`` (``RayExecutor``, ``--workers`` × 1 CPU, one torch thread each). ``--malloc off`` skips the glibc tuning
(``pl_fedsparse.allocator.tune_malloc``) that ``pl-fed`` and every Ray worker apply at start-up. ``--codec lossless``
runs with ``trainer.client_state_codec: lossless`` (what it costs a round).

One configuration per process (the allocator setting is per process)::

    python benchmarks/ray_speedup.py one --workload dispfl --mode ray --workers 2 --rounds 3 --data-root data/cifar10

The whole matrix, one subprocess each, written to ``benchmarks/scale_out/ray_speedup.json``::

    python benchmarks/ray_speedup.py all --data-root data/cifar10 --rounds 3     # ~20 min on 2 idle cores

Reported per configuration: median seconds per round over ``--rounds`` timed rounds (after one warm-up round), the
process's system and user CPU per round (``getrusage``; Ray workers' CPU is in their own processes and is read from
``/proc``), one evaluation of every client (spread over the workers with Ray), and for Ray: start-up seconds (``ray.init`` + actors building their replicas), the mean per-fit overhead (driver-side latency
minus the worker's own seconds: serialisation, scheduling, transfers), and the workers' busy share.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _children_cpu(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of processes ``pids`` so far (from /proc; 0 for vanished ones)."""
    tick = os.sysconf("SC_CLK_TCK")
    user = system = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11]) / tick
        system += int(fields[12]) / tick
    return user, system


def one(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pl_fedsparse import FederatedLoop, FederatedModule
    from pl_fedsparse.callbacks import Gossip, GradientRegrow
    from pl_fedsparse.data import FederatedDataModule
    from pl_fedsparse.executors import RayExecutor, tune_malloc
    from pl_fedsparse.models import LeNetCIFAR
    from pl_fedsparse.topology import RandomPeers

    tuned = tune_malloc() if args.malloc == "on" else False
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads if args.mode == "inprocess" else 1)
    data: dict[str, Any] = {"name": "cifar10", "root": args.data_root} if args.data_root else {
        "name": "synthetic", "synthetic": {"num_train": 50000, "num_test": 1000, "channels": 3, "size": 32}}
    executor = RayExecutor(num_workers=args.workers, num_gpus_per_worker=args.gpus_per_worker) \
        if args.mode == "ray" else None
    run_dir = ROOT / "benchmarks" / "_runs" / "ray_speedup" / \
        f"{args.workload}_{args.mode}_{args.malloc}_{args.codec}_{args.accelerator}"
    common: dict[str, Any] = {"num_rounds": 1000, "local_epochs": 5, "eval_every": 100000,
                              "accelerator": args.accelerator,
                              "logger": False, "enable_progress_bar": False, "checkpoint_every": 0,
                              "default_root_dir": str(run_dir), "overwrite": True, "executor": executor,
                              "client_state_codec": args.codec}
    torch.manual_seed(0)
    if args.workload == "lenet":
        dm = FederatedDataModule(num_clients=100, partition="iid", batch_size=64, test_mode="global", **data)
        module = FederatedModule(LeNetCIFAR(num_classes=10), lr=0.05, weight_decay=5e-4)
        loop = FederatedLoop(clients_per_round=10, **common)
    else:
        dm = FederatedDataModule(num_clients=20, max_train_samples=10000, partition="dirichlet", alpha=0.3,
                                 batch_size=64, test_mode="global", augment=True, **data)
        module = FederatedModule(LeNetCIFAR(num_classes=10), lr=0.1, lr_decay=0.998, weight_decay=5e-4)
        loop = FederatedLoop(join_ratio=1.0, gradient_clip_val=10.0, topology=RandomPeers(k=4),
                             callbacks=[GradientRegrow(density=0.5, distribution="erk", same_mask=False, alpha0=0.5,
                                                       mask_personal_eval=False), Gossip()], **common)
    t0 = time.perf_counter()
    loop.setup(module, dm)
    setup_s = time.perf_counter() - t0
    pids = [os.getpid()]
    if executor is not None:
        import ray

        pids += ray.get([a.ping.remote() for a in executor.actors])
    rows = []
    try:
        for r in range(args.rounds + 1):
            cpu0, kids0 = resource.getrusage(resource.RUSAGE_SELF), _children_cpu(pids[1:])
            t = time.perf_counter()
            loop.run_round(r)
            wall = time.perf_counter() - t
            cpu1, kids1 = resource.getrusage(resource.RUSAGE_SELF), _children_cpu(pids[1:])
            rows.append({"round": r, "wall_s": wall,
                         "user_s": cpu1.ru_utime - cpu0.ru_utime + kids1[0] - kids0[0],
                         "system_s": cpu1.ru_stime - cpu0.ru_stime + kids1[1] - kids0[1]})
            print(f"  round {r}{' (warm-up)' if r == 0 else ''}: {wall:.2f} s wall, "
                  f"{rows[-1]['user_s']:.1f} s user, {rows[-1]['system_s']:.2f} s system CPU", flush=True)
        t = time.perf_counter()
        loop.evaluate()
        eval_s = time.perf_counter() - t
        stats = dict(executor.stats) if executor is not None else {}
    finally:
        loop.executor.teardown()
        loop.reporter.release()
    timed = rows[1:]
    out: dict[str, Any] = {
        "workload": args.workload, "mode": args.mode, "workers": args.workers if args.mode == "ray" else 1,
        "accelerator": args.accelerator, "gpus_per_worker": args.gpus_per_worker if args.mode == "ray" else None,
        "threads": args.threads if args.mode == "inprocess" else 1, "malloc_tuning": bool(tuned),
        "client_state_codec": args.codec,
        "data": "cifar10" if args.data_root else "synthetic", "rounds_timed": len(timed),
        "round_s_median": statistics.median(r["wall_s"] for r in timed),
        "system_cpu_s_per_round": statistics.mean(r["system_s"] for r in timed),
        "user_cpu_s_per_round": statistics.mean(r["user_s"] for r in timed),
        "evaluate_s": eval_s, "setup_s": setup_s, "rounds": rows,
    }
    if executor is not None:
        fits = max(stats.get("fits", 0), 1)
        out.update({"ray_startup_s": executor.startup_s, "fits": stats.get("fits", 0),
                    "fit_overhead_ms_mean": 1000 * stats.get("fit_overhead_s", 0.0) / fits,
                    "worker_busy_share": stats.get("worker_fit_s", 0.0) / max(
                        stats.get("run_wall_s", 0.0) * args.workers, 1e-9)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=["one", "all"])
    ap.add_argument("--workload", choices=["lenet", "dispfl"], default="lenet")
    ap.add_argument("--mode", choices=["inprocess", "ray"], default="inprocess")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="in-process torch threads")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--malloc", choices=["on", "off"], default="on")
    ap.add_argument("--codec", choices=["none", "lossless"], default="none", help="trainer.client_state_codec")
    ap.add_argument("--data-root", default=None, help="CIFAR-10 folder (synthetic data of the same shape if omitted)")
    ap.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu", help="trainer.accelerator (one)")
    ap.add_argument("--gpus-per-worker", type=float, default=0.0,
                    help="RayExecutor num_gpus_per_worker (fractions share one GPU; one, --mode ray)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "scale_out" / "ray_speedup.json")
    args = ap.parse_args()
    if args.verb == "one":
        print(json.dumps(one(args)))
        return
    matrix = [("lenet", "inprocess", "on"), ("lenet", "ray", "on"), ("dispfl", "inprocess", "off"),
              ("dispfl", "inprocess", "on"), ("dispfl", "ray", "on")]
    results = []
    for workload, mode, malloc in matrix:
        cmd = [sys.executable, __file__, "one", "--workload", workload, "--mode", mode, "--malloc", malloc,
               "--workers", str(args.workers), "--threads", str(args.threads), "--rounds", str(args.rounds)]
        if args.data_root:
            cmd += ["--data-root", args.data_root]
        print(f"== {workload} {mode} malloc={malloc}", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GLIBC_TUNABLES")}
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise SystemExit(res.stderr[-3000:])
        print("\n".join(line for line in res.stdout.splitlines() if line.startswith("  round")))
        results.append(json.loads(res.stdout.strip().splitlines()[-1]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    by = {(r["workload"], r["mode"], r["malloc_tuning"]): r for r in results}
    print("\n| workload | mode | malloc tuning | s/round (median) | system CPU s/round | evaluate s | Ray start-up s | "
          "per-fit overhead ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['workload']} | {r['mode']} ({r['workers']}×{r['threads']} thr) | {r['malloc_tuning']} | "
              f"{r['round_s_median']:.2f} | {r['system_cpu_s_per_round']:.2f} | {r['evaluate_s']:.2f} | "
              f"{r.get('ray_startup_s', float('nan')):.1f} | {r.get('fit_overhead_ms_mean', float('nan')):.0f} |")
    for w in ("lenet", "dispfl"):
        a, b = by.get((w, "inprocess", True)), by.get((w, "ray", True))
        if a and b:
            print(f"{w}: speed-up with {b['workers']} Ray workers = {a['round_s_median'] / b['round_s_median']:.2f}x "
                  f"(evaluation {a['evaluate_s'] / b['evaluate_s']:.2f}x)")
    a, b = by.get(("dispfl", "inprocess", False)), by.get(("dispfl", "inprocess", True))
    if a and b:
        print(f"dispfl allocator tuning: {a['round_s_median']:.2f} -> {b['round_s_median']:.2f} s/round, system CPU "
              f"{a['system_cpu_s_per_round']:.2f} -> {b['system_cpu_s_per_round']:.2f} s/round")


if __name__ == "__main__":
    main()
