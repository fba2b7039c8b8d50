"""FedPSE's Fashion-MNIST tables (paper Table 1 FMNIST block, Table 2 FMNIST column) on this CPU.

Three steps, each resumable (a finished run is never redone; two workers share a plan by claiming runs)::

    # 1. the lr x batch sweep on validation data (5 clients, lambda = 0.5, 12k-image subset, 3 rounds)
    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run sweep &   # start two workers on two cores
    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run sweep &
    python papers/fedpse/fedpse_tables.py choose          # best (lr, batch) per method -> sweep.json
    # 2. the tables at the paper's scale (whole training split), with each method's chosen lr and batch
    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run tables &
    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run tables &
    # 3. the markdown tables: every run, and the paper-shaped tables next to the paper's numbers
    python papers/fedpse/fedpse_tables.py report
    python papers/fedpse/fedpse_tables.py paper

These tables use the literal reading of the paper's λ split, every client's share of the heterogeneous part sorted
by label (``--data.noniid_order sorted``; at λ = 1 with 10 clients every client holds one label). The configs now
default to the paper's protocol, the Flower split it follows (``noniid_order: halves``: about five labels per client
at λ = 1); the runs of that protocol are a plan of their own, recorded under ``papers/fedpse/records/fedpse_protocol/``::

    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run protocol   # FedPSE and FedAvg, 10 clients, 3 seeds
    python papers/fedpse/fedpse_tables.py protocol                         # its table

The same plan under the literal reading, ``--order sorted``, is recorded under
``papers/fedpse/records/fedpse_protocol_sorted/``; ``--seeds`` runs other seeds than 0-2 (either plan)::

    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run protocol --order sorted
    OMP_NUM_THREADS=1 python papers/fedpse/fedpse_tables.py run protocol --seeds 3 4 --lams 0.5   # λ = 0.5 only
    python papers/fedpse/fedpse_tables.py protocol --order sorted --seeds 0 1 2 3 4

``FEDPSE_TABLES_CODE=<checkout>`` runs the CLI from another checkout (a worktree pinned at one commit) so that the
runs keep one version of the code while this tree changes; the run logs name the commit.
``FEDPSE_TABLES_RUNS=<folder>`` puts the run directories, logs and claims there instead of the default below.

Each run is ``pl-fed fit --config configs/fmnist_<method>.yaml`` with command-line overrides (printed by
``python papers/fedpse/fedpse_tables.py plan tables``). Run directories go to ``benchmarks/_runs/fedpse_tables/`` (not
kept); ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` of every finished run are copied to
``papers/fedpse/records/fedpse_tables/<run>/`` (kept in git).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

from runplan import commit_of as _commit

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "fedpse" / "records" / "fedpse_tables"
RUNS = Path(os.environ.get("FEDPSE_TABLES_RUNS", ROOT / "benchmarks" / "_runs" / "fedpse_tables")).resolve()
#: the paper's protocol (``data.noniid_order: halves``): its own records
PROTOCOL_RECORD = ROOT / "papers" / "fedpse" / "records" / "fedpse_protocol"
#: the protocol under the literal reading (``sorted``): run names carry this folder (``fedpse_protocol_sorted/<run>``),
#: so that its run directories and claims never meet the halves runs' of the same name
SORTED_FOLDER = "fedpse_protocol_sorted"
ORDERS = ("halves", "sorted")
#: the code the runs use: a checkout pinned at one commit (``git worktree add ../bench <commit>``) keeps hours of runs
#: on one version while this tree changes; default: this tree
CODE = Path(os.environ.get("FEDPSE_TABLES_CODE", ROOT)).resolve()

#: method -> (config, the method whose swept lr/batch it uses)
METHODS = {
    "fedavg": ("configs/fmnist_fedavg.yaml", "fedavg"),
    "fedstc": ("configs/fmnist_fedstc.yaml", "fedstc"),
    "fedscr": ("configs/fmnist_fedscr.yaml", "fedscr"),
    "fedpse": ("configs/fmnist_fedpse.yaml", "fedpse"),
    "fedpse_no_ewa": ("configs/fmnist_fedpse_no_ewa.yaml", "fedpse"),
    "fedpse_no_dps": ("configs/fmnist_fedpse_no_dps.yaml", "fedpse"),
}
MAIN = ("fedavg", "fedstc", "fedscr", "fedpse")
SWEEP_LR = (0.001, 0.003, 0.01)  # the paper's range 1e-3..1e-2 (App. C.3)
SWEEP_BATCH = (64, 256)  # inside the paper's 64..512
SWEEP = {"clients": 5, "lam": 0.5, "rounds": 3, "max_train_samples": 12000}
ROUNDS = 5  # whole training split: ~50 s per round per core, ~50 runs on 2 cores in a session
TABLE1 = [(n, lam) for n in (2, 5, 10) for lam in (1.0, 0.5, 0.0)]
TABLE2_EXTRA = [(n, 1.0) for n in (25, 50, 100)]
#: the paper's protocol: FedPSE against FedAvg at 10 clients, λ = 1 and 0.5, three seeds, the tables' rounds and lr
PROTOCOL = {"methods": ("fedpse", "fedavg"), "clients": 10, "lams": (1.0, 0.5), "seeds": (0, 1, 2)}


def _sweep_plan() -> list[dict]:
    return [{"name": f"sweep/{m}_lr{lr:g}_b{b}", "method": m, "lr": lr, "batch": b, "clients": SWEEP["clients"],
             "lam": SWEEP["lam"], "rounds": SWEEP["rounds"], "sweep": True}
            for m in MAIN for lr in SWEEP_LR for b in SWEEP_BATCH]


def _tables_plan() -> list[dict]:
    # in order of need: Table 1, the ablations at 10 clients, Table 2's larger federations, then EWA's gain against
    # the number of clients (the paper: it grows)
    runs = [{"method": m, "clients": n, "lam": lam} for n, lam in TABLE1 for m in MAIN]
    runs += [{"method": m, "clients": 10, "lam": 1.0} for m in ("fedpse_no_ewa", "fedpse_no_dps")]
    runs += [{"method": m, "clients": n, "lam": lam} for n, lam in TABLE2_EXTRA for m in MAIN]
    runs += [{"method": "fedpse_no_ewa", "clients": n, "lam": 1.0} for n in (2, 5, 25, 50, 100)]
    for r in runs:
        r.update(name=f"{r['method']}_n{r['clients']}_lam{r['lam']:g}", rounds=ROUNDS, sweep=False)
    return runs


def _protocol_plan(order: str = "halves", seeds: tuple[int, ...] = PROTOCOL["seeds"],
                   lams: tuple[float, ...] = PROTOCOL["lams"]) -> list[dict]:
    n = PROTOCOL["clients"]
    prefix = "" if order == "halves" else SORTED_FOLDER + "/"
    return [{"name": f"{prefix}{m}_n{n}_lam{lam:g}_seed{seed}", "method": m, "clients": n, "lam": lam, "seed": seed,
             "rounds": ROUNDS, "sweep": False, "order": order}
            for seed in seeds for lam in lams for m in PROTOCOL["methods"]]  # seed 0 first


def plan(kind: str, order: str = "halves", seeds: tuple[int, ...] = PROTOCOL["seeds"],
         lams: tuple[float, ...] = PROTOCOL["lams"]) -> list[dict]:
    """The runs of one plan; ``order``, ``seeds`` and ``lams`` apply to the protocol plan only."""
    if kind == "protocol":
        return _protocol_plan(order, seeds, lams)
    return {"sweep": _sweep_plan, "tables": _tables_plan}[kind]()


def _record_dir(run: dict) -> Path:
    if run.get("order") == "halves":
        return PROTOCOL_RECORD
    if run.get("order") == "sorted":  # the protocol under the literal reading: its name holds its folder
        return RECORD.parent
    return RECORD


def _chosen() -> dict:
    path = RECORD / "sweep.json"
    return json.loads(path.read_text()) if path.exists() else {}


def command(run: dict) -> list[str] | None:
    """The ``pl-fed fit`` command of one run, or None while its config or its method's lr/batch is missing."""
    config, family = METHODS[run["method"]]
    if not (ROOT / config).exists():
        return None
    if run["sweep"]:
        lr, batch = run["lr"], run["batch"]
        data = ["--data.max_train_samples", str(SWEEP["max_train_samples"]), "--data.split_ratios", "[0.9, 0.1, 0.0]",
                "--trainer.eval_split", "val", "--trainer.eval_every", str(run["rounds"])]
    else:
        choice = _chosen().get(family)
        if choice is None:
            return None
        lr, batch = choice["lr"], choice["batch"]
        data = ["--data.max_train_samples", "null", "--trainer.eval_every", "1"]
    # the sweep and the tables keep the split they were recorded with; the protocol runs take the paper's
    data += ["--data.noniid_order", run.get("order", "sorted")]
    if "seed" in run:
        data += ["--seed_everything", str(run["seed"]), "--data.seed", str(run["seed"])]
    return [sys.executable, "-m", "pl_fedsparse.cli", "fit", "--config", config, *data,
            "--data.num_clients", str(run["clients"]), "--data.noniid_ratio", str(run["lam"]),
            "--trainer.num_rounds", str(run["rounds"]), "--model.lr", str(lr), "--data.batch_size", str(batch),
            "--trainer.default_root_dir", str(RUNS / run["name"]), "--trainer.enable_progress_bar", "false"]


def _claim(run: dict) -> bool:
    marker = RUNS / (run["name"] + ".claim")
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def run_plan(kind: str, order: str = "halves", seeds: tuple[int, ...] = PROTOCOL["seeds"],
             lams: tuple[float, ...] = PROTOCOL["lams"]) -> None:
    for run in plan(kind, order, seeds, lams):
        done = _record_dir(run) / run["name"] / "summary.json"
        cmd = command(run)
        if done.exists() or cmd is None or not _claim(run):
            continue
        print("running", run["name"], flush=True)
        log = RUNS / (run["name"] + ".log")
        with log.open("w") as fh:
            fh.write(f"# code: {CODE} at {_commit(CODE)}\n")
            fh.flush()
            rc = subprocess.call(cmd + ["--trainer.overwrite", "true"], cwd=CODE, stdout=fh, stderr=subprocess.STDOUT)
        if rc != 0:
            print(f"FAILED {run['name']} (rc {rc}, log {log})", flush=True)
            (RUNS / (run["name"] + ".claim")).unlink()  # a later worker may retry it
            continue
        _record(run["name"], _record_dir(run))


def _record(name: str, record: Path = RECORD) -> None:
    out = record / name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy2(RUNS / name / f, out / f)


def collect() -> None:
    """Record finished runs whose worker was stopped before it could copy them."""
    protocol = [run for order in ORDERS for run in _protocol_plan(order, tuple(range(10)))]  # any seed up to 9
    for run in _sweep_plan() + _tables_plan() + protocol:
        record = _record_dir(run)
        if (RUNS / run["name"] / "summary.json").exists() and not (record / run["name"] / "summary.json").exists():
            _record(run["name"], record)
            print("recorded", run["name"])


def _summary(name: str) -> dict | None:
    path = RECORD / name / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def choose() -> None:
    """Best validation accuracy (mean over clients, last round) per method; ties -> the smaller lr, batch."""
    chosen = {}
    for m in MAIN:
        scored = []
        for run in _sweep_plan():
            s = _summary(run["name"]) if run["method"] == m else None
            if s is not None:
                scored.append((-s["final"]["acc_mean"], run["lr"], run["batch"]))
        if len(scored) == len(SWEEP_LR) * len(SWEEP_BATCH):
            acc, lr, batch = min(scored)
            chosen[m] = {"lr": lr, "batch": batch, "val_acc_mean": -acc}
        print(m, "->", chosen.get(m, f"sweep incomplete ({len(scored)} runs)"))
    RECORD.mkdir(parents=True, exist_ok=True)
    (RECORD / "sweep.json").write_text(json.dumps(chosen, indent=1) + "\n")


def report() -> None:
    print("Sweep (validation accuracy, mean over clients):\n")
    print("| method | " + " | ".join(f"lr {lr:g} b {b}" for lr in SWEEP_LR for b in SWEEP_BATCH) + " |")
    print("|---|" + "---|" * (len(SWEEP_LR) * len(SWEEP_BATCH)))
    for m in MAIN:
        cells = []
        for lr in SWEEP_LR:
            for b in SWEEP_BATCH:
                s = _summary(f"sweep/{m}_lr{lr:g}_b{b}")
                cells.append("-" if s is None else f"{100 * s['final']['acc_mean']:.2f}")
        print(f"| {m} | " + " | ".join(cells) + " |")
    fedavg_bytes = {}
    print("\nTables (test accuracy of personal models, mean over clients, after the last round; bytes in total):\n")
    print("| clients | λ | method | acc (mean) | best round acc | total MB | vs FedAvg bytes |")
    print("|---|---|---|---|---|---|---|")
    for run in _tables_plan():
        s = _summary(run["name"])
        if s is None:
            continue
        key = (run["clients"], run["lam"])
        if run["method"] == "fedavg":
            fedavg_bytes[key] = s["comm_cum_bytes_total"]
        ref = fedavg_bytes.get(key)
        rel = "-" if ref is None else f"{100 * s['comm_cum_bytes_total'] / ref:.1f} %"
        print(f"| {run['clients']} | {run['lam']:g} | {run['method']} | {100 * s['final']['acc_mean']:.2f} "
              f"| {100 * s['best_acc_mean']:.2f} | {s['comm_cum_bytes_total'] / 1e6:.1f} | {rel} |")


#: the paper's FMNIST numbers: Table 1 (clients, λ) -> FedAvg, FedSTC, FedSCR, FedPSE; Table 2 (λ = 1) by clients
PAPER_T1 = {(2, 1.0): (0.8781, 0.8844, 0.9031, 0.9466), (2, 0.5): (0.8804, 0.8926, 0.8624, 0.8953),
            (2, 0.0): (0.9003, 0.8906, 0.8523, 0.8911), (5, 1.0): (0.8068, 0.8388, 0.8403, 0.9243),
            (5, 0.5): (0.8835, 0.8952, 0.8512, 0.8967), (5, 0.0): (0.8995, 0.8839, 0.8641, 0.8760),
            (10, 1.0): (0.7909, 0.8040, 0.8305, 0.9334), (10, 0.5): (0.8697, 0.8850, 0.8655, 0.8910),
            (10, 0.0): (0.8993, 0.8960, 0.8644, 0.8725)}
PAPER_T2 = {2: (0.8781, 0.8844, 0.9031, 0.9466), 5: (0.8068, 0.8756, 0.8821, 0.9267),
            10: (0.7909, 0.8614, 0.8603, 0.9371), 25: (0.8045, 0.8553, 0.8612, 0.9021),
            50: (0.8071, 0.8343, 0.8531, 0.8939), 100: (0.7921, 0.8211, 0.8344, 0.8772)}


def _acc(method: str, n: int, lam: float, key: str = "final") -> float | None:
    s = _summary(f"{method}_n{n}_lam{lam:g}")
    if s is None:
        return None
    return s["final"]["acc_mean"] if key == "final" else s["best_acc_mean"]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def paper_tables() -> None:
    """The paper-shaped tables: ours (last round; best round in parentheses) next to the paper's."""
    print("Table 1 (FMNIST): personal accuracy %, mean over clients, last round (best round); paper in brackets\n")
    print("| clients | λ | FedAvg | FedSTC | FedSCR | FedPSE | FedPSE − FedAvg (paper) |")
    print("|---|---|---|---|---|---|---|")
    for (n, lam), paper in PAPER_T1.items():
        cells = []
        for m, p in zip(MAIN, paper):
            a, b = _acc(m, n, lam), _acc(m, n, lam, "best")
            cells.append("-" if a is None else f"{_pct(a)} ({_pct(b)}) [{100 * p:.2f}]")
        pse, avg = _acc("fedpse", n, lam), _acc("fedavg", n, lam)
        gap = "-" if pse is None or avg is None else f"{100 * (pse - avg):+.2f} ({100 * (paper[3] - paper[0]):+.2f})"
        print(f"| {n} | {lam:g} | " + " | ".join(cells) + f" | {gap} |")
    print("\nTable 2 (FMNIST, λ = 1): last round; P1 / P2 = FedPSE's relative gain over FedSTC / FedSCR\n")
    print("| clients | FedAvg | FedSTC | FedSCR | FedPSE | P1 | P2 | paper FedAvg / FedSTC / FedSCR / FedPSE | paper P1 / P2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, paper in PAPER_T2.items():
        accs = [_acc(m, n, 1.0) for m in MAIN]
        p1 = "-" if None in (accs[3], accs[1]) else f"{100 * (accs[3] / accs[1] - 1):+.1f} %"  # type: ignore[operator]
        p2 = "-" if None in (accs[3], accs[2]) else f"{100 * (accs[3] / accs[2] - 1):+.1f} %"  # type: ignore[operator]
        print(f"| {n} | " + " | ".join(_pct(a) for a in accs) + f" | {p1} | {p2} | "
              + " / ".join(f"{100 * p:.2f}" for p in paper)
              + f" | {100 * (paper[3] / paper[1] - 1):+.1f} % / {100 * (paper[3] / paper[2] - 1):+.1f} % |")
    print("\nAblations (λ = 1): last round (best round)\n")
    print("| clients | FedPSE | without EWA | EWA's gain | without DPS |")
    print("|---|---|---|---|---|")
    for n in (2, 5, 10, 25, 50, 100):
        pse, no_ewa, no_dps = _acc("fedpse", n, 1.0), _acc("fedpse_no_ewa", n, 1.0), _acc("fedpse_no_dps", n, 1.0)
        if no_ewa is None and no_dps is None:
            continue
        gain = "-" if pse is None or no_ewa is None else f"{100 * (pse - no_ewa):+.2f}"

        def both(m: str) -> str:
            a = _acc(m, n, 1.0)
            return "-" if a is None else f"{_pct(a)} ({_pct(_acc(m, n, 1.0, 'best'))})"
        print(f"| {n} | {both('fedpse')} | {both('fedpse_no_ewa')} | {gain} | {both('fedpse_no_dps')} |")


def _protocol_acc(method: str, lam: float, seed: int, order: str = "halves") -> float | None:
    name = f"{method}_n{PROTOCOL['clients']}_lam{lam:g}_seed{seed}"
    path = (PROTOCOL_RECORD if order == "halves" else RECORD.parent / SORTED_FOLDER) / name / "summary.json"
    return json.loads(path.read_text())["final"]["acc_mean"] if path.exists() else None


def protocol_table(order: str = "halves", seeds: tuple[int, ...] = PROTOCOL["seeds"]) -> None:
    """The paper's protocol: personal accuracy after the last round, mean over clients, per seed and mean ± std."""
    import statistics

    print("| λ | method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± std | paper |")
    print("|---|---|" + "---|" * (len(seeds) + 2))
    for lam in PROTOCOL["lams"]:
        for m in PROTOCOL["methods"]:
            accs = [_protocol_acc(m, lam, s, order) for s in seeds]
            done = [100 * a for a in accs if a is not None]
            spread = (f"{statistics.mean(done):.2f} ± {statistics.stdev(done):.2f}" if len(done) > 1
                      else "-" if not done else f"{done[0]:.2f}")
            paper = PAPER_T1[(PROTOCOL["clients"], lam)][MAIN.index(m)]
            print(f"| {lam:g} | {m} | " + " | ".join(_pct(a) for a in accs) + f" | {spread} | {100 * paper:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    def protocol_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--order", choices=ORDERS, default=None,
                       help="the protocol's split: halves (the paper's, default) or sorted (the literal reading)")
        p.add_argument("--seeds", type=int, nargs="+", default=None, help="the protocol's seeds (default: 0 1 2)")
        if p.prog.split()[-1] != "protocol":  # the table verb shows both λ
            p.add_argument("--lams", type=float, nargs="+", default=None, help="the protocol's λ (default: 1 0.5)")

    for verb in ("run", "plan"):
        p = sub.add_parser(verb)
        p.add_argument("kind", choices=("sweep", "tables", "protocol"))
        protocol_options(p)
    sub.add_parser("choose")
    sub.add_parser("collect")
    sub.add_parser("report")
    sub.add_parser("paper")
    protocol_options(sub.add_parser("protocol"))
    args = parser.parse_args()
    if args.verb in ("run", "plan") and args.kind != "protocol" and (args.order, args.seeds, args.lams) != (None,) * 3:
        parser.error(f"--order/--seeds/--lams: given with kind {args.kind!r}; they apply to kind 'protocol' only")
    lams = tuple(getattr(args, "lams", None) or PROTOCOL["lams"])
    if any(not 0.0 <= lam <= 1.0 for lam in lams):
        parser.error(f"--lams: got {' '.join(f'{lam:g}' for lam in lams)}; each λ must be in [0, 1]")
    order = args.order if getattr(args, "order", None) else "halves"
    seeds = tuple(args.seeds) if getattr(args, "seeds", None) else PROTOCOL["seeds"]
    if args.verb == "run":
        run_plan(args.kind, order, seeds, lams)
    elif args.verb == "plan":
        for run in plan(args.kind, order, seeds, lams):
            cmd = command(run)
            print(run["name"], ":", "(lr/batch not chosen yet)" if cmd is None else " ".join(cmd[1:]))
    elif args.verb == "choose":
        choose()
    elif args.verb == "collect":
        collect()
    elif args.verb == "paper":
        paper_tables()
    elif args.verb == "protocol":
        protocol_table(order, seeds)
    else:
        report()


if __name__ == "__main__":
    main()
