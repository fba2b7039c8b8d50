"""FedPSE against FedAvg under the paper's protocol past the recorded 5 rounds: 20 rounds, then 100.

The paper does not state its number of rounds; its example code loops 100. This plan takes the protocol runs of
``papers/fedpse/fedpse_tables.py run protocol`` (Fashion-MNIST, the whole training split, 10 clients, the Flower split
``noniid_order: halves`` at λ = 1 and 0.5, each method's swept lr and batch, seeds 0-2) further, evaluating every 5
rounds and checkpointing every 5, in two stages:

* ``<run>_r20``: 20 rounds. A round is one epoch over 60,000 images, ~55 s on one CPU core, so a run is ~19 min and
  the stage (12 runs) ~3.8 h of one core: about one session with two workers. This is the longest horizon whose
  three seeds fit the CPU.
* ``<run>_r100``: 100 rounds, the example code's horizon, continuing the same run's ``_r20`` directory when it is on
  this machine (the engine resumes exactly, and no learning-rate schedule depends on the horizon, so the
  continuation equals a 100-round run but for the last bits that flushing moves) and starting over otherwise, with
  ``trainer.flush_denormal`` on (FedPSE's
  rounds doubled in time past round 20 without it; FedAvg's seed-0 run at λ = 1, recorded before, ran without).
  ~1.7 h a run on one core; its checkpoint (ten
  personal CNNs and their residuals: ~200 MB, over ``runplan.PARK_LIMIT_MB``) cannot be parked in git, so on the
  CPU a run must finish in the session that starts it; on a lent GPU (a round took 4.3 s on an H200 shared by
  five runs) ``benchmarks/gpu_plans.sh`` runs the stage in minutes.

Workers take the 20-round stage first (seed 0 first), then the 100-round one::

    git worktree add ../bench HEAD                        # pin the code for hours of runs
    apt-get install -y dataset-fashion-mnist              # the data (../shared/data/README.md)
    for w in 1 2; do FEDPSE_LONG_CODE=../bench OMP_NUM_THREADS=1 nohup python papers/fedpse/fedpse_long.py run \\
        > /tmp/fedpse_long_w$w.log 2>&1 & done           # two workers, one core each
    python papers/fedpse/fedpse_long.py table                # the claims at rounds 5-20 and 20-100 (so far)
    python papers/fedpse/fedpse_long.py check                # every run's arguments resolve (no data, no training)

Why this is not a sweep (``pl-fed sweep``): its 100-round stage continues each 20-round run's directory
(``runplan``'s ``start_from``: a run that starts as a copy of another finished run and resumes from its checkpoint),
which a sweep cannot express, and ``benchmarks/gpu_plans.sh`` drives it as time-boxed ``runplan`` workers. Its runs'
lr and batch are the committed choices of ``fedpse_tables.py``'s sweep (``fedpse_tables/sweep.json``), read here.

On a GPU the configs' ``accelerator: auto`` takes it. Records:
``papers/fedpse/records/fedpse_long/<run>_r{20,100}/{config.yaml,metrics.jsonl,summary.json}``; run directories under
``benchmarks/_runs/fedpse_long/`` (not kept).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

import fedpse_tables
import runplan
from runplan import Run

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "fedpse" / "records" / "fedpse_long"
RUNS = ROOT / "benchmarks" / "_runs" / "fedpse_long"
CODE = Path(os.environ.get("FEDPSE_LONG_CODE", ROOT)).resolve()
DATA = os.environ.get("FEDPSE_LONG_DATA", "/usr/share/datasets/fashion-mnist")
#: the stages' horizons: the longest whose three seeds fit one CPU session, then the paper's example code's (the
#: paper states none)
STAGES = (20, 100)
EVERY = 5
#: the rounds the table reports per stage (1-based: "after round r")
REPORTED = {20: (5, 10, 15, 20), 100: (20, 50, 100)}


def run_name(name: str, rounds: int) -> str:
    return f"{name}_r{rounds}"


def plan() -> list[Run]:
    """The protocol plan's runs at each stage's horizon (20-round stage first, seed 0 first in each), evaluation and
    checkpoints every 5 rounds; a 100-round run continues its 20-round run's directory when that is on this machine."""
    runs = []
    for rounds in STAGES:
        for spec in fedpse_tables.plan("protocol"):
            cmd = fedpse_tables.command({**spec, "rounds": rounds})
            if cmd is None:  # the swept lr/batch (fedpse_tables/sweep.json) is committed; a missing one is a bug
                raise SystemExit(f"error: run {spec['name']}: no lr/batch chosen for it in "
                                 "papers/fedpse/records/fedpse_tables/sweep.json; expected the committed sweep")
            args = cmd[cmd.index("fit") + 1:]
            i = args.index("--trainer.default_root_dir")  # run_plan names the run directory
            del args[i:i + 2]
            short = RUNS / run_name(spec["name"], STAGES[0])
            start = short if rounds != STAGES[0] and short.exists() else None
            # past round 20 FedPSE's converged personal models make subnormal floats, on which one CPU core spends
            # twice the time (benchmarks/ENGINE.md, "Converged models on a CPU"): the 100-round stage flushes
            # them (numbers move at most in their last bits; a continuation from the 20-round run may turn it on)
            ftz = ["--trainer.flush_denormal", "true"] if rounds != STAGES[0] else []
            runs.append(Run(run_name(spec["name"], rounds),
                            [*args, "--data.root", DATA, "--trainer.eval_every", str(EVERY),
                             "--trainer.checkpoint_every", str(EVERY), "--trainer.logger", "false", *ftz],
                            {"method": spec["method"], "lam": spec["lam"], "seed": spec["seed"], "rounds": rounds},
                            start_from=start))
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
    """FedPSE vs FedAvg at λ = 1 and 0.5 after each reported round of each stage: mean ± std over the seeds that got
    there."""
    print("| λ | stage | after round | FedPSE | FedAvg | seeds (FedPSE / FedAvg) |")
    print("|---|---|---|---|---|---|")
    runs = plan()
    for rounds in STAGES:
        for lam in fedpse_tables.PROTOCOL["lams"]:
            for rnd in REPORTED[rounds]:
                cells, counts = [], []
                for method in fedpse_tables.PROTOCOL["methods"]:
                    vals = [a for r in runs if r.meta["method"] == method and r.meta["lam"] == lam
                            and r.meta["rounds"] == rounds if (a := _acc_after(r.name, rnd)) is not None]
                    cells.append(runplan.percent_spread(vals) if vals else "-")
                    counts.append(str(len(vals)))
                print(f"| {lam:g} | {rounds} | {rnd} | {cells[0]} | {cells[1]} | {' / '.join(counts)} |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
