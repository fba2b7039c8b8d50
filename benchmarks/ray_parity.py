"""The same metrics.jsonl in process and with 1, 2 and 3 Ray workers.

For each config, runs ``pl-fed fit`` in process and with ``RayExecutor`` (``num_workers`` 1, 2, 3; one CPU and one
torch thread per worker), then compares every metrics row key by key — everything but wall times (``time_*``).
The in-process runs use one torch thread (``OMP_NUM_THREADS=1``), as every worker does; ``--threads 2`` adds an
in-process run with two threads to show what a different intra-op thread count does.

    python benchmarks/ray_parity.py --out benchmarks/ray_parity            # ~5 min on 2 cores
    python benchmarks/ray_parity.py --configs quickstart --workers 2 --rounds 2   # a quick look

Writes ``<out>/parity.json`` (the comparison) and prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["quickstart", "synthetic_fedspa", "synthetic_dispfl", "synthetic_dmpfl"]


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def differences(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[str]:
    """Keys whose values differ (wall times excepted), as ``round:key``."""
    out = [] if len(a) == len(b) else [f"rows: {len(a)} vs {len(b)}"]
    for x, y in zip(a, b):
        for k in sorted(set(x) | set(y)):
            if k.startswith("time") or k == "worker_retries":
                continue
            if x.get(k) != y.get(k):
                out.append(f"{x.get('round')}:{k}")
    return out


def fit(config: str, run_dir: Path, workers: int | None, rounds: int | None, threads: int) -> float:
    cmd = [sys.executable, "-m", "pl_fedsparse.cli", "fit", "--config", f"configs/{config}.yaml",
           "--trainer.default_root_dir", str(run_dir), "--trainer.enable_progress_bar", "false"]
    if rounds:
        cmd += ["--trainer.num_rounds", str(rounds)]
    if workers:
        cmd += ["--trainer.executor", "pl_fedsparse.executors.RayExecutor",
                "--trainer.executor.num_workers", str(workers)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary.get("wall_time_s") or summary.get("time_cum_s") or 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=CONFIGS)
    ap.add_argument("--workers", nargs="+", type=int, default=[1, 2, 3])
    ap.add_argument("--rounds", type=int, default=None, help="override num_rounds (default: the config's)")
    ap.add_argument("--threads", nargs="+", type=int, default=[1], help="in-process torch threads to compare")
    ap.add_argument("--out", type=Path, default=None, help="write parity.json here")
    args = ap.parse_args()
    report: dict[str, Any] = {"configs": {}, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="ray_parity_") as tmp:
        for config in args.configs:
            ref_dir = Path(tmp) / config / "in_process_t1"
            fit(config, ref_dir, None, args.rounds, 1)
            ref = rows(ref_dir)
            entry: dict[str, Any] = {"rows": len(ref), "final_acc_mean": ref[-1].get("acc_mean")}
            for threads in [t for t in args.threads if t != 1]:
                d = Path(tmp) / config / f"in_process_t{threads}"
                fit(config, d, None, args.rounds, threads)
                diff = differences(ref, rows(d))
                entry[f"in_process_{threads}_threads"] = {"identical": not diff, "differing": diff[:20]}
                print(f"{config:18s} in process, {threads} threads: {'identical' if not diff else diff[:5]}")
            for w in args.workers:
                d = Path(tmp) / config / f"ray{w}"
                fit(config, d, w, args.rounds, 1)
                diff = differences(ref, rows(d))
                entry[f"ray_{w}_workers"] = {"identical": not diff, "differing": diff[:20]}
                print(f"{config:18s} Ray, {w} worker(s): {'identical' if not diff else diff[:5]}", flush=True)
            report["configs"][config] = entry
            shutil.rmtree(Path(tmp) / config, ignore_errors=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "parity.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
