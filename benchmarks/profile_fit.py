"""Where a client fit's time goes: one round of a config's client fits, profiled two ways.

On a GPU a paper-config client fit is mostly host work (``benchmarks/gpu/README.md``: a FedSpa step of ResNet-18 took
~100 ms on an H100 whose arithmetic for it takes a few ms; the device was 3-6 % busy). This script says where that
time goes. It builds the config's federation exactly as ``pl-fed fit`` does (``FedCLI``), runs one warm-up round
(CUDA and cuDNN initialisation, first-touch allocations), then one round under :mod:`cProfile` and one under
:mod:`torch.profiler`, with ``--clients`` clients per round (default 1: a single fit, so the profile is small):

* **by package** (cProfile self time): Lightning, the engine's callbacks, the rest of the engine, torch's optimizers,
  data loading, the rest of torch, torchmetrics, built-ins (which include the waits on the device: ``.item()``,
  ``.cpu()``, synchronising copies) — the share of the round each spends in its own code;
* **the device** (torch.profiler): the time the GPU executed kernels against the round's wall time (how busy it
  was), and how many host-device synchronisations the round made;
* the top functions and operators by self time.

    python benchmarks/profile_fit.py --config configs/cifar10_fedspa_dst.yaml --accelerator gpu \\
        --data-root data/cifar10 -- --data.device cuda
    python benchmarks/profile_fit.py --config configs/cifar10_fedspa_dst_cpu.yaml --accelerator cpu \\
        --data-root data/cifar10 --out benchmarks/_runs/profile_fit         # the CPU's view of the same fit

Arguments after ``--`` go to the CLI unchanged (any ``pl-fed fit`` override). ``--out DIR`` also writes the cProfile
statistics (``fit.pstats``, for ``snakeviz`` or ``pstats``) and the operator table (``ops.txt``).
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

import torch

from pl_fedsparse.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent

#: (label, path fragment) in order: the first fragment found in a function's file names its package
PACKAGES = [
    ("Lightning", "lightning"),
    ("engine callbacks", "pl_fedsparse/callbacks"),
    ("engine (loop, executors, accounting, ...)", "pl_fedsparse"),
    ("torch optimizers", "torch/optim"),
    ("data loading (torch.utils.data, torchvision)", "torch/utils/data"),
    ("data loading (torch.utils.data, torchvision)", "torchvision"),
    ("torchmetrics", "torchmetrics"),
    ("torch (autograd, nn, tensors)", "torch"),
    ("built-ins (C calls: kernels launched, waits on the device)", "~"),
]


def package_of(filename: str) -> str:
    for label, fragment in PACKAGES:
        if fragment in filename:
            return label
    return "other Python"


def fit_args(config: str, accelerator: str, data_root: str | None, clients: int, extra: list[str],
             tmp: str) -> list[str]:
    """The ``pl-fed fit`` arguments of the profiled federation (no evaluation, no checkpoints, no logger)."""
    args = ["--config", config, "--trainer.default_root_dir", tmp, "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.accelerator", accelerator,
            "--trainer.clients_per_round", str(clients), "--trainer.eval_every", "1000000",
            "--trainer.checkpoint_every", "0", "--trainer.overwrite", "true"]
    if data_root is not None:
        args += ["--data.root", data_root]
    return [*args, *extra]


def build(config: str, accelerator: str, data_root: str | None, clients: int, extra: list[str], tmp: str):
    """The federation of ``config`` as ``pl-fed fit`` builds it, set up, nothing trained."""
    from pl_fedsparse.cli import FedCLI

    cli = FedCLI(args=fit_args(config, accelerator, data_root, clients, extra, tmp), run=False)
    loop = cli.trainer
    loop.setup(cli.model, cli.datamodule)
    return loop


def by_package(stats: pstats.Stats) -> list[tuple[str, float]]:
    """cProfile self time summed by :data:`PACKAGES` label, largest first."""
    totals: dict[str, float] = defaultdict(float)
    entries = stats.stats.items()  # type: ignore[attr-defined]
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in entries:
        totals[package_of(filename)] += tottime
    return sorted(totals.items(), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a config file or a shipped config's name")
    ap.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu"])
    ap.add_argument("--data-root", default=None, help="data.root (default: the config's)")
    ap.add_argument("--clients", type=int, default=1, help="clients per profiled round (default 1: one fit)")
    ap.add_argument("--top", type=int, default=15, help="rows of the function and operator tables (default 15)")
    ap.add_argument("--out", type=Path, default=None, help="also write fit.pstats and ops.txt here")
    ap.add_argument("--dry-run", action="store_true",
                    help="only check that the command resolves (no data, no device, nothing run)")
    args = ap.parse_args(argv)
    if args.clients < 1:
        ap.error(f"--clients={args.clients} is invalid; expected a whole number >= 1")
    if args.top < 1:
        ap.error(f"--top={args.top} is invalid; expected a whole number >= 1")
    if args.dry_run:  # on the CPU: data.device cuda is refused where CUDA is absent
        from gpu_rounds import resolve

        argv_ = fit_args(args.config, "cpu", args.data_root, args.clients,
                         [x if x != "cuda" else "cpu" for x in extra], "benchmarks/_runs/profile_fit")
        resolved = resolve(["fit", *argv_], f"profile_fit: {args.config}")
        print(f"profile_fit: {args.config} resolves (clients per round: {resolved['trainer']['clients_per_round']})")
        return 0
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        print("error: profile_fit.py: --accelerator gpu, but torch.cuda.is_available() is false; use --accelerator cpu",
              file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    cuda = args.accelerator != "cpu" and torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        try:
            loop = build(args.config, args.accelerator, args.data_root, args.clients, extra, tmp)
        except ConfigError as e:  # a bad config, path or value: its one line, no traceback
            print(f"error: profile_fit.py: {e}", file=sys.stderr)
            return 2
        print(f"config {args.config}: {loop.num_clients} clients, {args.clients} per round, device "
              f"{torch.cuda.get_device_name() if cuda else 'cpu'}; set up in {time.perf_counter() - t:.1f} s")
        t = time.perf_counter()
        loop.run_round(0)  # warm-up
        sync()
        print(f"warm-up round: {time.perf_counter() - t:.2f} s")

        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        loop.run_round(1)
        sync()
        prof.disable()
        wall_cprofile = time.perf_counter() - t
        stats = pstats.Stats(prof)
        print(f"\nround under cProfile: {wall_cprofile:.2f} s (profiling slows Python-heavy code; read shares)")
        print("| package | self s | share % |\n|---|---|---|")
        packages = by_package(stats)
        total = sum(secs for _label, secs in packages)
        for label, secs in packages:
            print(f"| {label} | {secs:.3f} | {100 * secs / total:.1f} |")
        print(f"\ntop {args.top} functions by self time:")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]  # type: ignore[attr-defined]
        for (filename, line, name), (_cc, ncalls, tottime, cumtime, _c) in rows:
            where = filename if filename == "~" else "/".join(Path(filename).parts[-3:])
            print(f"  {tottime:8.3f} s self {cumtime:8.3f} s cum {ncalls:8d} calls  {name}  ({where}:{line})")

        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        sync()
        t = time.perf_counter()
        with profile(activities=activities) as tprof:
            loop.run_round(2)
            sync()
        wall = time.perf_counter() - t
        events = tprof.key_averages()
        print(f"\nround under torch.profiler: {wall:.2f} s")
        if cuda:
            # kernels only: a user annotation on the device timeline (e.g. Optimizer.step's record_function) spans
            # the kernels it launched and the gaps between them, and counting it would double the busy time
            kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                            and not getattr(e, "is_user_annotation", False))
            busy = kernel_us / 1e6
            print(f"GPU kernels: {busy:.3f} s of {wall:.2f} s wall = {100 * busy / wall:.1f} % busy")
            syncs = {e.key: e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                                  "cudaMemcpyAsync", "cudaMemcpy",
                                                                  "cudaLaunchKernel", "cudaEventSynchronize")}
            print("host-device calls: " + ", ".join(f"{k} x{v}" for k, v in sorted(syncs.items())))
        table = events.table(sort_by="self_cpu_time_total", row_limit=args.top)
        print(f"\ntop {args.top} operators by self CPU time:\n{table}")
        loop.reporter.release()
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            stats.dump_stats(str(args.out / "fit.pstats"))
            (args.out / "ops.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=100))
            print(f"written: {args.out / 'fit.pstats'}, {args.out / 'ops.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
