#!/usr/bin/env bash
# CPU benchmark of FedSpa (DST, RSM) on real CIFAR-10, in the exact setting of benchmarks/cifar10_baselines.sh
# (LeNet-CIFAR, 20 clients, Dir(0.3), 500 train images per client, 10 clients per round, 5 local epochs, batch 64,
# lr 0.1 * 0.998^t, wd 5e-4, clip 10, 30 rounds, density 0.5 ERK, α0 = 0.5 cosine), so the table can be read
# together with Local / FedAvg / FedAvg-FT from that script.
# Usage: bash benchmarks/cifar10_sparse.sh data/cifar10
set -euo pipefail
ROOT=${1:-data/cifar10}
OUT=${OUT:-benchmarks/_runs/cifar10_sparse}
COMMON=(--data.root "$ROOT" --trainer.accelerator cpu --trainer.enable_progress_bar false --trainer.overwrite true)
for m in dst rsm; do
  pl-fed fit --config "configs/cifar10_fedspa_${m}_cpu.yaml" "${COMMON[@]}" --trainer.default_root_dir "$OUT/fedspa_$m"
done
pl-fed report "$OUT"/fedspa_dst "$OUT"/fedspa_rsm --out "$OUT"/report
