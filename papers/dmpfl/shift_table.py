"""Print the DM-PFL comparison table of a papers/dmpfl/cifar10_dmpfl.sh output folder.

``python papers/dmpfl/shift_table.py benchmarks/_runs/cifar10_dmpfl``: personal accuracy at 0 / 50 / 100 % shift, the
average over Table 1's levels (0, 20, 40, 60, 80, 100 %), the average over the corruptions, and communication and
training FLOPs per client relative to FedAvg. DM-PFL is read from the DM-PFL+ run's plain personal model
(``personal_only_acc``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS = [("Local", "local", "acc"), ("FedAvg", "fedavg", "acc"), ("FedAvg+FT", "fedavg_ft", "acc"),
        ("Ditto", "ditto", "acc"), ("FedDST", "feddst", "acc"), ("DM-PFL", "dmpfl", "personal_only"),
        ("DM-PFL+", "dmpfl", "acc")]
PAPER_LEVELS = (0, 20, 40, 60, 80, 100)


def metric(row: dict, level_or_view: int | str, kind: str) -> float | None:
    key = "acc_mean" if kind == "acc" else f"{kind}_acc"
    if level_or_view == 0:
        return row.get(key)
    view = f"shift{level_or_view}" if isinstance(level_or_view, int) else level_or_view
    return row.get(f"{view}/{key}")


def main(out: str) -> None:
    runs = {}
    for _, d, _ in ROWS:
        p = Path(out) / d / "summary.json"
        if p.exists():
            runs[d] = json.loads(p.read_text())
    base = runs.get("fedavg")
    print("| method | 0 % | 50 % | 100 % | avg 0-100 % | corruptions (sev. 5) | MB / client | vs FedAvg "
          "| train FLOPs / client | vs FedAvg |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, d, kind in ROWS:
        if d not in runs:
            continue
        s = runs[d]
        f = s["final"]
        accs = [metric(f, x, kind) for x in PAPER_LEVELS]
        avg = sum(accs) / len(accs) if all(a is not None for a in accs) else None  # type: ignore[arg-type]
        corr_key = "corruption_avg/" + ("acc_mean" if kind == "acc" else f"{kind}_acc")
        mb = s["comm_cum_bytes_total"] / 1e6 / s["num_clients"]
        fl = s["flops_train_cum"] / s["num_clients"]
        rel_mb = f"{100 * s['comm_cum_bytes_total'] / base['comm_cum_bytes_total']:.1f} %" if base else "-"
        rel_fl = f"{100 * s['flops_train_cum'] / base['flops_train_cum']:.1f} %" if base else "-"

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{100 * v:.2f}"

        print(f"| {label} | {pct(accs[0])} | {pct(metric(f, 50, kind))} | {pct(accs[-1])} | {pct(avg)} "
              f"| {pct(f.get(corr_key))} | {mb:.2f} | {rel_mb} | {fl:.3e} | {rel_fl} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/_runs/cifar10_dmpfl")
