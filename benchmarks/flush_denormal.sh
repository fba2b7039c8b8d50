#!/usr/bin/env bash
# trainer.flush_denormal off vs on, resuming the same checkpoint of a run: seconds per round and whether the numbers
# agree. A CPU slows down on subnormal floats, which appear once models converge (FedPSE's personal models on
# label-sorted data, say); this measures what flushing them to zero buys on one core.
#
#   bash benchmarks/flush_denormal.sh RUN_DIR [ROUNDS]     # RUN_DIR holds config.yaml and checkpoints/last.ckpt
#
# Both resumes run one after the other on one core (OMP_NUM_THREADS=1), from copies of RUN_DIR under
# benchmarks/_runs/flush_denormal/{off,on}, for ROUNDS (default 2) more rounds; their metrics.jsonl and the printed
# comparison go to benchmarks/flush_denormal/ (the record).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
RUN=${1:?usage: bash benchmarks/flush_denormal.sh RUN_DIR [ROUNDS]}
ROUNDS=${2:-2}
[ -f "$RUN/config.yaml" ] && [ -f "$RUN/checkpoints/last.ckpt" ] \
  || { echo "error: flush_denormal.sh: RUN_DIR='$RUN' has no config.yaml and checkpoints/last.ckpt" >&2; exit 2; }
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || { echo "error: flush_denormal.sh: ROUNDS='$ROUNDS' is invalid; expected an int >= 1" >&2; exit 2; }
DONE=$("$PY" -c "import torch,sys; print(torch.load(sys.argv[1], map_location='cpu', weights_only=True)['round'])" \
  "$RUN/checkpoints/last.ckpt" 2>/dev/null || true)
[ -n "$DONE" ] || { echo "error: flush_denormal.sh: could not read the round of $RUN/checkpoints/last.ckpt" >&2; exit 2; }
OUT=benchmarks/flush_denormal; mkdir -p "$OUT"
for mode in off on; do
  D=benchmarks/_runs/flush_denormal/$mode
  rm -rf "$D"; mkdir -p "$D/checkpoints"
  cp "$RUN/config.yaml" "$D/"; cp "$RUN/checkpoints/last.ckpt" "$D/checkpoints/"
  [ -f "$RUN/run.json" ] && cp "$RUN/run.json" "$D/"
  [ -f "$RUN/metrics.jsonl" ] && cp "$RUN/metrics.jsonl" "$D/"
  flag=$([ "$mode" = on ] && echo true || echo false)
  echo "== $mode: resume at round $DONE for $ROUNDS rounds, --trainer.flush_denormal $flag"
  OMP_NUM_THREADS=1 "$PY" -m pl_fedsparse.cli fit --config "$D/config.yaml" --trainer.default_root_dir "$D" \
    --ckpt_path "$D/checkpoints/last.ckpt" --trainer.num_rounds $((DONE + ROUNDS)) --trainer.flush_denormal "$flag" \
    --trainer.checkpoint_every 0 > "$D.log" 2>&1
  cp "$D/metrics.jsonl" "$OUT/metrics_$mode.jsonl"
done
"$PY" - "$OUT" "$DONE" <<'PY' | tee "$OUT/result.txt"
import json, sys
out, done = sys.argv[1], int(sys.argv[2])
rows = {m: [json.loads(x) for x in open(f"{out}/metrics_{m}.jsonl") if x.strip()] for m in ("off", "on")}
new = {m: [r for r in rows[m] if r["round"] >= done] for m in rows}
for m in ("off", "on"):
    print(f"{m}: " + ", ".join(f"round {r['round']} {r['time_train_s']:.1f} s" for r in new[m]))
t = {m: sum(r["time_train_s"] for r in new[m]) for m in new}
print(f"training seconds off / on: {t['off']:.1f} / {t['on']:.1f} = {t['off'] / t['on']:.2f}x")
for key in ("train_loss", "acc_mean", "comm_cum_bytes_total"):
    a, b = [r.get(key) for r in new["off"]], [r.get(key) for r in new["on"]]
    print(f"{key}: {'equal' if a == b else 'differs'} (off {a[-1]}, on {b[-1]})")
PY
