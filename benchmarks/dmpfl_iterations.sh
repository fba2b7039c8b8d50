#!/usr/bin/env bash
# DM-PFL's iterative schedule (paper Fig. 5e/f: iter = 0, i.e. Phase 1 only, loses 1.13 points without shift and
# 14.14 at 100 % shift) in the CPU setting of benchmarks/cifar10_dmpfl.sh: iterations 0 and 1 (2 is the default run).
# Usage: bash benchmarks/dmpfl_iterations.sh data/cifar10
set -euo pipefail
ROOT=${1:-data/cifar10}
OUT=${OUT:-benchmarks/_runs/cifar10_dmpfl_iterations}
for it in ${ITERATIONS:-0 1}; do
  sed "s/iterations: 2  /iterations: $it  /" configs/cifar10_dmpfl_plus_cpu.yaml > "/tmp/dmpfl_iter$it.yaml"
  grep -q "iterations: $it " "/tmp/dmpfl_iter$it.yaml"
  pl-fed fit --config "/tmp/dmpfl_iter$it.yaml" --data.root "$ROOT" --trainer.enable_progress_bar false \
    --trainer.overwrite true --trainer.default_root_dir "$OUT/iter$it"
done
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| iterations | DM-PFL 0 % | DM-PFL 100 % | DM-PFL avg | DM-PFL+ 0 % | DM-PFL+ 100 % | DM-PFL+ avg | global 0 % |")
print("|---|---|---|---|---|---|---|---|")
for d in sorted(Path(sys.argv[1]).iterdir()):
    f = json.loads((d / "summary.json").read_text())["final"]
    lv = (0, 20, 40, 60, 80, 100)
    def acc(kind, x):
        key = "acc_mean" if kind == "acc" else f"{kind}_acc"
        return f[key] if x == 0 else f[f"shift{x}/{key}"]
    po = [acc("personal_only", x) for x in lv]
    ad = [acc("acc", x) for x in lv]
    print(f"| {d.name[4:]} | {100*po[0]:.2f} | {100*po[-1]:.2f} | {100*sum(po)/6:.2f} | {100*ad[0]:.2f} "
          f"| {100*ad[-1]:.2f} | {100*sum(ad)/6:.2f} | {100*f['global_acc']:.2f} |")
PY
