"""DM-PFL's mask readjustment on the synthetic task, recorded: the paper gives neither α_s nor its interval.

``configs/synthetic_dmpfl.yaml`` (the embedded synthetic task, no data files: MLP, 20 clients, 10 per round, 20 rounds,
one Phase 1 + Phase 2, shift views at 0/50/100 %) with five readjustment schedules of ``DualMask``, seeds 0, 1, 2
(``--seed_everything s --data.seed s``):

* ``cos0.5_every1`` — cosine-annealed from 0.5, every round (the default; FedSpa/DisPFL's schedule);
* ``cos0.2_every1`` — the same from 0.2;
* ``const0.05_every1`` — a constant 5 % every round;
* ``const0.01_every10`` — FedDST's: 1 % every 10 rounds;
* ``none`` — no readjustment (α = 0): every personal mask stays the shared initial draw.

Reported: the personal model's accuracy (``acc_mean``) clean, at 100 % shift and averaged over the shift views
(``shift_avg``), and DM-PFL+'s adaptive prediction (``adaptive_acc``), mean ± sample std over the seeds. Records:
``papers/dmpfl/records/dmpfl_alpha_sweep/<schedule>_seed<s>/``.

    OMP_NUM_THREADS=1 python papers/dmpfl/dmpfl_alpha_sweep.py run     # 15 short runs, resumable
    python papers/dmpfl/dmpfl_alpha_sweep.py table
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

import runplan
import yaml
from runplan import Run, percent_spread

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "dmpfl" / "records" / "dmpfl_alpha_sweep"
RUNS = ROOT / "benchmarks" / "_runs" / "dmpfl_alpha_sweep"
CODE = Path(os.environ.get("DMPFL_SWEEP_CODE", ROOT)).resolve()
CONFIG = "configs/synthetic_dmpfl.yaml"
SEEDS = (0, 1, 2)
VARIANTS = {
    "cos0.5_every1": {"alpha0": 0.5, "schedule": "cosine", "every_n_rounds": 1},
    "cos0.2_every1": {"alpha0": 0.2, "schedule": "cosine", "every_n_rounds": 1},
    "const0.05_every1": {"alpha0": 0.05, "schedule": "constant", "every_n_rounds": 1},
    "const0.01_every10": {"alpha0": 0.01, "schedule": "constant", "every_n_rounds": 10},
    "none": {"alpha0": 0.0, "schedule": "constant", "every_n_rounds": 1},
}
#: (column, summary key) of the table
COLUMNS = (("personal", "acc_mean"), ("personal 100 % shift", "shift100/acc_mean"),
           ("personal shift avg", "shift_avg/acc_mean"), ("DM-PFL+", "adaptive_acc"),
           ("DM-PFL+ shift avg", "shift_avg/adaptive_acc"))


def plan() -> list[Run]:
    callbacks = yaml.safe_load((ROOT / CONFIG).read_text())["trainer"]["callbacks"]
    runs = []
    for s in SEEDS:
        for name, rate in VARIANTS.items():
            cbs = [dict(cb, init_args={**cb.get("init_args", {}), **rate}) if cb["class_path"].endswith(".DualMask")
                   else cb for cb in callbacks]
            runs.append(Run(f"{name}_seed{s}", ["--config", CONFIG, "--trainer.callbacks", json.dumps(cbs),
                                                "--seed_everything", str(s), "--data.seed", str(s),
                                                "--trainer.logger", "false"], {"seed": s, "variant": name}))
    return runs


def table() -> None:
    print("| readjustment | seeds | " + " | ".join(c for c, _ in COLUMNS) + " |")
    print("|---|---|" + "---|" * len(COLUMNS))
    for name in VARIANTS:
        finals = [json.loads(p.read_text())["final"] for p in
                  (RECORD / f"{name}_seed{s}" / "summary.json" for s in SEEDS) if p.exists()]
        if not finals:
            print(f"| {name} | 0 |" + " |" * len(COLUMNS))
            continue
        print(f"| {name} | {len(finals)} | " + " | ".join(percent_spread([f[k] for f in finals]) for _, k in COLUMNS)
              + " |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
