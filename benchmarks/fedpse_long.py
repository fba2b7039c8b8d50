"""FedPSE against FedAvg under the paper's protocol for 100 rounds (the recorded protocol runs stop at 5).

The paper does not state its number of rounds; its example code loops 100. This plan takes the protocol runs of
``benchmarks/fedpse_tables.py run protocol`` (Fashion-MNIST, the whole training split, 10 clients, the Flower split
``noniid_order: halves`` at λ = 1 and 0.5, each method's swept lr and batch, seeds 0-2) to 100 rounds, evaluating
every 5 and checkpointing every 5. A round is one epoch over 60,000 images: ~65 s on one CPU core, so one run is
~1.8 h and the plan ~22 h of one core. A run resumes on the machine it started on, but it cannot be parked in git
(its checkpoint holds ten personal CNNs and their residuals: ~200 MB, over ``runplan.PARK_LIMIT_MB``), so on the CPU
each run must finish within the session that starts it — two workers started early in a session finish two runs —
and on a lent GPU (a round takes ~2 s) ``benchmarks/gpu_plans.sh`` runs the plan in minutes::

    git worktree add ../bench HEAD                        # pin the code for hours of runs
    apt-get install -y dataset-fashion-mnist              # the data (../shared/data/README.md)
    for w in 1 2; do FEDPSE_LONG_CODE=../bench OMP_NUM_THREADS=1 nohup python benchmarks/fedpse_long.py run \\
        > /tmp/fedpse_long_w$w.log 2>&1 & done           # two workers, one core each
    python benchmarks/fedpse_long.py table                # the claims at rounds 5, 20, 50, 100 (so far)
    python benchmarks/fedpse_long.py check                # every run's arguments resolve (no data, no training)

On a GPU the configs' ``accelerator: auto`` takes it (a round is seconds). Records:
``benchmarks/fedpse_long/<run>/{config.yaml,metrics.jsonl,summary.json}``; run directories under
``benchmarks/_runs/fedpse_long/`` (not kept).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import fedpse_tables
import runplan
from runplan import Run

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "fedpse_long"
RUNS = ROOT / "benchmarks" / "_runs" / "fedpse_long"
CODE = Path(os.environ.get("FEDPSE_LONG_CODE", ROOT)).resolve()
DATA = os.environ.get("FEDPSE_LONG_DATA", "/usr/share/datasets/fashion-mnist")
ROUNDS = 100  # the paper's example code (the paper states none)
EVERY = 5
#: the rounds the table reports (1-based: "after round r")
REPORTED = (5, 20, 50, 100)


def plan() -> list[Run]:
    """The protocol plan's runs, with 100 rounds, evaluation and checkpoints every 5 rounds, seed 0 first."""
    runs = []
    for spec in fedpse_tables.plan("protocol"):
        cmd = fedpse_tables.command({**spec, "rounds": ROUNDS})
        if cmd is None:  # the swept lr/batch (fedpse_tables/sweep.json) is committed; a missing one is a bug
            raise SystemExit(f"error: run {spec['name']}: no lr/batch chosen for it in benchmarks/fedpse_tables/"
                             "sweep.json; expected the committed sweep")
        args = cmd[cmd.index("fit") + 1:]
        i = args.index("--trainer.default_root_dir")  # run_plan names the run directory
        del args[i:i + 2]
        runs.append(Run(spec["name"], [*args, "--data.root", DATA, "--trainer.eval_every", str(EVERY),
                                       "--trainer.checkpoint_every", str(EVERY), "--trainer.logger", "false"],
                        {"method": spec["method"], "lam": spec["lam"], "seed": spec["seed"]}))
    return runs


def _acc_after(name: str, rnd: int) -> float | None:
    """Personal accuracy (mean over clients) after 1-based round ``rnd``, from the record or a running run."""
    for base in (RECORD, RUNS):
        path = base / name / "metrics.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                if row.get("round") == rnd - 1 and row.get("acc_mean") is not None:
                    return float(row["acc_mean"])
    return None


def table() -> None:
    """FedPSE vs FedAvg at λ = 1 and 0.5 after each reported round: mean ± std over the seeds that got there."""
    print("| λ | after round | FedPSE | FedAvg | seeds (FedPSE / FedAvg) |")
    print("|---|---|---|---|---|")
    runs = plan()
    for lam in fedpse_tables.PROTOCOL["lams"]:
        for rnd in REPORTED:
            cells, counts = [], []
            for method in fedpse_tables.PROTOCOL["methods"]:
                vals = [a for r in runs if r.meta["method"] == method and r.meta["lam"] == lam
                        if (a := _acc_after(r.name, rnd)) is not None]
                cells.append(runplan.percent_spread(vals) if vals else "-")
                counts.append(str(len(vals)))
            print(f"| {lam:g} | {rnd} | {cells[0]} | {cells[1]} | {' / '.join(counts)} |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
