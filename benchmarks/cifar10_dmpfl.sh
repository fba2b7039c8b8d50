#!/usr/bin/env bash
# CPU benchmark of DM-PFL / DM-PFL+ against the baselines of its paper on real CIFAR-10.
# Setting (configs/cifar10_dmpfl_cpu.yaml): McMahan CNN, 20 clients, Dirichlet(0.3) with quantity skew over a seeded
# 10,000-image subsample, per-client 0.75/0.25 train/test split, 10 clients per round, E = 2, batch 64, SGD lr
# 0.05·0.995^t, wd 5e-4, 30 rounds, seed 0; S = 0.5 for DM-PFL and FedDST. Every method is evaluated at the end at
# 0/20/40/50/60/80/100 % shift and under the nine corruptions at severity 5.
# One DM-PFL+ run gives both DM-PFL (its personal model θ_c: personal_only_acc) and DM-PFL+ (acc_mean).
# Usage: bash benchmarks/cifar10_dmpfl.sh data/cifar10        (METHODS="dmpfl fedavg" to run a subset;
#        EXTRA="--trainer.num_rounds 100" OUT=benchmarks/_runs/cifar10_dmpfl_100 for a longer run)
set -euo pipefail
ROOT=${1:-data/cifar10}
OUT=${OUT:-benchmarks/_runs/cifar10_dmpfl}
METHODS=${METHODS:-"dmpfl fedavg fedavg_ft ditto local feddst"}
SHIFT='{"class_path": "pl_fedsparse.callbacks.ShiftEvaluation", "init_args": {"shifts": [0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0], "corruptions": "all", "severities": [5]}}'
COMMON=(--data.root "$ROOT" --trainer.enable_progress_bar false --trainer.overwrite true)
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
for m in $METHODS; do
  case $m in
    dmpfl)     args=(--config configs/cifar10_dmpfl_plus_cpu.yaml) ;;
    fedavg)    args=(--config configs/cifar10_dmpfl_cpu.yaml --trainer.callbacks "[$SHIFT]") ;;
    fedavg_ft) args=(--config configs/cifar10_dmpfl_cpu.yaml --trainer.callbacks
                     "[{\"class_path\": \"pl_fedsparse.callbacks.FineTune\", \"init_args\": {\"epochs\": 2}}, $SHIFT]") ;;
    ditto)     args=(--config configs/cifar10_ditto_cpu.yaml) ;;
    local)     args=(--config configs/cifar10_dmpfl_cpu.yaml --trainer.callbacks
                     "[{\"class_path\": \"pl_fedsparse.callbacks.LocalTraining\"}, $SHIFT]") ;;
    feddst)    args=(--config configs/cifar10_feddst_cpu.yaml) ;;
    *) echo "unknown method $m" >&2; exit 2 ;;
  esac
  pl-fed fit "${args[@]}" "${COMMON[@]}" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} --trainer.default_root_dir "$OUT/$m"
done
RUNS=(); for m in $METHODS; do RUNS+=("$OUT/$m"); done
BASE=(); if [[ " $METHODS " == *" fedavg "* ]]; then BASE=(--baseline fedavg); fi
pl-fed report "${RUNS[@]}" --out "$OUT"/report ${BASE[@]+"${BASE[@]}"} \
  --metrics personal_only_acc shift50/acc_mean shift100/acc_mean shift_avg/acc_mean corruption_avg/acc_mean
# the paper-shaped table (DM-PFL read from the DM-PFL+ run's personal model, the average over Table 1's levels)
python benchmarks/shift_table.py "$OUT"
