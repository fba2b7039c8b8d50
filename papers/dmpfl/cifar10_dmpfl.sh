#!/usr/bin/env bash
# DM-PFL / DM-PFL+ against the baselines of its paper on real CIFAR-10, seed 0, unrecorded: the sweep
# configs/sweeps/cifar10_dmpfl.yaml (its setting is described there), then what a sweep does not do: the report with
# FedAvg as the baseline and the shift metrics, and the paper-shaped table (papers/dmpfl/shift_table.py; DM-PFL read
# from the DM-PFL+ run's personal model, the average over Table 1's levels).
# Usage: bash papers/dmpfl/cifar10_dmpfl.sh data/cifar10        (METHODS="dmpfl fedavg" to run a subset;
#        EXTRA="--set trainer.num_rounds=100" OUT=benchmarks/_runs/cifar10_dmpfl_100 for a longer run; EXTRA takes
#        any pl-fed sweep option, e.g. "--parallel 2" or "--dry-run")
# A stopped run continues with the same command (finished runs are skipped, unfinished ones resume).
set -euo pipefail
ROOT=${1:-data/cifar10}
OUT=${OUT:-benchmarks/_runs/cifar10_dmpfl}
ALL="dmpfl fedavg fedavg_ft ditto local feddst"
METHODS=${METHODS:-$ALL}
ONLY=()
for m in $METHODS; do
  [[ " $ALL " == *" $m "* ]] || { echo "error: METHODS='$METHODS' is invalid: expected names from: $ALL" >&2; exit 2; }
  ONLY+=(--only "$m")
done
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
pl-fed sweep --grid configs/sweeps/cifar10_dmpfl.yaml --set "data.root=$ROOT" --out "$OUT" "${ONLY[@]}" \
  --no-report ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
[[ " ${EXTRA:-} " == *" --dry-run "* ]] && exit 0
RUNS=(); for m in $METHODS; do RUNS+=("$OUT/$m"); done
BASE=(); if [[ " $METHODS " == *" fedavg "* ]]; then BASE=(--baseline fedavg); fi
pl-fed report "${RUNS[@]}" --out "$OUT"/report ${BASE[@]+"${BASE[@]}"} \
  --metrics personal_only_acc shift50/acc_mean shift100/acc_mean shift_avg/acc_mean corruption_avg/acc_mean
python papers/dmpfl/shift_table.py "$OUT"
