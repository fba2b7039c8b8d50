"""Does ``trainer.compile`` (``torch.compile`` of the module every client's fit runs) make rounds faster?

Two federations of the same method, model and data, one uncompiled and one with ``trainer.compile``, set up side by
side in this process; their rounds then run alternately (A, B, A, B, ...) so that both see the same machine load.
The first ``--warmup`` rounds are the warm-up — the compiled one's include compiling the module (once per process;
once more where a client's last batch is smaller, when dynamo makes the batch size dynamic) — and are reported apart,
with the graphs compiled so far; the later rounds are the measurement: per round, wall and CPU seconds, and the
medians' ratios.

    OMP_NUM_THREADS=1 python benchmarks/compile_fit.py [--method fedspa|fedavg|pfedgate] [--model lenet|vgg11|mlp]
        [--rounds 6] [--warmup 2] [--clients 4] [--samples 128] [--batch-size 32] [--compile '{"mode": "default"}']
        [--accelerator cpu|gpu] [--threads 1]

Synthetic 32x32 images of 10 classes (what CIFAR-10's models take; the pixels do not matter to the speed). The same
seeds in both federations: their losses are printed side by side (the compiled ones within float32 rounding).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import warnings
from typing import Any

import torch
from torch._dynamo.utils import counters

from pl_fedsparse import FederatedLoop, FederatedModule
from pl_fedsparse.callbacks import FedSpaAggregation, GradientRegrow, KeepOptimizerState, PFedGate
from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.models import MLP, LeNetCIFAR, VGG11GN

METHODS = {
    "fedavg": lambda: [],
    "fedspa": lambda: [GradientRegrow(density=0.5), FedSpaAggregation()],  # FedSpa-DST (the paper's Alg. 2)
    # pFedGate as configs/cifar10_pfedgate.yaml (its gated forward, which the compiled training step runs)
    "pfedgate": lambda: [PFedGate(density=0.5), KeepOptimizerState()],
}
MODELS = {
    "mlp": lambda: MLP(num_classes=10, in_channels=3, input_size=32),
    "lenet": lambda: LeNetCIFAR(num_classes=10),
    "vgg11": lambda: VGG11GN(num_classes=10),
}


def _federation(a: argparse.Namespace, compile_arg: Any, tag: str) -> tuple[FederatedLoop, FederatedModule]:
    torch.manual_seed(0)
    module = FederatedModule(MODELS[a.model](), lr=0.05)
    # (one round more than run: a federation's last round evaluates, which is not what is measured)
    loop = FederatedLoop(num_rounds=a.rounds + 1, local_epochs=1, eval_every=10**6, accelerator=a.accelerator,
                         callbacks=METHODS[a.method](), logger=False, enable_progress_bar=False, checkpoint_every=0,
                         default_root_dir=f"benchmarks/_runs/compile_fit_{tag}", overwrite=True, compile=compile_arg)
    dm = FederatedDataModule(name="synthetic", num_clients=a.clients, alpha=0.5, batch_size=a.batch_size,
                             synthetic={"num_train": a.samples * a.clients, "num_test": 8 * a.clients, "size": 32,
                                        "channels": 3, "num_classes": 10})
    loop.setup(module, dm)
    return loop, module


def _round(loop: FederatedLoop, r: int, cuda: bool) -> tuple[float, float, Any]:
    if cuda:
        torch.cuda.synchronize()
    w0, c0 = time.perf_counter(), time.process_time()
    row = loop.run_round(r)
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - w0, time.process_time() - c0, row.get("train_loss")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=sorted(METHODS), default="fedspa")
    ap.add_argument("--model", choices=sorted(MODELS), default="lenet")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each federation, the warm-up's included")
    ap.add_argument("--warmup", type=int, default=2, help="rounds not measured (compilation happens in them)")
    ap.add_argument("--clients", type=int, default=4, help="clients, every one fitting every round")
    ap.add_argument("--samples", type=int, default=128, help="training samples per client")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--compile", default="true", help="trainer.compile of the compiled federation (JSON)")
    ap.add_argument("--accelerator", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    a = ap.parse_args()
    if not 0 <= a.warmup < a.rounds:
        ap.error(f"--warmup={a.warmup} is invalid: expected an int in [0, --rounds={a.rounds})")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    if a.threads:
        torch.set_num_threads(a.threads)
    spec = json.loads(a.compile)
    print(f"# python benchmarks/compile_fit.py --method {a.method} --model {a.model} --rounds {a.rounds} "
          f"--clients {a.clients} --samples {a.samples} --batch-size {a.batch_size} --compile '{a.compile}' "
          f"--accelerator {a.accelerator}; torch {torch.__version__}, threads={torch.get_num_threads()}")
    eager, _ = _federation(a, False, "eager")
    compiled, module = _federation(a, spec, "compiled")
    cuda = eager.device.type == "cuda"
    times: dict[str, list[tuple[float, float]]] = {"eager": [], "compiled": []}
    for r in range(a.rounds):
        (we, ce, le), (wc, cc, lc) = _round(eager, r, cuda), _round(compiled, r, cuda)
        graphs = int(counters["stats"]["unique_graphs"])
        what = f"warm-up, {graphs} graphs compiled so far" if r < a.warmup else f"measured, {graphs} graphs"
        print(f"round {r} ({what}): eager {we:.3f} s wall / {ce:.3f} s CPU, compiled {wc:.3f} s wall / "
              f"{cc:.3f} s CPU; train_loss {le} / {lc}")
        if r >= a.warmup:
            times["eager"].append((we, ce))
            times["compiled"].append((wc, cc))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
    print(f"compiled: {getattr(module, '_compiler_ctx', None) is not None}")
    for loop in (eager, compiled):  # (the run directories' locks released: the federations end here)
        loop.executor.teardown()
        loop.reporter.release()
    print(f"median per round: eager {med['eager'][0]:.3f} s wall / {med['eager'][1]:.3f} s CPU, compiled "
          f"{med['compiled'][0]:.3f} s wall / {med['compiled'][1]:.3f} s CPU")
    print(f"ratio compiled / eager = {med['compiled'][0] / med['eager'][0]:.3f} wall, "
          f"{med['compiled'][1] / med['eager'][1]:.3f} CPU (below 1: compiling pays)")


if __name__ == "__main__":
    main()
