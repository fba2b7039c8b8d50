#!/usr/bin/env bash
# The next lease's two calls, prepared: 'bash benchmarks/gpu/lease_next.sh 1', then '... 2', on the lent machine,
# with the wheels and the CIFAR-10 tarball carried in .lease/ as "Getting the package onto a lent machine" in
# README.md says. What changed since the last lease is measured first. Call 1 (about 9 minutes): the GPU tests (the
# corrected EWA test and the prepared-inputs test among them), the runner's overhead at 32-true and bf16-mixed
# (batches from the prepared inputs, no per-step loss operators), pFedGate's and FedSpa's rounds, then pFedGate's
# rounds with its fits stacked (VectorizedExecutor: every client's gate and step at once). Call 2 (what the lease has
# left, about 3 minutes): DM-PFL's 8 rounds (both kinds of Phase-2 round), FedSpa's rounds with its fits stacked,
# torch.compile of pFedGate's LeNet-CIFAR fits against uncompiled (compile_fit.py: trainer.compile), the same as CUDA
# graphs (trainer.compile's mode reduce-overhead), DisPFL's gossip
# message made flat against tensor by tensor (gossip_message.py --flat), torch.compile of FedSpa's VGG11-GN fits,
# then a stacked step's convolutions per client against grouped (stacked_layers.py: VectorizedExecutor's
# convolutions option); before it, a fit's state across the host link staged in pinned memory against pageable
# (host_link.py: trainer.pin_memory);
# last, FedSpa's rounds stacked at bf16-mixed (allowed for GroupNorm models since the stacked layers cast as
# autocast does).
# Every record goes straight to $OUT, named as in README.md; each rounds step's run directories in $OUT/<step>.tgz
# right after it, so a call cut by its time limit keeps what finished.
set -u
CALL=${1:?usage: lease_next.sh 1|2}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
O=${OUT:?}; COMMIT=${COMMIT:-$(cat .lease/commit 2>/dev/null || echo unknown)}; DAY=$(date +%F)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
exec > >(tee -a "$O/lease$CALL.log") 2>&1
[ -d /tmp/site/pl_fedsparse ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .lease/whl/*.whl
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
[ -d data/cifar10/train ] || { mkdir -p data/cifar10; tar -xzf .lease/cifar10-jpg.tar.gz -C data/cifar10; }
{ nvidia-smi; python3 -c "import platform, torch, lightning, torchmetrics; print('python', platform.python_version()); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__)"; echo "commit $COMMIT"; nproc; } > "$O/env$CALL.txt" 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader -lms 250 > "$O/util$CALL.csv" 2>/dev/null & SMI=$!
run() {  # run NAME SECONDS CMD...: the command's output and exit code in $O/NAME, under its header line
    local name=$1 secs=$2; shift 2
    ( echo "# $*  ($GPU, commit $COMMIT, $DAY)"; timeout -k 10 "$secs" "$@"; echo "rc $?" ) > "$O/$name" 2>&1
}
keep() {  # keep NAME DIR...: a rounds step's records in $O/NAME.tgz right after it (a call cut later keeps them)
    local name=$1; shift
    tar -czf "$O/$name.tgz" --exclude='*.ckpt' --exclude='events.out*' benchmarks/gpu/rounds.jsonl "$@" 2>/dev/null
}
if [ "$CALL" = 1 ]; then
    echo "[$(el)s] GPU tests"
    run tests.txt 180 env OMP_NUM_THREADS=3 python3 -m pytest -vv -p no:cacheprovider -m gpu -rA --tb=short -n 4 tests
    echo "[$(el)s] overhead, alone on the GPU"
    run overhead_runner_32-true.txt 60 python3 benchmarks/overhead.py --data-root data/cifar10 --accelerator gpu \
        --precision 32-true --repeats 5
    run overhead_runner_bf16-mixed.txt 60 python3 benchmarks/overhead.py --data-root data/cifar10 --accelerator gpu \
        --precision bf16-mixed --repeats 5
    echo "[$(el)s] rounds"
    run rounds.log 150 python3 benchmarks/gpu_rounds.py run --force --only pfedgate fedspa_dst --rounds 3 \
        --eval-every 3 --seconds 70 --data-root data/cifar10
    keep rounds benchmarks/gpu/rounds/pfedgate benchmarks/gpu/rounds/fedspa_dst
    run rounds_pfedgate_vec.log 90 python3 benchmarks/gpu_rounds.py run --force --only pfedgate --tag vec \
        --rounds 3 --eval-every 3 --seconds 80 --data-root data/cifar10 -- \
        --trainer.executor pl_fedsparse.executors.VectorizedExecutor
    keep rounds_pfedgate_vec benchmarks/gpu/rounds/pfedgate+vec
else
    echo "[$(el)s] DM-PFL's 8 rounds; FedSpa's rounds stacked"
    run rounds_dmpfl.log 100 python3 benchmarks/gpu_rounds.py run --force --only dmpfl --rounds 8 --eval-every 8 \
        --seconds 95 --data-root data/cifar10
    keep rounds_dmpfl benchmarks/gpu/rounds/dmpfl
    run rounds_fedspa_vec.log 90 python3 benchmarks/gpu_rounds.py run --force --only fedspa_dst --tag vec \
        --rounds 3 --eval-every 3 --seconds 80 --data-root data/cifar10 -- \
        --trainer.executor pl_fedsparse.executors.VectorizedExecutor
    keep rounds_fedspa_vec benchmarks/gpu/rounds/fedspa_dst+vec
    echo "[$(el)s] torch.compile of pFedGate's LeNet-CIFAR fits (the least busy config), against uncompiled"
    run compile_fit_pfedgate.txt 90 python3 benchmarks/compile_fit.py --accelerator gpu --method pfedgate \
        --model lenet --clients 10 --samples 500 --batch-size 128 --rounds 5 --warmup 2
    echo "[$(el)s] the same as CUDA graphs (mode reduce-overhead: each compiled step's kernels as one launch)"
    run compile_fit_pfedgate_cudagraphs.txt 90 python3 benchmarks/compile_fit.py --accelerator gpu \
        --method pfedgate --model lenet --clients 10 --samples 500 --batch-size 128 --rounds 5 --warmup 2 \
        --compile '{"mode": "reduce-overhead"}'
    echo "[$(el)s] DisPFL's gossip message, flat and tensor by tensor"
    run gossip_flat.txt 60 python3 benchmarks/gossip_message.py --flat --device cuda --repeats 10
    echo "[$(el)s] torch.compile of the module (trainer.compile), FedSpa's VGG11-GN fits, against uncompiled"
    run compile_fit.txt 120 python3 benchmarks/compile_fit.py --accelerator gpu --method fedspa --model vgg11 \
        --clients 4 --samples 512 --batch-size 128 --rounds 5 --warmup 2
    echo "[$(el)s] a fit's state across the host link, pinned and pageable"
    run host_link.txt 40 python3 benchmarks/host_link.py --repeats 10
    echo "[$(el)s] a stacked step's convolutions, per client and grouped"
    run stacked_layers.txt 45 python3 benchmarks/stacked_layers.py --device cuda --models VGG11-GN LeNet-CIFAR \
        --clients 10 50 --batch 32 --repeats 10
    echo "[$(el)s] FedSpa's rounds stacked at bf16-mixed (VGG11-GN's GroupNorm cast as autocast casts it)"
    run rounds_fedspa_vec_bf16.log 75 python3 benchmarks/gpu_rounds.py run --force --only fedspa_dst --tag vecbf16 \
        --rounds 3 --eval-every 3 --seconds 65 --precision bf16-mixed --data-root data/cifar10 -- \
        --trainer.executor pl_fedsparse.executors.VectorizedExecutor
    keep rounds_fedspa_vec_bf16 benchmarks/gpu/rounds/fedspa_dst+vecbf16
fi
kill $SMI 2>/dev/null
echo "[$(el)s] done"
