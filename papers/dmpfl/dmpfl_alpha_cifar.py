"""DM-PFL's readjustment rate α_s on real CIFAR-10 (the paper gives neither α_s nor its interval).

The CPU DM-PFL+ benchmark (``configs/cifar10_dmpfl_plus_cpu.yaml``: McMahan CNN, 20 clients, 10 per round, E = 2,
Dir(0.3) with quantity skew, 30 rounds, shift views at the last round) with three readjustment schedules of
``DualMask``:

* ``cos0.5_every1`` — the current default: cosine-annealed from 0.5, every round (FedSpa/DisPFL's schedule);
* ``cos0.1_every1`` — the same schedule from 0.1 (between the two);
* ``const0.01_every10`` — FedDST's: 1 % of each layer's kept positions every 10 rounds.

Reported per run: personal accuracy of DM-PFL+ (adaptive, ``acc_mean``) and of the personal model alone
(``personal_only_acc``) without shift, at 100 % shift and averaged over the shift levels; bytes; and the share of
uploaded positions that carry an exact zero (``upload_zero_share_cum``: regrown positions start at zero and enter
Eq. 5 as such).

    git worktree add ../bench HEAD
    for w in 1 2; do DMPFL_ALPHA_CODE=../bench OMP_NUM_THREADS=1 nohup python papers/dmpfl/dmpfl_alpha_cifar.py run \\
        > /tmp/dmpfl_alpha_w$w.log 2>&1 & done
    python papers/dmpfl/dmpfl_alpha_cifar.py table
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

import runplan
import yaml
from runplan import Run

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "dmpfl" / "records" / "dmpfl_alpha_cifar"
RUNS = ROOT / "benchmarks" / "_runs" / "dmpfl_alpha_cifar"
CODE = Path(os.environ.get("DMPFL_ALPHA_CODE", ROOT)).resolve()
DATA = os.environ.get("DMPFL_ALPHA_DATA", str(ROOT / "data" / "cifar10"))
CONFIG = "configs/cifar10_dmpfl_plus_cpu.yaml"
VARIANTS = {
    "cos0.5_every1": {"alpha0": 0.5, "schedule": "cosine", "every_n_rounds": 1},
    "cos0.1_every1": {"alpha0": 0.1, "schedule": "cosine", "every_n_rounds": 1},
    "const0.01_every10": {"alpha0": 0.01, "schedule": "constant", "every_n_rounds": 10},
}


def plan() -> list[Run]:
    callbacks = yaml.safe_load((ROOT / CONFIG).read_text())["trainer"]["callbacks"]
    runs = []
    for name, rate in VARIANTS.items():
        cbs = [dict(cb, init_args={**cb.get("init_args", {}), **rate}) if cb["class_path"].endswith(".DualMask")
               else cb for cb in callbacks]
        runs.append(Run(name, ["--config", CONFIG, "--data.root", DATA, "--trainer.callbacks", json.dumps(cbs),
                               "--trainer.logger", "false"]))
    return runs


def table() -> None:
    print("| α_s schedule | DM-PFL+ 0 % / 100 % / avg shift | DM-PFL (personal only) 0 % / 100 % / avg | total MB | "
          "zero share of uploads |")
    print("|---|---|---|---|---|")
    for run in plan():
        path = RECORD / run.name / "metrics.jsonl"
        if not path.exists():
            print(f"| {run.name} | (not run) | | | |")
            continue
        last = [json.loads(x) for x in path.read_text().splitlines() if x.strip()][-1]

        def pct(*keys: str, row: dict = last) -> str:  # the first key present (as_personal: DM-PFL+ in acc_mean)
            v = next((row[k] for k in keys if row.get(k) is not None), None)
            return "-" if v is None else f"{100 * v:.2f}"

        plus = [pct(f"{p}adaptive_acc", f"{p}acc_mean") for p in ("", "shift100/", "shift_avg/")]
        alone = [pct(f"{p}personal_only_acc", f"{p}acc_mean") for p in ("", "shift100/", "shift_avg/")]
        print(f"| {run.name} | {' / '.join(plus)} | {' / '.join(alone)} | "
              f"{last.get('comm_cum_bytes_total', 0) / 1e6:.1f} | {pct('upload_zero_share_cum')} % |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
