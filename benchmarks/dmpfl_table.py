"""DM-PFL's Table 1 at CPU scale, every row recorded, three seeds: DM-PFL / DM-PFL+ against its paper's baselines.

The setting of ``benchmarks/cifar10_dmpfl.sh`` (``configs/cifar10_dmpfl_cpu.yaml``: McMahan CNN, 20 clients, 10 per
round, E = 2, Dir(0.3) with quantity skew over a seeded 10,000-image subsample, 0.75 / 0.25 per client, 30 rounds;
every method evaluated at the last round at 0/20/40/50/60/80/100 % shift and under the nine corruptions at severity
5), as a resumable plan (:mod:`runplan`) whose records are kept: ``benchmarks/dmpfl_table/<method>_seed<s>/``.

Rows: ``dmpfl_plus`` (one DM-PFL+ run gives DM-PFL — its personal model θ_c alone, ``personal_only_acc`` — and
DM-PFL+ — the adaptive choice, ``acc_mean`` — and DM-PFL's global model θ_g, ``global_acc``), ``fedavg`` (its
``global_acc`` is FedAvg's model; every personal model is that model), ``fedavg_ft``, ``ditto``, ``local``,
``feddst``. Seeds: ``--seed_everything s --data.seed s`` (the subsample, the partition, the initial weights and the
sampling all change with the seed).

    mkdir -p data/cifar10 && tar -xzf ../shared/data/cifar10-jpg.tar.gz -C data/cifar10
    git worktree add ../bench HEAD                      # pin the code for the hours the runs take
    for w in 1 2; do DMPFL_TABLE_CODE=../bench OMP_NUM_THREADS=1 nohup python benchmarks/dmpfl_table.py run \\
        > /tmp/dmpfl_table_w$w.log 2>&1 & done          # ~6-8 min per run on one core, 18 runs
    python benchmarks/dmpfl_table.py table              # mean ± sample std over the recorded seeds
    DMPFL_TABLE_ROUNDS=100 DMPFL_TABLE_CODE=../bench OMP_NUM_THREADS=1 python benchmarks/dmpfl_table.py run
                                                        # the 100-round plan: every row, 15-35 min a run
    DMPFL_TABLE_ROUNDS=100 DMPFL_TABLE_METHODS=ditto ... run   # some methods only
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import runplan
from runplan import Run, percent_spread

ROOT = Path(__file__).resolve().parent.parent
#: a longer horizon (``DMPFL_TABLE_ROUNDS=100``) is its own plan: ``dmpfl_table_r100`` records and run directories
ROUNDS = int(os.environ.get("DMPFL_TABLE_ROUNDS", "30"))
_SUFFIX = "" if ROUNDS == 30 else f"_r{ROUNDS}"
RECORD = ROOT / "benchmarks" / f"dmpfl_table{_SUFFIX}"
RUNS = ROOT / "benchmarks" / "_runs" / f"dmpfl_table{_SUFFIX}"
CODE = Path(os.environ.get("DMPFL_TABLE_CODE", ROOT)).resolve()
DATA = os.environ.get("DMPFL_TABLE_DATA", str(ROOT / "data" / "cifar10"))
SEEDS = (0, 1, 2)

_SHIFT = {"class_path": "pl_fedsparse.callbacks.ShiftEvaluation",
          "init_args": {"shifts": [0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0], "corruptions": "all", "severities": [5]}}
#: method -> pl-fed fit arguments (the same as benchmarks/cifar10_dmpfl.sh's)
METHODS: dict[str, list[str]] = {
    "dmpfl_plus": ["--config", "configs/cifar10_dmpfl_plus_cpu.yaml"],
    "fedavg": ["--config", "configs/cifar10_dmpfl_cpu.yaml", "--trainer.callbacks", json.dumps([_SHIFT])],
    "fedavg_ft": ["--config", "configs/cifar10_dmpfl_cpu.yaml", "--trainer.callbacks", json.dumps(
        [{"class_path": "pl_fedsparse.callbacks.FineTune", "init_args": {"epochs": 2}}, _SHIFT])],
    "ditto": ["--config", "configs/cifar10_ditto_cpu.yaml"],
    "local": ["--config", "configs/cifar10_dmpfl_cpu.yaml", "--trainer.callbacks", json.dumps(
        [{"class_path": "pl_fedsparse.callbacks.LocalTraining"}, _SHIFT])],
    "feddst": ["--config", "configs/cifar10_feddst_cpu.yaml"],
}
#: Table 1's shift levels (the page's "avg"; 50 % is evaluated too but is not one of them)
LEVELS = (0, 20, 40, 60, 80, 100)


def plan() -> list[Run]:
    """Every method at seed 0 first, then seeds 1 and 2 (a stopped plan still leaves a whole table);
    ``DMPFL_TABLE_METHODS=dmpfl_plus,fedavg`` keeps some methods only."""
    keep = [m for m in os.environ.get("DMPFL_TABLE_METHODS", "").split(",") if m]
    unknown = sorted(set(keep) - set(METHODS))
    if unknown:
        raise SystemExit(f"error: DMPFL_TABLE_METHODS={','.join(keep)} is invalid: expected names from "
                         f"{', '.join(METHODS)}")
    rounds = [] if ROUNDS == 30 else ["--trainer.num_rounds", str(ROUNDS)]
    return [Run(f"{m}_seed{s}", [*args, "--data.root", DATA, "--seed_everything", str(s), "--data.seed", str(s),
                                 "--trainer.logger", "false", *rounds], {"seed": s, "method": m})
            for s in SEEDS for m, args in METHODS.items() if not keep or m in keep]


def _final(name: str) -> dict | None:
    path = RECORD / name / "summary.json"
    return json.loads(path.read_text())["final"] if path.exists() else None


def at_level(final: dict, level: int, key: str) -> float:
    return final[key] if level == 0 else final[f"shift{level}/{key}"]


def table() -> None:
    """Mean ± sample std over the recorded seeds: 0 % / 100 % / Table 1's average, corruptions."""
    rows = [("Local", "local", "acc_mean"), ("FedAvg", "fedavg", "acc_mean"), ("FedAvg+FT", "fedavg_ft", "acc_mean"),
            ("Ditto", "ditto", "acc_mean"), ("FedDST", "feddst", "acc_mean"),
            ("DM-PFL (θ_c alone)", "dmpfl_plus", "personal_only_acc"), ("DM-PFL+", "dmpfl_plus", "acc_mean"),
            ("DM-PFL's θ_g", "dmpfl_plus", "global_acc")]
    print("| method | seeds | 0 % | 100 % | avg | corruptions |")
    print("|---|---|---|---|---|---|")
    for label, method, key in rows:
        finals = [f for f in (_final(f"{method}_seed{s}") for s in SEEDS) if f is not None]
        if not finals:
            print(f"| {label} | 0 | (not run) | | | |")
            continue

        print(f"| {label} | {len(finals)} | {percent_spread([at_level(f, 0, key) for f in finals])} | "
              f"{percent_spread([at_level(f, 100, key) for f in finals])} | "
              f"{percent_spread([statistics.fmean(at_level(f, x, key) for x in LEVELS) for f in finals])} | "
              f"{percent_spread([f['corruption_avg/' + key] for f in finals])} |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
