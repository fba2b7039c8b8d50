"""pFedGate's CIFAR-10 comparison (paper Table 1 CIFAR-10 column and Table 8) at a CPU scale.

pFedGate at s = 1 / 0.5 / 0.3 against Local, FedAvg, FedAvg-FT, Ditto, FedRep and FedEM, every method in one common
setting (pFedGate's Table 1 setting, shrunk to fit two CPU cores: fewer clients, a fraction of the data, fewer
rounds) and every run with 20 % novel clients (:class:`~pl_fedsparse.callbacks.NovelClients`, App. I.1): they never
train and, after the last round, adapt for one epoch (pFedGate: only the gate; the others: the whole global model),
so one run gives both Table 1's numbers (over the clients that trained) and Table 8's gap. Resumable: a finished
run is never redone, and two workers share the plan by claiming runs::

    git worktree add /work/bench_pg <commit>            # the pinned code the runs use
    PFEDGATE_TABLE_CODE=/work/bench_pg OMP_NUM_THREADS=1 nohup python papers/pfedgate/pfedgate_table.py run &  # worker 1
    PFEDGATE_TABLE_CODE=/work/bench_pg OMP_NUM_THREADS=1 nohup python papers/pfedgate/pfedgate_table.py run &  # worker 2
    python papers/pfedgate/pfedgate_table.py report          # the markdown tables (Table 1 and Table 8 shapes)
    python papers/pfedgate/pfedgate_table.py plan            # the exact command of every run
    python papers/pfedgate/pfedgate_table.py check           # the runs not recorded yet resolve (no training, no data)
    PFEDGATE_TABLE_CODE=/work/bench_pg python papers/pfedgate/pfedgate_table.py same-code   # the pinned code vs seed 0
    python papers/pfedgate/pfedgate_table.py park            # before a session ends: unfinished runs' checkpoints into
    git add papers/pfedgate/records/*/_parked     # git; the next session resumes

``PFEDGATE_TABLE_CODE=<checkout>`` runs the CLI from another checkout (a worktree pinned at one commit), so the runs
keep one version of the code while this tree changes; each run's log names the commit. Run directories go to
``benchmarks/_runs/pfedgate_table/<run>/`` (not kept); ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` of
every finished run are copied to ``papers/pfedgate/records/pfedgate_table/<run>/`` (kept in git). ``smoke`` runs every method
for 2 rounds on 2 % of the data into ``/tmp/pg/smoke`` (checks the overrides; nothing is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

import runplan
import yaml
from runplan import Run, run_plan

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "pfedgate" / "records" / "pfedgate_table"
RUNS = ROOT / "benchmarks" / "_runs" / "pfedgate_table"
CODE = Path(os.environ.get("PFEDGATE_TABLE_CODE", ROOT)).resolve()
#: the extracted ImageFolder copy (absolute: the CLI runs in CODE). A run resumes only with its own configuration, so
#: a parked run needs this same path wherever it continues (``gpu_plans.sh`` places the data there on a lent GPU)
DATA = Path(os.environ.get("PFEDGATE_TABLE_DATA", ROOT / "data" / "cifar10"))

#: the common CPU setting (pFedGate's Table 1 setting except the scale: 100 clients, all data, 400 rounds there)
CLIENTS = 25          # 20 clients train, 5 (20 %) are novel
SAMPLE_FRACTION = 0.3  # FedEM's s_frac: 30 % of the 60,000 pooled images (18,000), then 6:2:2 per client
ROUNDS = 40
LONG_ROUNDS = 200      # the continuation of ``LONG`` past the plateau (records in records/pfedgate_long/)
EVAL_EVERY = 5
#: training seeds (``--seed_everything``: initial weights, batch order, the novel clients); the FedEM split keeps its
#: data seed 12345 in every run. Seed 0's runs keep their first names (``fedavg``), the others get ``_seed<s>``.
SEEDS = (0, 1, 2)
LONG = ("pfedgate_s05", "fedavg_ft")
#: ``LONG``'s seeds: pFedGate above FedAvg-FT at 200 rounds was "not shown" at three seeds (paired p 0.077), and a
#: run is cheap (~30-40 min), so two more seeds run; their 40-round runs are recorded apart (records/
#: pfedgate_long_base/: the 40-round table keeps every method at the same three seeds)
LONG_SEEDS = (*SEEDS, 3, 4)
#: the 40-round claims FedRep > FedAvg-FT (paired p 0.060) and FedEM > FedAvg (p 0.057) were "not shown" at three
#: seeds too, and their runs are cheap (~30-35 min), so these methods also run at ``LONG_SEEDS`` for 40 rounds
#: (recorded with ``LONG``'s in pfedgate_long_base/; not continued)
BASE_EXTRA = ("fedrep", "fedem", "fedavg")
RECORD_BASE = ROOT / "papers" / "pfedgate" / "records" / "pfedgate_long_base"
#: continued to 200 rounds too, after every 40-round run: ~48 s a round on one core (10 head epochs a round), so ~2.2 h
#: per continuation and ~2.7 h for a seed whose 40-round run directory is gone (it runs 200 rounds from the start).
#: Longer than a session: ``park`` keeps the unfinished runs' checkpoints in git for the next one.
LONG_SLOW = ("fedrep",)
RECORD_LONG = ROOT / "papers" / "pfedgate" / "records" / "pfedgate_long"
RUNS_LONG = ROOT / "benchmarks" / "_runs" / "pfedgate_long"
NOVEL = {"class_path": "pl_fedsparse.callbacks.NovelClients", "init_args": {"fraction": 0.2, "epochs": 1}}
KEEP_OPT = {"class_path": "pl_fedsparse.callbacks.KeepOptimizerState"}
LENET = {"class_path": "pl_fedsparse.models.LeNetCIFAR", "init_args": {"num_classes": 10}}

COMMON = [
    "--data.root", str(DATA), "--data.num_clients", str(CLIENTS), "--data.partition", "fedem_dirichlet",
    "--data.alpha", "0.4", "--data.test_mode", "pooled", "--data.split_ratios", "[0.6, 0.2, 0.2]",
    "--data.seed", "12345", "--data.sample_fraction", str(SAMPLE_FRACTION), "--data.batch_size", "128",
    "--data.augment", "false",
    # pFedGate's personal evaluation draws one mask per test batch, so the evaluation batch matters; seed 0 was
    # recorded at 512 (the default then), every seed keeps it (the authors' code evaluates in batches of bz = 128)
    "--data.eval_batch_size", "512",
    "--trainer.num_rounds", str(ROUNDS), "--trainer.join_ratio", "1.0", "--trainer.eval_every", str(EVAL_EVERY),
    "--trainer.enable_progress_bar", "false",
    "--model.lr", "0.03", "--model.momentum", "0.9", "--model.weight_decay", "5e-4",
]


def _callbacks(config: str, *, drop: tuple[str, ...] = (), add: tuple[dict, ...] = (),
               replace: dict[str, dict] | None = None) -> list[str]:
    """``--trainer.callbacks`` as the config's list, less ``drop``, with ``replace``'s init_args merged in, plus
    ``add``, plus the novel clients; every learning-rate schedule (``lr_milestones``) removed: one constant rate for
    every method (the baselines' configs have none to match)."""
    cbs = yaml.safe_load((CODE / config).read_text())["trainer"].get("callbacks") or []
    out = []
    for cb in cbs:
        short = cb["class_path"].rsplit(".", 1)[-1]
        if short in drop:
            continue
        cb = {"class_path": cb["class_path"], "init_args": dict(cb.get("init_args") or {})}
        cb["init_args"].update((replace or {}).get(short, {}))
        if "lr_milestones" in cb["init_args"]:
            cb["init_args"]["lr_milestones"] = None
        out.append(cb)
    return ["--trainer.callbacks", json.dumps(out + list(add) + [NOVEL])]


#: the configs written for the DisPFL / DM-PFL protocols (Dirichlet 0.3, 5 epochs, lr 0.1 decayed, ...) get the
#: pFedGate/FedEM code's setting: one epoch, lr 0.03 without decay, LeNet, SGD momentum 0.9 kept across rounds
DISPFL_FIX = ["--data.quantity_skew", "false", "--model.lr_decay", "1.0", "--trainer.local_epochs", "1",
              "--trainer.gradient_clip_val", "10.0", "--model.backbone", json.dumps(LENET)]

#: name -> (label, config, overrides). pFedGate / FedEM / FedRep configs already are in pFedGate's setting.
METHODS: dict[str, tuple[str, str, list[str]]] = {
    "local": ("Local", "configs/cifar10_local.yaml",
              DISPFL_FIX + _callbacks("configs/cifar10_local.yaml", add=(KEEP_OPT,))),
    "fedavg": ("FedAvg", "configs/cifar10_fedavg.yaml",
               DISPFL_FIX + _callbacks("configs/cifar10_fedavg.yaml", add=(KEEP_OPT,))),
    # FedAvg-FT: one epoch of fine-tuning after the last round (as the novel clients' adaptation), at the rate
    "fedavg_ft": ("FedAvg-FT", "configs/cifar10_fedavg_ft.yaml",
                  DISPFL_FIX + _callbacks("configs/cifar10_fedavg_ft.yaml", add=(KEEP_OPT,),
                                          replace={"FineTune": {"epochs": 1, "lr": "current"}})),
    # Ditto's config is DM-PFL's (McMahanCNN, CIFAR-10-C shift evaluation): LeNet, no shift evaluation; a fresh
    # optimizer per fit (Ditto's two fits per round share no optimizer state)
    "ditto": ("Ditto", "configs/cifar10_ditto.yaml",
              DISPFL_FIX + _callbacks("configs/cifar10_ditto.yaml", drop=("ShiftEvaluation",))),
    "fedrep": ("FedRep", "configs/cifar10_fedrep.yaml", _callbacks("configs/cifar10_fedrep.yaml")),
    "fedem": ("FedEM", "configs/cifar10_fedem.yaml", _callbacks("configs/cifar10_fedem.yaml")),
    "pfedgate_s1": ("pFedGate s = 1", "configs/cifar10_pfedgate_s1.yaml",
                    _callbacks("configs/cifar10_pfedgate_s1.yaml")),
    "pfedgate_s05": ("pFedGate s = 0.5", "configs/cifar10_pfedgate.yaml", _callbacks("configs/cifar10_pfedgate.yaml")),
    "pfedgate_s03": ("pFedGate s = 0.3", "configs/cifar10_pfedgate_s03.yaml",
                     _callbacks("configs/cifar10_pfedgate_s03.yaml")),
}
#: the order the workers take them: the slow ones first, so the two workers end together
ORDER = ("fedrep", "fedem", "ditto", "pfedgate_s05", "pfedgate_s1", "pfedgate_s03", "fedavg_ft", "fedavg", "local")

#: the paper's CIFAR-10 numbers: Table 1 (Acc, bottom-decile Acc, s') and Table 8 (participating, novel, Δ)
PAPER_T1 = {"local": (61.91, 53.71), "fedavg": (68.33, 60.22), "fedavg_ft": (69.91, 61.55), "ditto": (73.14, 62.59),
            "fedem": (72.43, 62.88), "fedrep": (72.77, 63.44), "pfedgate_s1": (75.18, 66.67, 1.0),
            "pfedgate_s05": (74.07, 64.21, 0.43), "pfedgate_s03": (73.65, 64.39, 0.25)}
PAPER_T8 = {"fedavg": (67.78, 66.15, 1.63), "fedem": (71.92, 70.75, 1.17), "pfedgate_s1": (73.97, 73.18, 0.79),
            "pfedgate_s05": (74.12, 73.19, 0.93), "pfedgate_s03": (73.64, 72.78, 0.86)}


def run_name(method: str, seed: int) -> str:
    return method if seed == 0 else f"{method}_seed{seed}"


def fit_args(method: str, seed: int = 0) -> list[str]:
    """``pl-fed fit``'s arguments of ``method`` at training seed ``seed`` (without the run directory)."""
    _, config, overrides = METHODS[method]
    return ["--config", config, *COMMON, "--seed_everything", str(seed), *overrides]


def command(name: str, run_dir: Path, extra: list[str] | None = None, seed: int = 0) -> list[str]:
    return [sys.executable, "-m", "pl_fedsparse.cli", "fit", *fit_args(name, seed), *(extra or []),
            "--trainer.default_root_dir", str(run_dir)]


def runs(seeds: tuple[int, ...] = SEEDS) -> list[Run]:
    """The 40-round plan for :func:`runplan.run_plan` (claims, resume from ``last.ckpt``, records): seed by seed in
    ``ORDER``, except that the runs ``long_runs`` continues come first at every seed."""
    order = [*LONG, *(m for m in ORDER if m not in LONG)]
    return [Run(run_name(m, s), fit_args(m, s), {"seed": s, "method": m}) for s in seeds for m in order]


def long_runs(seeds: tuple[int, ...] = SEEDS, methods: tuple[str, ...] = LONG) -> list[Run]:
    """``methods``' 40-round runs continued to ``LONG_ROUNDS`` from their last checkpoint (no learning-rate schedule
    here, so the continuation equals a 200-round run); each waits until its 40-round run has finished. A
    ``LONG_SLOW`` run whose 40-round run directory is not on this machine (recorded in an earlier session) runs its
    200 rounds from the start instead."""
    def start(m: str, s: int) -> Path | None:
        base = RUNS / run_name(m, s)
        return None if m in LONG_SLOW and not base.exists() else base

    return [Run(run_name(m, s), [*fit_args(m, s), "--trainer.num_rounds", str(LONG_ROUNDS)], {"seed": s, "method": m},
                start_from=start(m, s)) for s in seeds for m in methods]


def _extra_base() -> list[Run]:
    """The 40-round runs of ``LONG`` and ``BASE_EXTRA`` at the seeds beyond ``SEEDS`` (recorded in ``RECORD_BASE``)."""
    return [r for r in runs(tuple(s for s in LONG_SEEDS if s not in SEEDS)) if r.meta["method"] in (*LONG, *BASE_EXTRA)]


def _plans() -> list[tuple[list[Run], Path, Path]]:
    """Every plan in a worker's order, with its run and record folders: the 40-round runs of pFedGate s = 0.5 and
    FedAvg-FT, their 200-round continuations, the rest of the 40-round runs, FedRep's 200-round runs, and last the
    extra seeds of the 200-round claim (40 rounds, then their continuations)."""
    first = [r for r in runs() if r.meta["method"] in LONG]
    slow = ("fedrep", "fedem")  # 30-35 min a run: after every seed's other methods
    rest = sorted((r for r in runs() if r.meta["method"] not in LONG), key=lambda r: r.meta["method"] in slow)
    extra = tuple(s for s in LONG_SEEDS if s not in SEEDS)
    return [(first, RUNS, RECORD), (long_runs(), RUNS_LONG, RECORD_LONG), (rest, RUNS, RECORD),
            (long_runs(methods=LONG_SLOW), RUNS_LONG, RECORD_LONG), (_extra_base(), RUNS, RECORD_BASE),
            (long_runs(seeds=extra), RUNS_LONG, RECORD_LONG)]


def work() -> None:
    """One worker: every plan of :func:`_plans` in turn, again while a pass finished something (a continuation waits
    for its 40-round run, which another worker may hold)."""
    while sum(run_plan(plan, runs_dir, record, CODE) for plan, runs_dir, record in _plans()):
        pass


def park() -> None:
    """Every started, unrecorded run's last checkpoint into git (``runplan.park``), for the next session."""
    for plan, runs_dir, record_dir in _plans():
        runplan.report_parked(runplan.park(plan, runs_dir, record_dir), record_dir)


def same_code(methods: tuple[str, ...] = ("pfedgate_s05", "fedavg_ft"), rounds: int = 11) -> None:
    """Whether the pinned code (``PFEDGATE_TABLE_CODE``) gives seed 0's recorded rows: each method re-run for
    ``rounds`` rounds at seed 0, every numeric metric (times aside) of every recorded round compared exactly."""
    lines = [f"code: {CODE} at {runplan.commit_of(CODE)}; seed 0, {rounds} rounds, against "
             "papers/pfedgate/records/pfedgate_table/"]
    for name in methods:
        run_dir = Path(tempfile.mkdtemp(prefix="pg_same_")) / name
        extra = ["--trainer.num_rounds", str(rounds), "--trainer.overwrite", "true", "--trainer.enable_progress_bar",
                 "false", "--trainer.logger", "false"]
        subprocess.run(command(name, run_dir, extra), cwd=CODE, check=True, capture_output=True)
        new = {r["round"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
        old = {r["round"]: r for r in _load(name)[1]}  # type: ignore[index]
        for rnd in sorted(set(new) & set(old)):
            if rnd == rounds - 1:
                continue  # the last round of the short run adapts the novel clients and fine-tunes: not comparable
            keys = [k for k, v in old[rnd].items() if not k.startswith("time") and isinstance(v, (int, float))]
            diff = {k: (old[rnd][k], new[rnd].get(k)) for k in keys if new[rnd].get(k) != old[rnd][k]}
            lines.append(f"{name} round {rnd}: {len(keys)} metrics compared, "
                         + ("all equal" if not diff else f"{len(diff)} differ: {diff}"))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    out = RECORD.parent / "_pfedgate_code_check.txt"  # one section per check: each pinned commit's evidence
    out.write_text((out.read_text() + "\n" if out.exists() else "") + text)


def smoke() -> None:
    """Every method for 2 rounds on 2 % of the data, timed: checks the overrides; nothing is recorded."""
    for name in ORDER:
        run_dir = Path("/tmp/pg/smoke") / name
        extra = ["--trainer.num_rounds", "2", "--trainer.eval_every", "1", "--data.sample_fraction", "0.02",
                 "--trainer.overwrite", "true"]
        out = subprocess.run(command(name, run_dir, extra), cwd=CODE, capture_output=True, text=True,
                             check=False)
        if out.returncode != 0:
            print(f"{name}: FAILED\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
            continue
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        print(f"{name}: ok, train s/round {[round(r['time_train_s'], 1) for r in rows]}, "
              f"acc_w {rows[-1]['acc_weighted']:.3f}, novel gap {rows[-1].get('novel/gap')}", flush=True)


# ---------------------------------------------------------------------------------------------------- the report
def _load(name: str) -> tuple[dict, list[dict]] | None:
    path = RECORD / name
    if not (path / "summary.json").exists():
        return None
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return json.loads((path / "summary.json").read_text()), rows


def _novel_ids(n: int, seed: int = 0, fraction: float = 0.2) -> set[int]:
    """The novel clients NovelClients draws (its stream "novel_clients", key 0), for per-client statistics."""
    sys.path.insert(0, str(CODE))
    from pl_fedsparse.streams import Streams

    count = min(max(1, round(fraction * n)), n - 1)
    return {int(k) for k in Streams(seed).numpy("novel_clients", 0).permutation(n)[:count]}


def _bottom_decile(values: list[float]) -> float:
    """pFedGate/FedEM's bottom decile: the ⌊N/10⌋-th smallest value, 0-based (pl_fedsparse.metrics.bottom_decile)."""
    return sorted(values)[len(values) // 10]


def _pct(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{100 * v:.{digits}f}"


def _last(rows: list[dict], key: str) -> float | None:
    for r in reversed(rows):
        if r.get(key) is not None:
            return r[key]
    return None


def report() -> None:
    novel = _novel_ids(CLIENTS)
    print(f"Setting: CIFAR-10, {CLIENTS} clients ({CLIENTS - len(novel)} train, {len(novel)} novel: "
          f"{sorted(novel)}), FedEM Dirichlet(0.4) split of {SAMPLE_FRACTION:g} of the 60,000 pooled images, "
          f"6:2:2 per client, {ROUNDS} rounds, all training clients every round, batch 128, 1 local epoch, "
          "LeNet-CIFAR, SGD lr 0.03 momentum 0.9.\n")
    print("Table 1 shape (the 20 clients that trained; last round):\n")
    print("| method | Acc (weighted) | bottom decile | Acc (mean) | best eval Acc (weighted, all clients) | s' | q "
          "| total MB | MB up | train FLOPs | paper Acc / bottom / s' |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in METHODS:
        loaded = _load(name)
        label = METHODS[name][0]
        paper = " / ".join(f"{v:g}" for v in PAPER_T1[name])
        if loaded is None:
            print(f"| {label} | (not run) ||||||||| {paper} |")
            continue
        s, rows = loaded
        final = rows[-1]
        seen_acc = [a for k, a in enumerate(s["client_acc"]) if k not in novel]
        best = max((r["acc_weighted"] for r in rows if r.get("acc_weighted") is not None), default=None)
        sprime = _last(rows, "gate_density")
        q = _last(rows, "gate_upload_ratio")
        print(f"| {label} | {_pct(final.get('seen/acc_weighted'))} | {_pct(_bottom_decile(seen_acc))} "
              f"| {_pct(final.get('seen/acc_mean'))} | {_pct(best)} "
              f"| {'-' if sprime is None else f'{sprime:.3f}'} | {'-' if q is None else f'{q:.3f}'} "
              f"| {s['comm_cum_bytes_total'] / 1e6:.1f} | {s['comm_cum_bytes_up'] / 1e6:.1f} "
              f"| {s['flops_train_cum']:.3g} | {paper} |")
    print("\nTable 8 shape (Acc̄: the 20 clients that trained; Acc̃: the 5 novel clients after one epoch of adaptation"
          " — pFedGate: the gate only; the others: the whole global model; weighted):\n")
    print("| method | Acc̄ | Acc̃ | Δ = Acc̄ − Acc̃ | Acc̃ unadapted (the previous evaluation, its 0-based round) "
          "| paper Acc̄ / Acc̃ / Δ |")
    print("|---|---|---|---|---|---|")
    for name in METHODS:
        loaded = _load(name)
        if loaded is None:
            continue
        s, rows = loaded
        final = rows[-1]
        before = [r for r in rows[:-1] if r.get("novel/acc_weighted") is not None]
        paper = " / ".join(f"{v:g}" for v in PAPER_T8[name]) if name in PAPER_T8 else "-"
        if name == "local":  # no global model: NovelClients requests no adaptation, the novel clients stay untrained
            print(f"| {METHODS[name][0]} | {_pct(final.get('seen/acc_weighted'))} | n/a (never trained) | n/a | - "
                  f"| {paper} |")
            continue
        unadapted = f"{_pct(before[-1]['novel/acc_weighted'])} (r{before[-1]['round']})" if before else "-"
        print(f"| {METHODS[name][0]} | {_pct(final.get('seen/acc_weighted'))} | {_pct(final.get('novel/acc_weighted'))}"
              f" | {_pct(final.get('novel/gap'))} | {unadapted} | {paper} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("plan", "run", "check", "park", "smoke", "report", "same-code"))
    parser.add_argument("--methods", default="pfedgate_s05,fedavg_ft",
                        help="same-code: the methods to re-run at seed 0 (comma-separated; default %(default)s)")
    parser.add_argument("--rounds", type=int, default=11, help="same-code: rounds per re-run (default %(default)s)")
    args = parser.parse_args()
    if args.verb == "plan":
        for plan, runs_dir, _ in _plans():
            for run in plan:
                cmd = [sys.executable, "-m", "pl_fedsparse.cli", "fit", *run.args, "--trainer.default_root_dir",
                       str(runs_dir / run.name)]
                cont = f" (continues {run.start_from.relative_to(ROOT)})" if run.start_from else ""
                print(f"# {run.name}{cont}\n(cd {CODE} && OMP_NUM_THREADS=1 python " + " ".join(
                    f"'{c}'" if any(ch in c for ch in " {[\"") else c for c in cmd[1:]) + ")\n")
    elif args.verb == "run":  # also records finished runs a stopped worker could not copy
        work()
    elif args.verb == "park":
        park()
    elif args.verb == "check":  # the runs a worker would still run resolve (no training, no data)
        todo = [r for plan, _, record in _plans() for r in plan if not (record / r.name / "summary.json").exists()]
        runplan.check(todo)
    elif args.verb == "smoke":
        smoke()
    elif args.verb == "same-code":
        unknown = [m for m in args.methods.split(",") if m not in METHODS]
        if unknown or args.rounds < 6:
            raise SystemExit(f"error: --methods={args.methods!r} / --rounds={args.rounds} is invalid: expected methods "
                             f"among {', '.join(METHODS)} and at least 6 rounds (the first evaluation is round 4)")
        same_code(tuple(args.methods.split(",")), args.rounds)
    else:
        report()


if __name__ == "__main__":
    main()
