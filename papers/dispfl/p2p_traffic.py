"""Per-round traffic of serverless runs: ``python papers/dispfl/p2p_traffic.py <run_dir> [...]``.

Prints, per run, the mean over evaluated rounds of the busiest node's receive and send volume (MB), the links per
round and their mean size, and the total MB per round — DisPFL reports the busiest node's one-direction MB per round.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(dirs: list[str]) -> None:
    print("| run | busiest node in (MB/round) | busiest node out (MB/round) | links/round | MB/link | total MB/round |")
    print("|---|---|---|---|---|---|")
    for d in dirs:
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]

        def mean(key: str) -> float:
            return sum(r.get(key, 0) for r in rows) / len(rows)

        print(f"| {Path(d).name} | {mean('comm_busiest_node_in_bytes') / 1e6:.2f} "
              f"| {mean('comm_busiest_node_out_bytes') / 1e6:.2f} | {mean('comm_links'):.0f} "
              f"| {mean('comm_bytes_per_link') / 1e6:.3f} | {mean('comm_bytes_total') / 1e6:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
