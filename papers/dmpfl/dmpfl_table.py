"""DM-PFL's Table 1 at CPU scale, every row recorded, three seeds: DM-PFL / DM-PFL+ against its paper's baselines.

The runs are a sweep, ``configs/sweeps/dmpfl_table.yaml`` (``pl-fed sweep``): the setting of
``configs/cifar10_dmpfl_cpu.yaml`` (McMahan CNN, 20 clients, 10 per round, E = 2, Dir(0.3) with quantity skew over a
seeded 10,000-image subsample, 0.75 / 0.25 per client, 30 rounds; every method evaluated at the last round at
0/20/40/50/60/80/100 % shift and under the nine corruptions at severity 5), six methods × seeds 0-2, whose records are
kept: ``papers/dmpfl/records/dmpfl_table/<method>_seed<s>/`` (run directories: ``benchmarks/_runs/dmpfl_table/``). This script
is what the sweep is not: the table over the records, and the plan's knobs as environment variables.

Rows: ``dmpfl_plus`` (one DM-PFL+ run gives DM-PFL — its personal model θ_c alone, ``personal_only_acc`` — and
DM-PFL+ — the adaptive choice, ``acc_mean`` — and DM-PFL's global model θ_g, ``global_acc``), ``fedavg`` (its
``global_acc`` is FedAvg's model; every personal model is that model), ``fedavg_ft``, ``ditto``, ``local``,
``feddst``. Seeds: ``--seed_everything s --data.seed s`` (the subsample, the partition, the initial weights and the
sampling all change with the seed).

    mkdir -p data/cifar10 && tar -xzf ../shared/data/cifar10-jpg.tar.gz -C data/cifar10
    git worktree add ../bench HEAD                      # pin the code for the hours the runs take
    DMPFL_TABLE_CODE=../bench nohup python papers/dmpfl/dmpfl_table.py run --parallel 2 \\
        > /tmp/dmpfl_table.log 2>&1 &                   # ~6-8 min per run on one core, 18 runs
    python papers/dmpfl/dmpfl_table.py table              # mean ± sample std over the recorded seeds
    python papers/dmpfl/dmpfl_table.py plan               # the runs, their state and arguments (pl-fed sweep --dry-run)
    DMPFL_TABLE_CODE=../bench python papers/dmpfl/dmpfl_table.py run --extra --parallel 2
                                                        # seeds 3-4 of the "not shown" claims' methods
    DMPFL_TABLE_ROUNDS=100 DMPFL_TABLE_CODE=../bench python papers/dmpfl/dmpfl_table.py run --extra --parallel 2
    DMPFL_TABLE_ROUNDS=100 DMPFL_TABLE_CODE=../bench python papers/dmpfl/dmpfl_table.py run --parallel 2
                                                        # the 100-round plan: every row, 15-35 min a run
    DMPFL_TABLE_ROUNDS=100 DMPFL_TABLE_METHODS=ditto ... run   # some methods only

``run`` and ``plan`` take any further ``pl-fed sweep`` option (``--parallel N``, ``--only GLOB``); a stopped ``run``
continues with the same command. The same sweep without this script::

    pl-fed sweep --grid configs/sweeps/dmpfl_table.yaml --set data.root=$PWD/data/cifar10 --parallel 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

import runplan
import yaml
from runplan import percent_spread

from pl_fedsparse.sweep import SweepRun, campaign

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
#: the sweep: six methods (``name``: config and callbacks) × seeds 0-2
GRID = ROOT / "configs" / "sweeps" / "dmpfl_table.yaml"
#: a longer horizon (``DMPFL_TABLE_ROUNDS=100``) is its own plan: ``dmpfl_table_r100`` records and run directories
ROUNDS = int(os.environ.get("DMPFL_TABLE_ROUNDS", "30"))
_SUFFIX = "" if ROUNDS == 30 else f"_r{ROUNDS}"
RECORD = ROOT / "papers" / "dmpfl" / "records" / f"dmpfl_table{_SUFFIX}"
RUNS = ROOT / "benchmarks" / "_runs" / f"dmpfl_table{_SUFFIX}"
CODE = Path(os.environ.get("DMPFL_TABLE_CODE", ROOT)).resolve()
DATA = os.environ.get("DMPFL_TABLE_DATA", str(ROOT / "data" / "cifar10"))
SEEDS = (0, 1, 2)
#: the methods, in the grid's order
METHODS = [entry["name"] for entry in yaml.safe_load(GRID.read_text())["configs"]]
#: claims "not shown" at three seeds whose runs are cheap also run at these seeds (``run --extra``: the same sweep at
#: ``EXTRA_SEEDS``, the horizon's ``EXTRA_METHODS`` only; recorded beside the others). 30 rounds (6-20 min a run):
#: DM-PFL+ > FedAvg at 100 % shift (paired p 0.072), DM-PFL+ > DM-PFL on average over shifts (p 0.114), DM-PFL >
#: FedAvg+FT at 100 % shift (p 0.711). 100 rounds (17-35 min a run): DM-PFL > FedAvg+FT with and without shift and
#: DM-PFL > Ditto
EXTRA_SEEDS = (3, 4)
EXTRA_METHODS_BY_ROUNDS = {30: ("dmpfl_plus", "fedavg", "fedavg_ft"), 100: ("dmpfl_plus", "fedavg_ft", "ditto")}
EXTRA_METHODS = EXTRA_METHODS_BY_ROUNDS.get(ROUNDS, ())
#: Table 1's shift levels (the page's "avg"; 50 % is evaluated too but is not one of them)
LEVELS = (0, 20, 40, 60, 80, 100)


def sweep_args() -> list[str]:
    """The ``pl-fed sweep`` arguments of this plan: the grid, the data, the horizon, its folders and
    ``DMPFL_TABLE_METHODS=dmpfl_plus,fedavg`` (some methods only)."""
    keep = [m for m in os.environ.get("DMPFL_TABLE_METHODS", "").split(",") if m]
    unknown = sorted(set(keep) - set(METHODS))
    if unknown:
        raise SystemExit(f"error: DMPFL_TABLE_METHODS={','.join(keep)} is invalid: expected names from "
                         f"{', '.join(METHODS)}")
    rounds = [] if ROUNDS == 30 else ["--set", f"trainer.num_rounds={ROUNDS}"]
    only = [x for m in keep for x in ("--only", f"{m}_seed*")]
    return ["--grid", str(GRID), "--set", f"data.root={DATA}", *rounds, "--out", str(RUNS), "--record", str(RECORD),
            *only]


def extra_args() -> list[str]:
    """The ``pl-fed sweep`` arguments of the extra seeds: ``EXTRA_METHODS`` at ``EXTRA_SEEDS`` (none for a horizon
    without them)."""
    if not EXTRA_METHODS:
        return []
    return [*sweep_args(), "--seeds", *map(str, EXTRA_SEEDS), *(x for m in EXTRA_METHODS for x in ("--only", f"{m}_seed*"))]


def plan(extra: bool = False) -> list[SweepRun]:
    """The sweep's runs: every method at seed 0 first, then seeds 1 and 2 (a stopped plan still leaves a whole
    table); with ``extra``, the extra seeds' runs (:func:`extra_args`)."""
    if extra:
        return campaign(extra_args()).runs if extra_args() else []
    return campaign(sweep_args()).runs


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


def main() -> int:
    """``run`` (the sweep; further arguments go to ``pl-fed sweep``), ``plan`` (its ``--dry-run``), ``check`` (every
    run's arguments resolve: no data, no training), ``table``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=["run", "plan", "check", "table"])
    ap.add_argument("--extra", action="store_true", help="the extra seeds (EXTRA_SEEDS x EXTRA_METHODS) instead")
    a, rest = ap.parse_known_args()
    if a.verb == "table":
        table()
        return 0
    if a.verb == "check":
        for run in plan():
            runplan.resolve(runplan.Run(run.name, run.fit_args()))
            print(f"{run.name}: resolves", flush=True)
        return 0
    if a.extra and not extra_args():
        raise SystemExit(f"error: --extra: DMPFL_TABLE_ROUNDS={ROUNDS} has no extra seeds; expected one of "
                         f"{', '.join(map(str, EXTRA_METHODS_BY_ROUNDS))}")
    args = [*(extra_args() if a.extra else sweep_args()), *(["--dry-run"] if a.verb == "plan" else []), *rest]
    print(f"# code: {CODE} at {runplan.commit_of(CODE)}", flush=True)
    return subprocess.call([sys.executable, "-m", "pl_fedsparse.cli", "sweep", *args], cwd=CODE)


if __name__ == "__main__":
    sys.exit(main())
