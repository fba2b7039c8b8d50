"""Print a markdown table of finished runs: ``python benchmarks/summarize.py <run_dir> [<run_dir> ...]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(dirs: list[str]) -> None:
    print("| run | rounds | personal acc (mean) | weighted | bottom decile | global acc | total MB | busiest node MB "
          "| train FLOPs | s / round |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in dirs:
        s = json.loads((Path(d) / "summary.json").read_text())
        f = s["final"]
        g = f.get("global_acc")
        rounds = f["round"] + 1
        print(f"| {Path(d).name} | {rounds} | {100 * f['acc_mean']:.2f} | {100 * f['acc_weighted']:.2f} "
              f"| {100 * f['acc_bottom10']:.2f} | {'-' if g is None else f'{100 * g:.2f}'} "
              f"| {s['comm_cum_bytes_total'] / 1e6:.1f} | {s['comm_cum_busiest_node_bytes'] / 1e6:.1f} "
              f"| {s['flops_train_cum']:.3e} | {s['time_cum_s'] / rounds:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
