# The three calls of the H200 lease of 2026-11-27 (commit c5682fb), in order: each ran with 'bash <script>' on the lent machine

# ===== data/lease.sh
#!/usr/bin/env bash
# One lease, prepared: GPU tests + traffic side by side, then the runner overhead alone, then a few paper rounds.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
O=${OUT:?}; COMMIT=c5682fb
exec > >(tee -a "$O/lease.log") 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site data/whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p data/cifar10; tar -xzf data/cifar10-jpg.tar.gz -C data/cifar10 & TARP=$!
{ nvidia-smi; python3 -c "import platform, torch, lightning, torchmetrics; print('python', platform.python_version()); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__)"; echo "commit $COMMIT"; nproc; } > "$O/env.txt" 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$O/util.csv" 2>/dev/null & SMI=$!
echo "[$(el)s] phase A: tests + traffic"
( echo "# pytest -v -p no:cacheprovider -m gpu -rs --tb=short -n 4 tests  (H200, commit $COMMIT, 2026-11-27, beside device_traffic.py --gpu)";
  timeout -k 10 240 python3 -m pytest -v -p no:cacheprovider -m gpu -rs --tb=short -n 4 tests; echo "rc $?" ) > "$O/tests.txt" 2>&1 & P1=$!
( echo "# python3 benchmarks/device_traffic.py --gpu  (H200, commit $COMMIT, 2026-11-27, beside pytest -m gpu -n 4)";
  timeout -k 10 240 python3 benchmarks/device_traffic.py --gpu --json "$O/traffic_gpu.json"; echo "rc $?" ) > "$O/traffic_gpu.txt" 2>&1 & P2=$!
wait $P1 $P2 $TARP
echo "[$(el)s] phase B: runner overhead (GPU alone)"
for p in 32-true bf16-mixed; do
  ( echo "# python3 benchmarks/overhead.py --data-root data/cifar10 --accelerator gpu --precision $p --repeats 7  (H200, commit $COMMIT, 2026-11-27, alone on the GPU)";
    timeout -k 10 110 python3 benchmarks/overhead.py --data-root data/cifar10 --accelerator gpu --precision $p --repeats 7; echo "rc $?" ) > "$O/overhead_runner_$p.txt" 2>&1
  echo "[$(el)s] overhead $p done"
done
LEFT=$(( 500 - $(el) ))
echo "[$(el)s] phase C: rounds, $LEFT s"
if [ $LEFT -gt 60 ]; then
  timeout -k 10 $LEFT python3 benchmarks/gpu_rounds.py run --force --only fedavg fedspa_dst dmpfl --rounds 3 --eval-every 3 --seconds 45 --data-root data/cifar10 > "$O/rounds.log" 2>&1
  echo "rc $?" >> "$O/rounds.log"
  mkdir -p "$O/rounds"; cp benchmarks/gpu/rounds.jsonl "$O/" 2>/dev/null
  for d in fedavg fedspa_dst dmpfl; do mkdir -p "$O/rounds/$d"; cp benchmarks/gpu/rounds/$d/*.jsonl benchmarks/gpu/rounds/$d/*.json benchmarks/gpu/rounds/$d/*.yaml benchmarks/gpu/rounds/$d/*.csv "$O/rounds/$d/" 2>/dev/null; done
fi
kill $SMI 2>/dev/null
echo "[$(el)s] done"

# ===== data/lease2.sh
#!/usr/bin/env bash
# Second call: the GPU tests (4 workers x 3 threads) beside the traffic count (4 threads), each capped.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
O=${OUT:?}; COMMIT=c5682fb
exec > >(tee -a "$O/lease2.log") 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/site data/whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$O/util2.csv" 2>/dev/null & SMI=$!
echo "[$(el)s] tests + traffic"
( echo "# OMP_NUM_THREADS=3 pytest -vv -p no:cacheprovider -m gpu -rA --tb=short -n 4 tests  (H200, commit $COMMIT, 2026-11-27, beside device_traffic.py --gpu at OMP_NUM_THREADS=4)";
  OMP_NUM_THREADS=3 timeout -k 10 290 python3 -m pytest -vv -p no:cacheprovider -m gpu -rA --tb=short -n 4 tests; echo "rc $?" ) > "$O/tests_h200_c5682fb.txt" 2>&1 & P1=$!
( echo "# OMP_NUM_THREADS=4 python3 benchmarks/device_traffic.py --gpu  (H200, commit $COMMIT, 2026-11-27, beside pytest -m gpu -n 4)";
  OMP_NUM_THREADS=4 timeout -k 10 290 python3 benchmarks/device_traffic.py --gpu --json "$O/traffic_gpu.json"; echo "rc $?" ) > "$O/traffic_gpu.txt" 2>&1 & P2=$!
wait $P1 $P2
kill $SMI 2>/dev/null
echo "[$(el)s] done"

# ===== data/lease3.sh
#!/usr/bin/env bash
set -u
O=${OUT:?}
exec > >(tee -a "$O/lease3.log") 2>&1
[ -d /tmp/site/pl_fedsparse ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site data/whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
[ -d data/cifar10/train ] || { mkdir -p data/cifar10; tar -xzf data/cifar10-jpg.tar.gz -C data/cifar10; }
timeout -k 5 165 python3 benchmarks/gpu_rounds.py run --force --only dmpfl pfedgate --rounds 4 --eval-every 4 --seconds 75 --data-root data/cifar10
echo "rc $?"
tar -czf "$O/rounds3.tgz" --exclude='*.ckpt' --exclude='events.out*' benchmarks/gpu/rounds.jsonl benchmarks/gpu/rounds/dmpfl benchmarks/gpu/rounds/pfedgate
