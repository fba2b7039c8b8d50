"""Each paper's Table-1 config on one GPU, all at once, for as many rounds as a time box allows.

A lent GPU comes with minutes, not the hours a paper's full run needs (``benchmarks/gpu/README.md``). This script
spends them on the papers' own settings: the five shipped paper configs (pFedGate, FedSpa-DST, DisPFL, DM-PFL at
CIFAR-10 scale; FedPSE at Fashion-MNIST's full training split) start together on the GPU (``--data.device cuda``),
each with the config's own ``num_rounds``, an evaluation schedule that gives accuracy points inside the box, no
intermediate checkpoints and no TensorBoard files. After ``--seconds`` every run still going gets SIGTERM (the
engine's clean stop: the rounds done are in ``metrics.jsonl``). ``nvidia-smi`` samples the shared GPU every 250 ms.

    python benchmarks/gpu_paper_runs.py run --seconds 390            # on the lent machine (recorded ones skipped)
    python benchmarks/gpu_paper_runs.py table                        # rounds reached, accuracy at the last evaluation
    python benchmarks/gpu_paper_runs.py dry-run                      # the commands resolve (no GPU, no data)

Records: ``benchmarks/gpu/paper_runs/<name>/{config.yaml,metrics.jsonl,summary.json}`` (summary only for a run that
reached its config's last round), the shared ``gpu.csv``, and one line per run in ``benchmarks/gpu/paper_runs.jsonl``.
The runs share the GPU and the machine's CPU cores (and, in the suite, the GPU tests), so their seconds per round are
not a speed record (``gpu_rounds.py`` times each config alone); what these records are for is the accuracy a paper's
setting reaches after the rounds done, read beside the paper's table on each reproduction page.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from gpu_rounds import GpuSampler, _device_name, resolve

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "gpu"  # the records' folder (--out)

#: name -> (shipped config, dataset, evaluate every this many rounds inside the box, extra arguments, page). The
#: evaluation schedules are shorter than the configs' own where those would give no point inside a few minutes
#: (one H100, 2026-11: a pFedGate round ~8 s, FedSpa ~20 s, DisPFL > 140 s, DM-PFL ~6 s, FedPSE at the full
#: Fashion-MNIST split ~10 s); FedPSE drops the config's CPU-sized training subset (the paper trains on all of it).
PAPERS: dict[str, tuple[str, str, int, tuple[str, ...], str]] = {
    "pfedgate": ("cifar10_pfedgate.yaml", "cifar10", 5, (), "papers/pfedgate/README.md"),
    "fedspa_dst": ("cifar10_fedspa_dst.yaml", "cifar10", 5, (), "papers/fedspa/README.md"),
    "dispfl": ("cifar10_dispfl.yaml", "cifar10", 1, (), "papers/dispfl/README.md"),
    "dmpfl": ("cifar10_dmpfl.yaml", "cifar10", 10, (), "papers/dmpfl/README.md"),
    "fedpse": ("fmnist_fedpse.yaml", "fmnist", 2, ("--data.max_train_samples", "null"), "papers/fedpse/README.md"),
}


def fit_args(name: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``pl-fed fit`` arguments of one paper run: the shipped config and its rounds, on the GPU."""
    config, dataset, every, extra, _ = PAPERS[name]
    root = args.data_root if dataset == "cifar10" else args.fmnist_root
    return ["fit", "--config", str(ROOT / "configs" / config), "--data.root", str(root),
            "--trainer.accelerator", args.accelerator, "--data.device", "cuda" if args.accelerator == "gpu" else "cpu",
            "--trainer.eval_every", str(every), "--trainer.checkpoint_every", "0", "--trainer.logger", "false",
            "--trainer.default_root_dir", str(run_dir), "--trainer.overwrite", "true", *extra]


def config_rounds(name: str) -> int:
    """The shipped config's ``trainer.num_rounds`` (the paper's horizon, or the config's CPU-sized one)."""
    cfg = yaml.safe_load((ROOT / "configs" / PAPERS[name][0]).read_text())
    return int(cfg.get("trainer", {}).get("num_rounds", 1))


def summarise(name: str, rows: list[dict[str, Any]], wall_s: float, rc: int) -> dict[str, Any]:
    """Rounds done and the accuracy at the last evaluation, from a run's ``metrics.jsonl`` rows."""
    evaluated = [r for r in rows if r.get("evaluated") and r.get("acc_mean") is not None]
    last = evaluated[-1] if evaluated else {}
    return {"name": name, "config": PAPERS[name][0], "page": PAPERS[name][4], "rounds_done": len(rows),
            "config_num_rounds": config_rounds(name), "eval_every": PAPERS[name][2], "wall_s": round(wall_s, 1),
            "exit_code": rc, "last_eval_round": last.get("round"), "acc_mean": last.get("acc_mean"),
            "acc_weighted": last.get("acc_weighted"), "global_acc": last.get("global_acc"),
            "train_s_per_round_median": sorted(r["time_train_s"] for r in rows)[len(rows) // 2] if rows else None}


def _ledger(out: Path) -> list[dict[str, Any]]:
    ledger = out / "paper_runs.jsonl"
    return [json.loads(x) for x in ledger.read_text().splitlines() if x.strip()] if ledger.exists() else []


def run(args: argparse.Namespace) -> None:
    out = Path(args.out)
    runs_dir = out / "paper_runs"
    recorded = {r["name"] for r in _ledger(out)}
    names = [n for n in args.only or list(PAPERS) if args.force or n not in recorded]
    for name in sorted(set(args.only or PAPERS) - set(names)):
        print(f"{name}: recorded already (benchmarks/gpu/paper_runs.jsonl); --force re-runs it", flush=True)
    roots = {"cifar10": Path(args.data_root), "fmnist": Path(args.fmnist_root)}
    for name in list(names):  # a paper whose data are missing is skipped, not recorded as a failed run
        root = roots[PAPERS[name][1]]
        if not root.is_dir():
            print(f"{name}: skipped: no {PAPERS[name][1]} data at {root} (--data-root / --fmnist-root)", flush=True)
            names.remove(name)
    if not names:
        table(out)
        return
    runs_dir.mkdir(parents=True, exist_ok=True)
    sampler = GpuSampler(runs_dir / "gpu.csv")
    procs: dict[str, tuple[subprocess.Popen, float]] = {}
    for name in names:
        cmd = [sys.executable, "-m", "pl_fedsparse.cli", *fit_args(name, args, runs_dir / name)]
        print("$", " ".join(cmd[2:]), flush=True)
        log = (runs_dir / f"{name}.log").open("w")
        procs[name] = (subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True), time.perf_counter())
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline and any(p.poll() is None for p, _ in procs.values()):
        time.sleep(2)
    for p, _ in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # the engine's clean stop: the rounds done stay in metrics.jsonl
    grace = time.perf_counter() + args.grace
    while time.perf_counter() < grace and any(p.poll() is None for p, _ in procs.values()):
        time.sleep(1)
    for p, _ in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    gpu = sampler.stop()
    device = _device_name()
    kept = [r for r in _ledger(out) if r["name"] not in procs]  # a --force re-run replaces its old line
    with (out / "paper_runs.jsonl").open("w") as ledger:
        for r in kept:
            ledger.write(json.dumps(r) + "\n")
        for name, (p, t0) in procs.items():
            run_dir = runs_dir / name
            for ckpt in run_dir.glob("**/*.ckpt"):  # records only
                ckpt.unlink()
            metrics = run_dir / "metrics.jsonl"
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
            line = {**summarise(name, rows, time.perf_counter() - t0, p.returncode), "device": device,
                    "concurrent": names, "seconds": args.seconds, **gpu}
            ledger.write(json.dumps(line) + "\n")
            print(json.dumps(line), flush=True)
    table(out)


def table(out: Path = OUT) -> None:
    if not (out / "paper_runs.jsonl").exists():
        return
    print("\n| paper config | device | rounds done / config's | last evaluated round | personal acc % | "
          "global acc % | train s/round (shared GPU) |")
    print("|---|---|---|---|---|---|---|")

    def pct(v: Any) -> str:
        return "—" if v is None else f"{100 * v:.2f}"

    for r in _ledger(out):
        rnd = "—" if r["last_eval_round"] is None else str(r["last_eval_round"] + 1)
        tr = "—" if r["train_s_per_round_median"] is None else f"{r['train_s_per_round_median']:.1f}"
        print(f"| {r['config']} | {r['device']} | {r['rounds_done']} / {r['config_num_rounds']} | {rnd} | "
              f"{pct(r['acc_mean'])} | {pct(r['global_acc'])} | {tr} |")


def dry_run(args: argparse.Namespace) -> None:
    """Every paper run's command resolves (``--print_config``) without a GPU or the data."""
    for name in args.only or list(PAPERS):
        cpu = argparse.Namespace(**{**vars(args), "accelerator": "cpu"})
        argv = fit_args(name, cpu, Path(args.out) / "paper_runs" / name)
        resolved = resolve(argv, f"gpu_paper_runs: {name}")
        assert resolved["trainer"]["num_rounds"] == config_rounds(name), name
        assert resolved["trainer"]["eval_every"] == PAPERS[name][2], name
        print(f"{name}: {PAPERS[name][0]} resolves ({config_rounds(name)} rounds, eval every {PAPERS[name][2]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=["run", "dry-run", "table"])
    ap.add_argument("--only", nargs="*", choices=list(PAPERS), default=None)
    ap.add_argument("--data-root", default=os.environ.get("CIFAR10_ROOT", "data/cifar10"))
    ap.add_argument("--fmnist-root", default=os.environ.get("FMNIST_ROOT", "/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--seconds", type=float, default=390.0, help="the time box: SIGTERM to every run still going")
    ap.add_argument("--grace", type=float, default=45.0, help="seconds a stopped run gets to exit before SIGKILL")
    ap.add_argument("--out", default=str(OUT), help="the records' folder (default benchmarks/gpu)")
    ap.add_argument("--force", action="store_true", help="re-run the papers recorded already (their lines replaced)")
    args = ap.parse_args()
    if args.seconds <= 0 or args.grace < 0:
        ap.error(f"--seconds={args.seconds} / --grace={args.grace}: expected seconds > 0 and grace >= 0")
    if args.verb == "run":
        run(args)
    elif args.verb == "table":
        table(Path(args.out))
    else:
        dry_run(args)


if __name__ == "__main__":
    main()
