#!/usr/bin/env bash
# The GPU suite: one command that measures what matters on one GPU, resumably: each step is skipped once its record
# exists, so a suite cut off by a short lease goes on in the next (steps run side by side where they share the GPU
# well: benchmarks/gpu/README.md, "Getting the package onto a lent machine").
#
#   bash benchmarks/gpu_suite.sh                 # every step not yet recorded under benchmarks/gpu/
#   bash benchmarks/gpu_suite.sh --dry-run       # the commands parse and the configs resolve (no GPU; CI runs it)
#   bash benchmarks/gpu_suite.sh --force         # re-run the recorded steps too
#   bash benchmarks/gpu_suite.sh --only tests overhead   # some steps
#   STEP_SECONDS=240 bash benchmarks/gpu_suite.sh       # each step cut off after 240 s (a short lease), kept as .failed
#
# Steps (each writes its record under benchmarks/gpu/; a step whose record exists is skipped, so a suite cut off by
# a time limit resumes where it stopped):
#   env       nvidia-smi, the Python packages' versions                                  -> env.txt
#   tests     the GPU-marked tests (pytest -m gpu)                                       -> tests.txt
#   runner    the persistent fit runner (the default since the records above, which built a Trainer per fit):
#             overhead.py at 32-true and bf16-mixed, and profile_fit.py's FedSpa round (kernel time only)
#                                                        -> overhead_runner_<precision>.txt, profile_fedspa_runner.txt
#   traffic   benchmarks/device_traffic.py --gpu: torch.profiler's host<->device copies and waits per client fit and
#             per training step for each method's config (the CPU counter's numbers, checked) -> traffic_gpu.txt
#   server    benchmarks/server_work.py --device cuda: a round's aggregation (FedAvg, FedSpa's Eq. 4) and one DisPFL
#             gossip message, on the host and on the GPU (what the device path saves)      -> server_work.txt
#   dispfl    benchmarks/dispfl_round.py: DisPFL's round at the paper's setting against a plain loop doing the same
#             100 fits and gossip with state and data on the GPU (target: <= 1.1)          -> dispfl_round.txt
#   compile   benchmarks/compile_fit.py on the GPU: trainer.compile (torch.compile of the module every fit reuses)
#             against the uncompiled module, FedSpa's VGG11-GN fits, at the default mode and at
#             max-autotune-no-cudagraphs (autotuned kernels, no CUDA graphs)          -> compile_fit_<mode>.txt
#             and pFedGate's LeNet-CIFAR fits (its paper model and batch), default mode -> compile_fit_pfedgate.txt
#             and as CUDA graphs (mode reduce-overhead)                    -> compile_fit_pfedgate_cudagraphs.txt
#   overhead  benchmarks/overhead.py, engine vs a plain loop, at 32-true, bf16-mixed and 16-mixed
#                                                                                       -> overhead_<precision>.txt
#   rounds    benchmarks/gpu_rounds.py: each seed method's paper config for a few rounds: seconds per round, GPU
#             utilisation, the estimate for the paper's full run                          -> rounds.jsonl, rounds/
#   paper     benchmarks/gpu_paper_runs.py: the five papers' Table-1 configs at once for PAPER_SECONDS (default 390):
#             the rounds each reaches and its accuracy                                  -> paper_runs.jsonl, paper_runs/
#   ray       benchmarks/ray_speedup.py on the GPU: in-process vs 4 Ray workers sharing it (0.25 GPU each)
#                                                                                       -> ray_<mode>.txt
#   vectorized benchmarks/vectorized.py on the GPU: LeNet-CIFAR with 100 clients per round, the papers' VGG11-GN
#             and ResNet18-GN with 20, the MLP quickstart task; in process vs VectorizedExecutor: seconds per round
#             and GPU utilisation -> vectorized_<task>.txt
#   profile   benchmarks/profile_fit.py: where a FedSpa round (VGG11-GN, 10 clients) spends its time, by package,
#             and how busy the GPU is                                                    -> profile_fedspa.txt
# Data: CIFAR10_ROOT (default data/cifar10, the extracted ImageFolder copy) and FMNIST_ROOT (default
# /usr/share/datasets/fashion-mnist); a step whose data or package is missing is recorded as skipped, not failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=benchmarks/gpu
CIFAR10_ROOT=${CIFAR10_ROOT:-data/cifar10}
FMNIST_ROOT=${FMNIST_ROOT:-/usr/share/datasets/fashion-mnist}
export CIFAR10_ROOT FMNIST_ROOT PYTHONUNBUFFERED=1
DRY=0; FORCE=0; ONLY=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --force) FORCE=1 ;;
    --only) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do ONLY+=("$1"); shift; done; continue ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "error: gpu_suite.sh: unknown argument '$1' (allowed: --dry-run, --force, --only STEP...)" >&2; exit 2 ;;
  esac
  shift
done
STEPS=(env tests runner traffic server dispfl compile overhead rounds paper ray vectorized profile)
PAPER_SECONDS=${PAPER_SECONDS:-390}
STEP_SECONDS=${STEP_SECONDS:-0}  # each step's time limit in seconds (0: none); a short lease sets it
for s in "${ONLY[@]}"; do
  case " ${STEPS[*]} " in *" $s "*) ;; *) echo "error: gpu_suite.sh: --only '$s' is not a step (allowed: ${STEPS[*]})" >&2; exit 2 ;; esac
done
wanted() { [ ${#ONLY[@]} -eq 0 ] && return 0; case " ${ONLY[*]} " in *" $1 "*) return 0 ;; esac; return 1; }
# A step runs unless its record exists (or --force); in a dry run it prints its commands and checks they resolve.
todo() { [ "$FORCE" = 1 ] || [ ! -s "$OUT/$1" ]; }
say() { echo "== $*"; }
FAILED=0
step() {  # step <record> <command...>: run, tee into the record, keep a failed step's output as <record>.failed
  local rec=$1; shift
  if [ "$DRY" = 1 ]; then echo "\$ $*"; return 0; fi
  if ! todo "$rec"; then say "$rec recorded already (--force re-runs it)"; return 0; fi
  say "$*"
  local limit=()
  [ "$STEP_SECONDS" != 0 ] && limit=(timeout -k 10 "$STEP_SECONDS")  # a step cut off is kept as <record>.failed
  if "${limit[@]}" "$@" 2>&1 | tee "$OUT/$rec.part"; then mv "$OUT/$rec.part" "$OUT/$rec"
  else mv "$OUT/$rec.part" "$OUT/$rec.failed"; FAILED=1; fi
}
mkdir -p "$OUT"
if [ "$DRY" = 0 ] && ! "$PY" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "error: gpu_suite.sh: no CUDA device is visible to $PY (torch.cuda.is_available() is false); use --dry-run" >&2
  exit 2
fi

if wanted env; then
  env_report() { nvidia-smi || true; "$PY" -c "import platform, torch, lightning, torchmetrics; print('python', platform.python_version()); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('lightning', lightning.__version__, 'torchmetrics', torchmetrics.__version__)"; git log -1 --format='commit %H %s' 2>/dev/null || true; }
  if [ "$DRY" = 1 ]; then echo "\$ nvidia-smi; $PY -c 'versions'"; else say "env"; env_report 2>&1 | tee "$OUT/env.txt"; fi
fi

if wanted tests; then
  # -v: a run cut off still names each result; four at a time where pytest-xdist is there (22 tests took over 380 s
  # one at a time on an H100)
  # each worker gets its share of the cores: four workers at torch's default (every core each) finished a fifth of
  # the GPU tests in four minutes on an H200 (benchmarks/gpu/tests_h200_c5682fb_oversubscribed.txt)
  XDIST=(); THREADS=()
  if "$PY" -c "import xdist" 2>/dev/null; then
    XDIST=(-n 4); CORES=$(nproc); THREADS=(env "OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( CORES > 4 ? CORES / 4 : 1 ))}")
  fi
  step tests.txt "${THREADS[@]}" "$PY" -m pytest -vv -p no:cacheprovider -m gpu -rA --tb=short "${XDIST[@]}" tests
  [ "$DRY" = 1 ] && "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests | grep -v '^$' | tail -3
fi

if wanted runner; then
  for p in 32-true bf16-mixed; do
    if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
      step "overhead_runner_$p.txt" "$PY" benchmarks/overhead.py --data-root "$CIFAR10_ROOT" --accelerator gpu --precision "$p" --repeats 7
    else say "runner overhead $p skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
  done
  RUNNER_PROFILE=(benchmarks/profile_fit.py --config configs/cifar10_fedspa_dst.yaml --accelerator gpu --clients 10
                  --top 20 --data-root "$CIFAR10_ROOT")
  if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
    step profile_fedspa_runner.txt "$PY" "${RUNNER_PROFILE[@]}" -- --data.device cuda
  else say "runner profile skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
fi
if wanted traffic; then  # host<->device copies and waits per fit and per step, each method's config (synthetic)
  step traffic_gpu.txt "$PY" benchmarks/device_traffic.py --gpu --json "$OUT/traffic_gpu.json"
  [ "$DRY" = 1 ] && "$PY" benchmarks/device_traffic.py --help > /dev/null && echo "device_traffic.py parses"
fi

if wanted server; then  # the server's work of a round (aggregation, a DisPFL gossip message) on the host and the GPU
  step server_work.txt "$PY" benchmarks/server_work.py --device cuda
  [ "$DRY" = 1 ] && "$PY" benchmarks/server_work.py --help > /dev/null && echo "server_work.py parses"
fi

if wanted dispfl; then  # DisPFL's round (100 ResNet18-GN clients, 10 neighbours) against a plain loop, on the GPU
  if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
    step dispfl_round.txt "$PY" benchmarks/dispfl_round.py --accelerator gpu --data-device cuda --model resnet18 --clients 100 --neighbours 10 --epochs 5 --samples 500 --batch-size 128 --repeats 2 --data-root "$CIFAR10_ROOT"
  else say "dispfl round skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
  [ "$DRY" = 1 ] && "$PY" benchmarks/dispfl_round.py --help > /dev/null && echo "dispfl_round.py parses"
fi

if wanted compile; then  # torch.compile of the fits' module against uncompiled (synthetic 32x32 images: no data)
  for m in default max-autotune-no-cudagraphs; do
    step "compile_fit_$m.txt" "$PY" benchmarks/compile_fit.py --accelerator gpu --method fedspa --model vgg11 \
      --clients 4 --samples 512 --batch-size 128 --rounds 5 --warmup 2 --compile "{\"mode\": \"$m\"}"
  done
  step compile_fit_pfedgate.txt "$PY" benchmarks/compile_fit.py --accelerator gpu --method pfedgate --model lenet \
    --clients 10 --samples 500 --batch-size 128 --rounds 5 --warmup 2
  step compile_fit_pfedgate_cudagraphs.txt "$PY" benchmarks/compile_fit.py --accelerator gpu --method pfedgate \
    --model lenet --clients 10 --samples 500 --batch-size 128 --rounds 5 --warmup 2 \
    --compile '{"mode": "reduce-overhead"}'
  [ "$DRY" = 1 ] && "$PY" benchmarks/compile_fit.py --help > /dev/null && echo "compile_fit.py parses"
fi

if wanted overhead; then
  for p in 32-true bf16-mixed 16-mixed; do
    if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
      step "overhead_$p.txt" "$PY" benchmarks/overhead.py --data-root "$CIFAR10_ROOT" --accelerator gpu --precision "$p" --repeats 7
    else say "overhead $p skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
  done
  [ "$DRY" = 1 ] && "$PY" benchmarks/overhead.py --help > /dev/null && echo "overhead.py parses"
fi

if wanted rounds; then
  if [ "$DRY" = 1 ]; then
    echo "\$ $PY benchmarks/gpu_rounds.py run"
    "$PY" benchmarks/gpu_rounds.py dry-run || exit 1
  else
    say "$PY benchmarks/gpu_rounds.py run $([ "$FORCE" = 1 ] && echo --force)"
    "$PY" benchmarks/gpu_rounds.py run $([ "$FORCE" = 1 ] && echo --force) || FAILED=1
  fi
fi

if wanted paper; then
  if [ "$DRY" = 1 ]; then
    echo "\$ $PY benchmarks/gpu_paper_runs.py run --seconds $PAPER_SECONDS"
    "$PY" benchmarks/gpu_paper_runs.py dry-run || exit 1
  else
    say "$PY benchmarks/gpu_paper_runs.py run --seconds $PAPER_SECONDS $([ "$FORCE" = 1 ] && echo --force)"
    "$PY" benchmarks/gpu_paper_runs.py run --seconds "$PAPER_SECONDS" $([ "$FORCE" = 1 ] && echo --force) || FAILED=1
  fi
fi

if wanted ray; then
  if [ "$DRY" = 0 ] && ! "$PY" -c "import ray" 2>/dev/null; then
    say "ray skipped: ray is not installed (pip install 'pl_fedsparse[ray]')"
  else
    for mode in inprocess ray; do
      step "ray_$mode.txt" "$PY" benchmarks/ray_speedup.py one --workload lenet --mode "$mode" --workers 4 \
        --gpus-per-worker 0.25 --accelerator gpu --rounds 3 --threads 4 --data-root "$CIFAR10_ROOT"
    done
    [ "$DRY" = 1 ] && "$PY" benchmarks/ray_speedup.py --help > /dev/null && echo "ray_speedup.py parses"
  fi
fi
if wanted vectorized; then
  if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
    step vectorized_lenet.txt "$PY" benchmarks/vectorized.py --task lenet --clients 100 --accelerator gpu --pairs 2 \
      --rounds 3 --data-root "$CIFAR10_ROOT"
  else say "vectorized lenet skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
  for model in vgg11 resnet18; do  # the papers' own models (FedSpa's VGG11-GN, DisPFL's ResNet18-GN)
    if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
      step "vectorized_$model.txt" "$PY" benchmarks/vectorized.py --task "$model" --clients 20 --accelerator gpu \
        --pairs 2 --rounds 3 --data-root "$CIFAR10_ROOT"
    else say "vectorized $model skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
  done
  step vectorized_mlp.txt "$PY" benchmarks/vectorized.py --task mlp --clients 100 --accelerator gpu --pairs 3 --rounds 5
  [ "$DRY" = 1 ] && "$PY" benchmarks/vectorized.py --help > /dev/null && echo "vectorized.py parses"
fi
if wanted profile; then
  PROFILE=(benchmarks/profile_fit.py --config configs/cifar10_fedspa_dst.yaml --accelerator gpu --clients 10 --top 20
           --data-root "$CIFAR10_ROOT")
  if [ -d "$CIFAR10_ROOT" ] || [ "$DRY" = 1 ]; then
    step profile_fedspa.txt "$PY" "${PROFILE[@]}" -- --data.device cuda
  else say "profile skipped: no CIFAR-10 at $CIFAR10_ROOT"; fi
  if [ "$DRY" = 1 ]; then "$PY" "${PROFILE[@]}" --dry-run -- --data.device cuda || exit 1; fi
fi
[ "$DRY" = 1 ] && echo "dry run: every step's command resolves"
exit $FAILED
