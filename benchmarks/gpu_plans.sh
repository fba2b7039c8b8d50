#!/usr/bin/env bash
# The recorded plans that are too long for the CPU sessions, on a lent GPU, time-boxed: several workers share the
# device for --minutes, then each is stopped with SIGTERM (a run keeps its last completed round), the unfinished
# runs are parked (their last checkpoints, for the next session; not FedPSE's ~200 MB ones: give --minutes room for
# its runs to finish: ~7 min each at the 4.3 s a round measured on an H200 shared by five runs, more with more
# workers) and, when $OUT is set (the device tool's output folder, which returns few files and shallow folders), the
# plans' records, parked checkpoints and worker logs are packed into one file, $OUT/gpu_plans_records.tar.gz, with
# their repository paths.
#
#   bash benchmarks/gpu_plans.sh --minutes 8 --workers 4 fedpse_long pfedgate_table
#   bash benchmarks/gpu_plans.sh --dry-run fedpse_long pfedgate_table    # the commands; the runs resolve (no GPU)
#   GPU_PLANS_ANY_DEVICE=1 OUT=/tmp/o bash benchmarks/gpu_plans.sh --minutes 2 --workers 1 pfedgate_table  # rehearse
#
# Plans (resumable, benchmarks/runplan.py): fedpse_long (papers/fedpse/: FedPSE vs FedAvg, 12 runs at 20 rounds, then
# at 100 -> records/fedpse_long/) and pfedgate_table (papers/pfedgate/: FedRep's 200-round runs -> records/pfedgate_long/;
# all recorded now: its workers find nothing to run). Run the GPU suite first (benchmarks/gpu_suite.sh); this is what
# the rest of a lease is for.
# Data: only the repository travels to a lent machine, so carry data/cifar10-jpg.tar.gz and data/fashion-mnist/ (the
# four IDX .gz files of /usr/share/datasets/fashion-mnist); they are placed at the paths the CPU sessions' runs read
# (PFEDGATE_TABLE_DATA=/work/main/data/cifar10, FEDPSE_LONG_DATA=/usr/share/datasets/fashion-mnist) when missing.
# Why this is not a sweep (pl-fed sweep): it runs no grid of its own; it time-boxes the workers of runplan plans that
# need what a sweep lacks (fedpse_long's continuations of other runs' directories, checkpoints parked in git for the
# next session) and packs their records for the device tool's $OUT.
# Back home: `tar -xzf gpu_plans_records.tar.gz` in the checkout; `git status` shows the new records; a parked checkpoint
# whose run now has a summary.json is stale there (the worker removed it on the device): delete it before committing.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MINUTES=8; WORKERS=4; DRY=0; PLANS=()
declare -A SCRIPTS=([fedpse_long]="papers/fedpse/fedpse_long.py" [pfedgate_table]="papers/pfedgate/pfedgate_table.py")
declare -A RECORDS=([fedpse_long]="papers/fedpse/records/fedpse_long" [pfedgate_table]="papers/pfedgate/records/pfedgate_table papers/pfedgate/records/pfedgate_long")
fail() { echo "error: gpu_plans.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --minutes) shift; MINUTES=${1:-} ;;
    --workers) shift; WORKERS=${1:-} ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    --*) fail "unknown argument '$1' (allowed: --minutes N, --workers N, --dry-run, PLAN...)" ;;
    *) [ -n "${RECORDS[$1]+x}" ] || fail "plan '$1' is not one of: ${!RECORDS[*]}"; PLANS+=("$1") ;;
  esac
  shift
done
[[ "$MINUTES" =~ ^[1-9][0-9]*$ ]] || fail "--minutes='$MINUTES' is invalid; expected a whole number of minutes >= 1"
[[ "$WORKERS" =~ ^[1-9][0-9]*$ ]] || fail "--workers='$WORKERS' is invalid; expected a whole number of workers >= 1"
[ ${#PLANS[@]} -gt 0 ] || fail "no plan given; expected one or more of: ${!RECORDS[*]}"

# A run resumes only with its own configuration, data.root included: the data go where the CPU sessions' runs read
# them, so that a run parked there continues here and back.
export PFEDGATE_TABLE_DATA=${PFEDGATE_TABLE_DATA:-/work/main/data/cifar10}
export FEDPSE_LONG_DATA=${FEDPSE_LONG_DATA:-/usr/share/datasets/fashion-mnist}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
if [ "$DRY" = 1 ]; then
  for plan in "${PLANS[@]}"; do
    for w in $(seq "$WORKERS"); do echo "\$ $PY ${SCRIPTS[$plan]} run   # worker $w, stopped after $MINUTES min"; done
    echo "\$ $PY ${SCRIPTS[$plan]} park; copy ${RECORDS[$plan]} to \$OUT"
    "$PY" "${SCRIPTS[$plan]}" check || exit 1
  done
  echo "dry run: every plan's remaining runs resolve"
  exit 0
fi
[ "${GPU_PLANS_ANY_DEVICE:-0}" = 1 ] || "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || fail "no CUDA device is visible to $PY (torch.cuda.is_available() is false); use --dry-run"
if [ ! -d "$PFEDGATE_TABLE_DATA/train" ] && [ -f data/cifar10-jpg.tar.gz ]; then
  mkdir -p "$PFEDGATE_TABLE_DATA" && tar -xzf data/cifar10-jpg.tar.gz -C "$PFEDGATE_TABLE_DATA" \
    || fail "could not extract data/cifar10-jpg.tar.gz to PFEDGATE_TABLE_DATA=$PFEDGATE_TABLE_DATA"
fi
if [ ! -f "$FEDPSE_LONG_DATA/train-images-idx3-ubyte.gz" ] && [ -d data/fashion-mnist ]; then
  mkdir -p "$FEDPSE_LONG_DATA" && cp data/fashion-mnist/*.gz "$FEDPSE_LONG_DATA"/ \
    || fail "could not copy data/fashion-mnist to FEDPSE_LONG_DATA=$FEDPSE_LONG_DATA"
fi

LOGS=benchmarks/_runs/gpu_plans; mkdir -p "$LOGS"
PIDS=()
for plan in "${PLANS[@]}"; do
  for w in $(seq "$WORKERS"); do  # each worker leads its own process group: the stop reaches its fits too
    setsid "$PY" "${SCRIPTS[$plan]}" run > "$LOGS/${plan}_w$w.log" 2>&1 &
    PIDS+=($!); sleep 2  # staggered: two workers never race for the same first run
  done
done
echo "== ${#PIDS[@]} workers for ${PLANS[*]}, stopped after $MINUTES min"
any_alive() { for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
deadline=$((SECONDS + MINUTES * 60))
while [ $SECONDS -lt $deadline ]; do
  any_alive || break  # every plan finished early
  sleep 5
done
for p in "${PIDS[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
for _ in $(seq 60); do  # a fit stops at its next step; give it a minute, then kill
  any_alive || break; sleep 1
done
for p in "${PIDS[@]}"; do kill -KILL -- "-$p" 2>/dev/null; done
LIST=$(mktemp)
for plan in "${PLANS[@]}"; do
  "$PY" "${SCRIPTS[$plan]}" park
  for dir in ${RECORDS[$plan]}; do
    find "$dir" \( -name config.yaml -o -name metrics.jsonl -o -name summary.json -o -name '*.ckpt' \) 2>/dev/null
  done >> "$LIST"
  ls "$LOGS"/${plan}_w*.log >> "$LIST" 2>/dev/null
done
if [ -n "${OUT:-}" ]; then
  tar -czf "$OUT/gpu_plans_records.tar.gz" -T "$LIST" || fail "could not pack the records into $OUT"
  echo "== done; records, parked checkpoints and logs in $OUT/gpu_plans_records.tar.gz ($(wc -l < "$LIST") files)"
else
  echo "== done; records and parked checkpoints under ${RECORDS[*]}"
fi
rm -f "$LIST"
