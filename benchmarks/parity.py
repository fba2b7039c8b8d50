"""Engine parity: run every shipped synthetic config (plus the CIFAR-10 CPU method configs shrunk onto the synthetic
task, so Gossip, Ditto, DualMask/FedDST, FedSpa and FineTune(consensus) are covered too) and record, per evaluated
round, the accuracies, bytes and FLOPs of ``metrics.jsonl``. Used to show that a refactor of the engine leaves
results unchanged.

    python benchmarks/parity.py record benchmarks/parity/before.json     # before the change
    python benchmarks/parity.py record benchmarks/parity/after.json      # after it
    python benchmarks/parity.py compare benchmarks/parity/before.json benchmarks/parity/after.json

``compare`` prints, per run, whether every recorded number is equal (bit-for-bit as JSON floats) and the first
differences otherwise. Run from the repository root; each run writes to ``benchmarks/_runs/parity/<name>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: metrics compared (times are not)
KEYS = ("acc_mean", "acc_weighted", "acc_std", "acc_bottom10", "global_acc", "loss_mean", "train_loss",
        "comm_bytes_up", "comm_bytes_down", "comm_bytes_total", "comm_cum_bytes_total", "comm_busiest_node_bytes",
        "comm_links", "flops_train", "flops_train_cum", "adaptive_acc", "personal_only_acc", "shift_avg/acc_mean",
        "corruption_avg/acc_mean", "global_mask_density", "num_participants")

_SYNTH = ["--data.name", "synthetic", "--data.root", "null", "--data.num_clients", "8", "--data.max_train_samples",
          "null", "--data.augment", "false", "--data.batch_size", "32",
          "--model.backbone", "pl_fedsparse.models.MLP", "--model.backbone.init_args.num_classes", "10",
          "--model.backbone.init_args.in_channels", "3", "--model.backbone.init_args.input_size", "16",
          "--trainer.accelerator", "cpu", "--trainer.local_epochs", "1"]

#: (name, config, extra args)
RUNS: list[tuple[str, str, list[str]]] = [
    (p.stem, str(p), []) for p in sorted(Path("configs").glob("synthetic_*.yaml")) if p.stem not in (
        "synthetic_fedprox", "synthetic_snip_fedspa", "synthetic_fedpse")  # added since (no "before")
] + [("quickstart", "configs/quickstart.yaml", [])] + [
    (f"mini_{name}", f"configs/cifar10_{name}_cpu.yaml", _SYNTH + ["--trainer.num_rounds", rounds,
                                                                   "--trainer.eval_every", "2"])
    for name, rounds in [("dispfl", "4"), ("dpsgd_ft", "4"), ("ditto", "4"), ("feddst", "4"),
                         ("fedspa_dst", "4"), ("fedspa_rsm", "4"), ("dmpfl_plus", "6"), ("local_p2p", "2")]
]


def _row(r: dict) -> dict:
    return {k: r[k] for k in ("round", *KEYS) if k in r}


def record(out: str, only: list[str]) -> None:
    results: dict[str, object] = {}
    if Path(out).exists():
        results = json.loads(Path(out).read_text())
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    for name, cfg, extra in RUNS:
        if only and name not in only:
            continue
        if not Path(cfg).exists():
            continue
        run = Path("benchmarks/_runs/parity") / name
        shutil.rmtree(run, ignore_errors=True)
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "pl_fedsparse.cli", "fit", "--config", cfg, *extra,
               "--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{name}: FAILED\n{p.stderr[-2000:]}")
            results[name] = {"error": p.stderr[-500:]}
            continue
        rows = [_row(r) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if r.get("evaluated", True)]  # the evaluated rounds (records before every round had a row)
        results[name] = {"config": cfg, "extra": extra, "rows": rows}
        print(f"{name}: {len(rows)} rows, final acc_mean={rows[-1].get('acc_mean')} "
              f"bytes={rows[-1].get('comm_cum_bytes_total')} ({time.perf_counter() - t:.0f} s)", flush=True)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1) + "\n")


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        ra, rb = a.get(name, {}).get("rows"), b.get(name, {}).get("rows")
        if ra is None or rb is None:
            print(f"{name:28s} only in {'after' if ra is None else 'before'}")
            continue
        diffs = []
        for x, y in zip(ra, rb):
            for k in sorted(set(x) | set(y)):
                if x.get(k) != y.get(k):
                    diffs.append(f"round {x.get('round')} {k}: {x.get(k)} -> {y.get(k)}")
        if len(ra) != len(rb):
            diffs.append(f"rows {len(ra)} -> {len(rb)}")
        bad += bool(diffs)
        print(f"{name:28s} {'identical' if not diffs else f'{len(diffs)} differences'}")
        for d in diffs[:6]:
            print(f"    {d}")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__)
        sys.exit(2)
