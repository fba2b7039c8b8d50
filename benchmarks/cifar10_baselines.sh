#!/usr/bin/env bash
# CPU benchmark of the dense baselines on real CIFAR-10: Local, FedAvg, FedAvg-FT.
# Setting: LeNet-CIFAR, 20 clients, Dirichlet(0.3), 10,000 training images (500 per client, seeded subsample),
# per-client test sets drawn from the global test split with the client's label proportions (500 each),
# 10 clients per round, 5 local epochs, batch 64, SGD lr 0.1 * 0.998^t, wd 5e-4, clip 10, augmentation, 30 rounds.
# Usage: bash benchmarks/cifar10_baselines.sh data/cifar10     (the extracted ../shared/data/cifar10-jpg.tar.gz)
set -euo pipefail
ROOT=${1:-data/cifar10}
OUT=${OUT:-benchmarks/_runs/cifar10_baselines}
COMMON=(--data.root "$ROOT" --data.num_clients 20 --data.max_train_samples 10000 --trainer.join_ratio 0.5
        --trainer.num_rounds 30 --trainer.eval_every 5 --trainer.accelerator cpu --trainer.enable_progress_bar false
        --trainer.overwrite true)
for m in local fedavg fedavg_ft; do
  pl-fed fit --config "configs/cifar10_${m}.yaml" "${COMMON[@]}" --trainer.default_root_dir "$OUT/$m"
done
pl-fed report "$OUT"/local "$OUT"/fedavg "$OUT"/fedavg_ft --out "$OUT"/report
