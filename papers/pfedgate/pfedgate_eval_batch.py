"""How much pFedGate's personal accuracy depends on the evaluation batch size, on trained federations — no retraining.

pFedGate's personal model draws one mask per *test batch* (the gate scores the batch, the knapsack keeps the blocks
that fit the budget for the whole batch; the authors' code evaluates in batches of ``bz`` = 128). So the evaluation
batch size is part of the method's evaluation protocol: ``data.eval_batch_size: null`` is ``data.batch_size`` on
every device for it (not the device's throughput choice), while ``papers/pfedgate/pfedgate_table.py`` pins 512, the
size its seed-0 runs were recorded at.

Each run of ``papers/pfedgate/pfedgate_table.py`` (40 rounds) or of its 200-round continuations is restored from its last
checkpoint and evaluated again on the test split at each ``--sizes`` value. The size the run was recorded at must
reproduce its recorded ``seen/acc_weighted`` (checked; the script stops otherwise). Printed per run and size: the
trained clients' weighted and mean accuracy, their bottom decile, the achieved density s'; written to
``papers/pfedgate/records/pfedgate_eval_batch/<plan>_<run>.json``.

    python papers/pfedgate/pfedgate_table.py run        # until the runs below have finished
    OMP_NUM_THREADS=1 python papers/pfedgate/pfedgate_eval_batch.py --runs pfedgate_table/pfedgate_s05_seed1 \\
        pfedgate_long/pfedgate_s05_seed1 --sizes 512 128 32
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
sys.path.insert(0, str(ROOT / "papers" / "dmpfl"))  # restore: a trained federation from its checkpoint

from dmpfl_shift_why import restore

RUNS = ROOT / "benchmarks" / "_runs"
RECORD = ROOT / "papers" / "pfedgate" / "records" / "pfedgate_eval_batch"
KEYS = ("seen/acc_weighted", "seen/acc_mean", "seen/acc_bottom10", "gate_density")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", required=True,
                    help="run directories under benchmarks/_runs, e.g. pfedgate_table/pfedgate_s05_seed1")
    ap.add_argument("--sizes", nargs="+", type=int, default=[512, 128, 32])
    ap.add_argument("--data-root", default=None, help="the extracted CIFAR-10 copy (default: the run's data.root)")
    a = ap.parse_args()
    RECORD.mkdir(parents=True, exist_ok=True)
    print("| run | eval batch | Acc (weighted) | Acc (mean) | bottom decile | s' |")
    print("|---|---|---|---|---|---|")
    for name in a.runs:
        run_dir = RUNS / name
        recorded = json.loads((run_dir / "summary.json").read_text())["final"]
        with tempfile.TemporaryDirectory() as tmp:
            loop = restore(run_dir, a.data_root, tmp)
            dm = loop.datamodule
            as_run = dm.eval_batch_size
            out: dict = {"run": name, "round": loop.round_idx, "recorded_eval_batch_size": as_run, "sizes": {}}
            for size in a.sizes:
                dm.eval_batch_size = size
                ev = loop.evaluate("test")
                row = {k: ev.get(k) for k in KEYS}
                out["sizes"][str(size)] = row
                if size == as_run and row["seen/acc_weighted"] != recorded["seen/acc_weighted"]:
                    raise SystemExit(f"error: {name} at its recorded eval batch {size} gives seen/acc_weighted "
                                     f"{row['seen/acc_weighted']}, the record {recorded['seen/acc_weighted']}: "
                                     "the restored federation is not the recorded one")
                print(f"| {name} | {size}{' (as run)' if size == as_run else ''} | "
                      + " | ".join("-" if row[k] is None else f"{100 * row[k]:.2f}" if k != "gate_density"
                                   else f"{row[k]:.3f}" for k in KEYS) + " |", flush=True)
        (RECORD / f"{name.replace('/', '_')}.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
