"""Seconds per round and GPU utilisation of each method's paper config, with the estimate for the paper's full run.

For each config, ``pl-fed fit`` runs the shipped config on the GPU (``--data.device cuda``: the clients' tensors live
on the GPU) for a few rounds, with evaluation every ``--eval-every`` rounds so that both costs appear, while
``nvidia-smi`` samples the GPU's utilisation and memory every 250 ms. A run that outlasts ``--seconds`` is stopped
with SIGTERM (the engine's clean stop: the rounds done so far are in ``metrics.jsonl``). From the rows:

* training seconds per round: the median ``time_train_s``;
* evaluation seconds: the median ``time_s - time_train_s`` of the evaluated rounds before the last; the last round's
  extra (a config's ``when: last`` evaluations, e.g. DM-PFL's 51 shift/corruption views) is reported apart;
* the full run's estimate: ``num_rounds × train + (num_rounds // eval_every) × evaluation + last-round extra`` with
  the config's own ``num_rounds`` and ``eval_every``; where rounds end with fits for every client (DM-PFL's personal
  refinement after each Phase 2 block: a 4-round run has two, the paper's 300 rounds two in all), ``train`` is the
  median of the other rounds and the refinement's extra is added as often as the paper's schedule has it.

    python benchmarks/gpu_rounds.py run --data-root data/cifar10 --fmnist-root /usr/share/datasets/fashion-mnist
    python benchmarks/gpu_rounds.py run --only dmpfl --rounds 4 --seconds 240
    python benchmarks/gpu_rounds.py dry-run          # the commands parse and the configs resolve (no GPU needed)
    python benchmarks/gpu_rounds.py run --only pfedgate --tag ray8 -- --trainer.executor RayExecutor \
        --trainer.executor.num_workers 8 --trainer.executor.num_gpus_per_worker 0.125   # 8 workers sharing the GPU

Each config's records (``config.yaml``, ``metrics.jsonl``, ``summary.json``, the utilisation samples) go to
``benchmarks/gpu/rounds/<name>/`` and one line per config to ``benchmarks/gpu/rounds.jsonl``; a config whose line is
there already is skipped (``--force`` re-runs it), so an interrupted suite resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "gpu"

#: name -> (shipped config, dataset) — the seed methods' paper configs and the FedAvg baseline.
CONFIGS: dict[str, tuple[str, str]] = {
    "fedavg": ("cifar10_fedavg.yaml", "cifar10"),
    "pfedgate": ("cifar10_pfedgate.yaml", "cifar10"),
    "fedspa_dst": ("cifar10_fedspa_dst.yaml", "cifar10"),
    "dispfl": ("cifar10_dispfl.yaml", "cifar10"),
    "dmpfl": ("cifar10_dmpfl.yaml", "cifar10"),
    "fedpse": ("fmnist_fedpse.yaml", "fmnist"),
}


#: seconds before SIGTERM where the default is too short for a few rounds (one H100, 2026-11: a DisPFL round of 100
#: ResNet-18 clients takes more than 140 s, a FedSpa round about 20 s; benchmarks/gpu/README.md)
SECONDS: dict[str, float] = {"dispfl": 400.0, "fedspa_dst": 150.0}
# the fewest rounds a config's schedule accepts (DM-PFL's DualMask: 2 phases x its 2 iterations, a round each)
MIN_ROUNDS: dict[str, int] = {"dmpfl": 4}


def rounds_for(name: str, asked: int) -> int:
    """``asked`` rounds, raised to what ``name``'s config needs to run at all (``MIN_ROUNDS``)."""
    return max(asked, MIN_ROUNDS.get(name, 1))


def fit_args(name: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``pl-fed fit`` arguments of one timed run (the shipped config, a few rounds, on the GPU)."""
    config, dataset = CONFIGS[name]
    root = args.data_root if dataset == "cifar10" else args.fmnist_root
    return ["fit", "--config", str(ROOT / "configs" / config), "--data.root", str(root),
            "--trainer.accelerator", args.accelerator, "--data.device", "cuda" if args.accelerator == "gpu" else "cpu",
            "--trainer.precision", args.precision, "--trainer.num_rounds", str(rounds_for(name, args.rounds)),
            "--trainer.eval_every", str(args.eval_every), "--trainer.default_root_dir", str(run_dir),
            "--trainer.overwrite", "true"]


def paper_schedule(name: str) -> tuple[int, int]:
    """The shipped config's own ``(num_rounds, eval_every)`` (what the estimate extrapolates to)."""
    cfg = yaml.safe_load((ROOT / "configs" / CONFIGS[name][0]).read_text())
    trainer = cfg.get("trainer", {})
    return int(trainer.get("num_rounds", 1)), int(trainer.get("eval_every", 1))


class GpuSampler:
    """``nvidia-smi`` sampling utilisation (%) and memory (MiB) every 250 ms into a CSV file."""

    def __init__(self, path: Path) -> None:
        self.path, self.proc = path, None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "250"], stdout=path.open("w"), stderr=subprocess.DEVNULL)

    def stop(self) -> dict[str, float | None]:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
        util, mem = [], []
        for line in self.path.read_text().splitlines() if self.path.exists() else []:
            parts = [p.strip() for p in line.split(",")]
            try:
                util.append(float(parts[1]))
                mem.append(float(parts[2]))
            except (IndexError, ValueError):
                continue
        busy = util[2:-2] if len(util) > 8 else util  # start-up and shutdown samples are idle by construction
        return {"gpu_util_mean": statistics.fmean(busy) if busy else None,
                "gpu_util_median": statistics.median(busy) if busy else None,
                "gpu_mem_max_mib": max(mem) if mem else None, "gpu_samples": len(util)}


def refinement_rule(name: str) -> Callable[[int, int], bool] | None:
    """Which rounds of a ``num_rounds``-round run end with fits for every client (DM-PFL's personal refinement,
    Alg. 3, after each Phase 2 block), from the config's own callback (``refines_personal_after``); ``None`` for a
    config without such rounds. A timed run of a few rounds has them far more often than the paper's run."""
    import importlib
    from types import SimpleNamespace

    cfg = yaml.safe_load((ROOT / "configs" / CONFIGS[name][0]).read_text())
    for spec in cfg.get("trainer", {}).get("callbacks", []) or []:
        module, _, cls_name = str(spec.get("class_path", "")).rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name, None) if module else None
        if cls is not None and hasattr(cls, "refines_personal_after"):
            callback = cls(**(spec.get("init_args") or {}))
            return lambda total, r: bool(callback.refines_personal_after(SimpleNamespace(num_rounds=total), r))
    return None


def summarise(name: str, rows: list[dict[str, Any]], wall_s: float, rc: int,
              timed_rounds: int | None = None) -> dict[str, Any]:
    """Seconds per round, evaluation seconds and the full-run estimate from a run's ``metrics.jsonl`` rows.

    Where the config has rounds that end with fits for every client (:func:`refinement_rule`), the training time is
    split: ``train_s_per_round`` is the median of the other rounds, ``refine_extra_s`` the median extra of those
    rounds, and the estimate counts that extra as often as the paper's schedule has it (``refine_rounds_paper``).
    """
    num_rounds, eval_every = paper_schedule(name)
    out: dict[str, Any] = {"name": name, "config": CONFIGS[name][0], "rounds_done": len(rows), "wall_s": wall_s,
                           "exit_code": rc, "paper_num_rounds": num_rounds, "paper_eval_every": eval_every}
    if not rows:
        return out
    rule = refinement_rule(name) if timed_rounds else None
    refining = [rule(timed_rounds, r["round"]) for r in rows] if rule is not None else [False] * len(rows)
    plain = [r["time_train_s"] for r, ref in zip(rows, refining) if not ref]
    train = statistics.median(plain) if plain else statistics.median(r["time_train_s"] for r in rows)
    refine_extra, refine_paper = 0.0, 0
    if rule is not None and plain and any(refining):
        refine_extra = statistics.median(r["time_train_s"] for r, ref in zip(rows, refining) if ref) - train
        refine_paper = sum(rule(num_rounds, r) for r in range(num_rounds))
        out.update({"refine_extra_s": refine_extra, "refine_rounds_paper": refine_paper})
    # a completed run's last round carries the config's `when: last` evaluations too: it is reported apart
    evals = [r["time_s"] - r["time_train_s"] for r in (rows[:-1] if rc == 0 else rows) if r.get("evaluated")]
    evaluation = statistics.median(evals) if evals else None
    last_extra = rows[-1]["time_s"] - rows[-1]["time_train_s"] - (evaluation or 0.0) \
        if rows[-1].get("evaluated") and rc == 0 else None
    out.update({"train_s_per_round": train, "eval_s": evaluation, "last_round_extra_s": last_extra,
                "round_s_median": statistics.median(r["time_s"] for r in rows)})
    if evaluation is not None:
        out["full_run_estimate_h"] = (num_rounds * train + refine_paper * refine_extra
                                      + (num_rounds // eval_every) * evaluation + (last_extra or 0.0)) / 3600
    acc = [r["acc_mean"] for r in rows if r.get("evaluated") and r.get("acc_mean") is not None]
    out["acc_mean_last"] = acc[-1] if acc else None
    return out


def run(args: argparse.Namespace) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    ledger = OUT / "rounds.jsonl"
    done = {json.loads(x)["name"] for x in ledger.read_text().splitlines()} if ledger.exists() else set()
    for name in args.only or list(CONFIGS):
        key = f"{name}+{args.tag}" if args.tag else name  # (a tagged run is recorded beside the plain one)
        if key in done and not args.force:
            print(f"{key}: recorded already (benchmarks/gpu/rounds.jsonl); --force re-runs it", flush=True)
            continue
        run_dir = OUT / "rounds" / key
        # an earlier run's rows must not be read as this one's (a run that fails before its first round writes none)
        for old in ("metrics.jsonl", "summary.json"):
            (run_dir / old).unlink(missing_ok=True)
        if rounds_for(name, args.rounds) != args.rounds:
            print(f"{name}: {rounds_for(name, args.rounds)} rounds (its schedule needs at least that many)", flush=True)
        cmd = [sys.executable, "-m", "pl_fedsparse.cli", *fit_args(name, args, run_dir), *args.extra]
        print("$", " ".join(cmd[2:]), flush=True)
        sampler_path = OUT / "rounds" / f"{key}.gpu.csv"
        sampler_path.parent.mkdir(parents=True, exist_ok=True)
        sampler = GpuSampler(sampler_path)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT)
        try:
            rc = proc.wait(timeout=args.seconds or SECONDS.get(name, 90.0))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # the engine's clean stop (exit 143, rounds so far in metrics.jsonl)
            rc = proc.wait()
        wall = time.perf_counter() - t0
        gpu = sampler.stop()
        if sampler_path.exists() and run_dir.exists():
            shutil.move(sampler_path, run_dir / "gpu.csv")
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
        line = {**summarise(name, rows, wall, rc, rounds_for(name, args.rounds)), **gpu, "accelerator": args.accelerator,
                "precision": args.precision, "device": _device_name()}
        if args.tag or args.extra:
            line.update({"name": key, "extra_args": list(args.extra)})
        for ckpt in run_dir.glob("**/*.ckpt"):  # records only: checkpoints are large and not needed to read them
            ckpt.unlink()
        with ledger.open("a") as f:
            f.write(json.dumps(line) + "\n")
        print(json.dumps(line), flush=True)
    table()


def _device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - a name for the record only
        return "unknown"


def table() -> None:
    ledger = OUT / "rounds.jsonl"
    if not ledger.exists():
        return
    print("\n| config | rounds timed | train s/round | eval s | last-round extra s | GPU util % (mean) | "
          "GPU mem MiB | paper rounds | full-run estimate h |")
    print("|---|---|---|---|---|---|---|---|---|")

    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "—" if v is None else fmt.format(v)

    for line in ledger.read_text().splitlines():
        r = json.loads(line)
        print(f"| {r['config']} | {r['rounds_done']} | {f(r.get('train_s_per_round'))} | {f(r.get('eval_s'))} | "
              f"{f(r.get('last_round_extra_s'))} | {f(r.get('gpu_util_mean'), '{:.0f}')} | "
              f"{f(r.get('gpu_mem_max_mib'), '{:.0f}')} | {r['paper_num_rounds']} | "
              f"{f(r.get('full_run_estimate_h'))} |")


def resolve(argv: list[str], who: str) -> dict[str, Any]:
    """The configuration ``pl-fed`` resolves from ``argv`` (``--print_config``: no data, no device); a command that
    does not resolve stops with one line naming ``who``."""
    from contextlib import redirect_stdout
    from io import StringIO

    from pl_fedsparse.cli import main as cli_main

    buf = StringIO()
    try:
        with redirect_stdout(buf):
            code = cli_main([*argv, "--print_config"])  # a ConfigError: its line on stderr, a non-zero return
    except SystemExit as e:  # the parser's own errors
        code = e.code
    if code not in (0, None):
        raise SystemExit(f"{who}: the command does not resolve (exit {code})")
    return yaml.safe_load(buf.getvalue())


def dry_run(args: argparse.Namespace) -> None:
    """Every timed run's command resolves (``--print_config``) without a GPU or the data."""
    for name in args.only or list(CONFIGS):
        argv = [*fit_args(name, args, OUT / "rounds" / name), *args.extra]
        argv[argv.index("--data.device") + 1] = "cpu"  # data.device cuda is refused where CUDA is absent
        argv[argv.index("--trainer.accelerator") + 1] = "cpu"
        resolved = resolve(argv, f"gpu_rounds: {name}")
        rounds = rounds_for(name, args.rounds)
        assert resolved["trainer"]["num_rounds"] == rounds, name
        print(f"{name}: {CONFIGS[name][0]} resolves ({rounds} rounds, eval every {args.eval_every})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=["run", "dry-run", "table"])
    ap.add_argument("--only", nargs="*", choices=list(CONFIGS), default=None)
    ap.add_argument("--data-root", default=os.environ.get("CIFAR10_ROOT", "data/cifar10"))
    ap.add_argument("--fmnist-root", default=os.environ.get("FMNIST_ROOT", "/usr/share/datasets/fashion-mnist"))
    ap.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--rounds", type=int, default=6, help="rounds per timed run (the last one is the final round)")
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=None,
                    help="SIGTERM a run after this many seconds (default: 90, DisPFL 400, FedSpa 150)")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--tag", default="", help="record the runs as NAME+TAG (beside the plain runs), e.g. with "
                    "other executor arguments after --")
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:  # arguments after -- go to every run's pl-fed fit unchanged
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = ap.parse_args(argv)
    args.extra = extra
    if args.tag and not all(c.isalnum() or c in "-_." for c in args.tag):
        ap.error(f"--tag={args.tag!r} is invalid; expected letters, digits, '-', '_' or '.'")
    {"run": run, "dry-run": dry_run, "table": lambda a: table()}[args.verb](args)


if __name__ == "__main__":
    main()
