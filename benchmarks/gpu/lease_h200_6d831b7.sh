# The two calls of the H200 lease of 2026-11-27 evening (commit 6d831b7), in order: each ran as 'bash <script>' on the lent machine

# ===== .lease/lease1.sh
#!/usr/bin/env bash
# Call 1 of the lease of 2026-11-27 (session 11): GPU tests beside the server step, then the runner's overhead at
# 32-true alone, then three paper configs' rounds alone.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
O=${OUT:?}; COMMIT=6d831b7
exec > >(tee -a "$O/lease.log") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .lease/whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p data/cifar10; tar -xzf .lease/cifar10-jpg.tar.gz -C data/cifar10 & TARP=$!
{ nvidia-smi; python3 -c "import platform, torch, lightning, torchmetrics; print('python', platform.python_version()); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__)"; echo "commit $COMMIT"; nproc; } > "$O/env.txt" 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$O/util.csv" 2>/dev/null & SMI=$!
echo "[$(el)s] phase A: tests + server"
( echo "# OMP_NUM_THREADS=3 pytest -vv -p no:cacheprovider -m gpu -rA --tb=short -n 4 tests  (H200, commit $COMMIT, 2026-11-27, beside server_work.py --device cuda)";
  OMP_NUM_THREADS=3 timeout -k 10 150 python3 -m pytest -vv -p no:cacheprovider -m gpu -rA --tb=short -n 4 tests; echo "rc $?" ) > "$O/tests.txt" 2>&1 & P1=$!
( echo "# OMP_NUM_THREADS=4 python3 benchmarks/server_work.py --device cuda  (H200, commit $COMMIT, 2026-11-27, beside pytest -m gpu -n 4)";
  OMP_NUM_THREADS=4 timeout -k 10 150 python3 benchmarks/server_work.py --device cuda; echo "rc $?" ) > "$O/server_work.txt" 2>&1 & P2=$!
wait $P1 $P2 $TARP
echo "[$(el)s] phase B: runner overhead 32-true (GPU alone)"
( echo "# python3 benchmarks/overhead.py --data-root data/cifar10 --accelerator gpu --precision 32-true --repeats 7  (H200, commit $COMMIT, 2026-11-27, alone on the GPU)";
  timeout -k 10 75 python3 benchmarks/overhead.py --data-root data/cifar10 --accelerator gpu --precision 32-true --repeats 7; echo "rc $?" ) > "$O/overhead_runner_32-true.txt" 2>&1
LEFT=$(( 400 - $(el) ))
echo "[$(el)s] phase C: rounds, $LEFT s"
if [ $LEFT -gt 60 ]; then
  timeout -k 10 $LEFT python3 benchmarks/gpu_rounds.py run --force --only pfedgate fedspa_dst dmpfl --rounds 3 --eval-every 3 --seconds 70 --data-root data/cifar10 > "$O/rounds.log" 2>&1
  echo "rc $?" >> "$O/rounds.log"
fi
kill $SMI 2>/dev/null
tar -czf "$O/rounds.tgz" --exclude='*.ckpt' --exclude='events.out*' benchmarks/gpu/rounds.jsonl benchmarks/gpu/rounds/pfedgate benchmarks/gpu/rounds/fedspa_dst benchmarks/gpu/rounds/dmpfl 2>/dev/null
echo "[$(el)s] done"

# ===== .lease/lease2.sh
#!/usr/bin/env bash
# Call 2: where a pFedGate round's time goes (runner), DisPFL's round vs a plain loop, DM-PFL's rounds (4: two phases).
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
O=${OUT:?}; COMMIT=6d831b7
exec > >(tee -a "$O/lease2.log") 2>&1
[ -d /tmp/site/pl_fedsparse ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .lease/whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
[ -d data/cifar10/train ] || { mkdir -p data/cifar10; tar -xzf .lease/cifar10-jpg.tar.gz -C data/cifar10; }
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$O/util2.csv" 2>/dev/null & SMI=$!
echo "[$(el)s] A: profile pfedgate"
( echo "# python3 benchmarks/profile_fit.py --config configs/cifar10_pfedgate.yaml --accelerator gpu --clients 10 --top 25 --data-root data/cifar10  (H200, commit $COMMIT, 2026-11-27)";
  timeout -k 5 85 python3 benchmarks/profile_fit.py --config configs/cifar10_pfedgate.yaml --accelerator gpu --clients 10 --top 25 --data-root data/cifar10; echo "rc $?" ) > "$O/profile_pfedgate_runner.txt" 2>&1
echo "[$(el)s] B: dispfl round"
( echo "# python3 benchmarks/dispfl_round.py --accelerator gpu --data-device cuda --model resnet18 --clients 100 --neighbours 10 --epochs 5 --samples 500 --batch-size 128 --repeats 1 --data-root data/cifar10  (H200, commit $COMMIT, 2026-11-27)";
  timeout -k 5 150 python3 benchmarks/dispfl_round.py --accelerator gpu --data-device cuda --model resnet18 --clients 100 --neighbours 10 --epochs 5 --samples 500 --batch-size 128 --repeats 1 --data-root data/cifar10; echo "rc $?" ) > "$O/dispfl_round.txt" 2>&1
LEFT=$(( 318 - $(el) ))
echo "[$(el)s] C: dmpfl rounds, $LEFT s"
if [ $LEFT -gt 40 ]; then
  timeout -k 5 $LEFT python3 benchmarks/gpu_rounds.py run --force --only dmpfl --rounds 4 --eval-every 4 --seconds $((LEFT-5)) --data-root data/cifar10 > "$O/rounds2.log" 2>&1
  echo "rc $?" >> "$O/rounds2.log"
fi
kill $SMI 2>/dev/null
tar -czf "$O/rounds2.tgz" --exclude='*.ckpt' --exclude='events.out*' benchmarks/gpu/rounds.jsonl benchmarks/gpu/rounds/dmpfl 2>/dev/null
echo "[$(el)s] done"
