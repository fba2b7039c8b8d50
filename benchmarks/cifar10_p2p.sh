#!/usr/bin/env bash
# CPU side-by-side of serverless methods on real CIFAR-10: DisPFL vs D-PSGD vs D-PSGD-FT vs
# Local. LeNet-CIFAR, 20 clients, Dir(0.3), 500 train images per client, every client trains every round, random
# topology (each client pulls from 4 random peers, redrawn per round), 5 local epochs, batch 64, lr 0.1·0.998^t,
# wd 5e-4, clip 10, 12 rounds; DisPFL at density 0.5 (ERK, per-client initial masks, prune |w| / regrow |grad|,
# α0 = 0.5 cosine).  Usage: bash benchmarks/cifar10_p2p.sh data/cifar10
set -euo pipefail
ROOT=${1:-data/cifar10}
OUT=${OUT:-benchmarks/_runs/cifar10_p2p}
COMMON=(--data.root "$ROOT" --trainer.accelerator cpu --trainer.enable_progress_bar false --trainer.overwrite true)
for m in ${METHODS:-dispfl dpsgd dpsgd_ft local_p2p}; do
  pl-fed fit --config "configs/cifar10_${m}_cpu.yaml" "${COMMON[@]}" --trainer.default_root_dir "$OUT/$m"
done
pl-fed report "$OUT"/dispfl "$OUT"/dpsgd "$OUT"/dpsgd_ft "$OUT"/local_p2p --out "$OUT"/report
