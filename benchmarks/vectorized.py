"""Seconds per round: the VectorizedExecutor against the in-process executor, same federation, alternating runs.

Workloads (``--task``):

* ``mlp`` — the quickstart task (synthetic 3×16×16 images, the 2×200 MLP, batch 32, 2 local epochs, lr 0.1, its
  6,000 images; ``--samples`` changes that) split over ``--clients`` clients (default 100, Dirichlet 0.3), every one
  of them training every round (``join_ratio 1``): the regime where per-client cost dominates.
* ``lenet`` — LeNet-CIFAR on real CIFAR-10 (``--data-root``, 32×32 RGB, batch 64, 1 local epoch, augmentation off),
  ``--clients`` clients of 500 training images, all training every round.
* ``vgg11``, ``resnet18`` — the same with the papers' own models: FedSpa's VGG11-GN and DisPFL's ResNet18-GN
  (plain FedAvg training, so the executors are compared on the model alone).
* ``fedrep``, ``fedem`` — ``configs/synthetic_fedrep.yaml`` with its FedRep callback (head epochs, then the body:
  each client's frozen part chosen per step), ``configs/synthetic_fedem.yaml`` with its FedEM callback (a mixture of
  three MLPs: every client's E-step and weighted loss in one step), on the ``mlp`` task's images (``--samples``) over
  ``--clients`` clients.
* ``pfedgate`` — ``configs/cifar10_pfedgate.yaml`` as it is (pFedGate's gated LeNet-CIFAR, the code's settings,
  batch 128, one epoch, every client every round) over ``--clients`` clients: real CIFAR-10 with ``--data-root``,
  else synthetic 32×32 RGB images (500 a client).

Each run is ``--rounds`` rounds (default 4) without evaluation (only the last round evaluates; it is left out) and
without checkpoints; the first round is left out too (warm-up). Runs alternate A, B, A, B … (``--pairs`` pairs), and
the script prints, per executor, the median training seconds per round (``time_train_s`` of the rows), the CPU
seconds per round (process CPU time over the timed rounds), and the ratios in-process / vectorised. It also checks
that the two executors' final accuracies agree (|Δ| ≤ 1e-5), so a fast wrong answer cannot pass. Arguments after
``--`` go to both runs' command line as they are (e.g. ``-- --model.optimizer adam --model.lr 0.003``).

    OMP_NUM_THREADS=1 python benchmarks/vectorized.py --task mlp --clients 100 --pairs 5
    OMP_NUM_THREADS=1 python benchmarks/vectorized.py --task fedrep --clients 100 --pairs 5
    OMP_NUM_THREADS=1 python benchmarks/vectorized.py --task fedem --clients 100 --pairs 5
    OMP_NUM_THREADS=1 python benchmarks/vectorized.py --task fedrep --clients 100 --pairs 5 -- --model.optimizer adam
    OMP_NUM_THREADS=1 python benchmarks/vectorized.py --task lenet --clients 10 --data-root data/cifar10
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_rounds import GpuSampler

from pl_fedsparse.allocator import tune_malloc
from pl_fedsparse.cli import FedCLI

EXECUTORS = {"in_process": None, "vectorized": "pl_fedsparse.executors.VectorizedExecutor"}


def args_for(task: str, clients: int, rounds: int, data_root: str | None, tmp: str, samples: int,
             accelerator: str = "cpu") -> list[str]:
    common = ["--trainer.num_rounds", str(rounds), "--trainer.join_ratio", "1.0", "--trainer.eval_every", "1000",
              "--trainer.checkpoint_every", "0", "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              "--trainer.accelerator", accelerator, "--trainer.default_root_dir", tmp, "--trainer.callbacks", "[]",
              "--data.num_clients", str(clients)]
    if task == "mlp":
        return ["--config", str(ROOT / "configs" / "quickstart.yaml"), *common,
                "--data.synthetic", json.dumps({"num_train": samples})]
    own = [a for i, a in enumerate(common) if a != "--trainer.callbacks" and common[i - 1] != "--trainer.callbacks"]
    if task in ("fedrep", "fedem"):  # the config's own callback (PersonalLayers in FedRep's mode; FedEM)
        return ["--config", str(ROOT / "configs" / f"synthetic_{task}.yaml"), *own,
                "--data.synthetic", json.dumps({"num_train": samples})]
    if task == "pfedgate":  # the config's own callbacks (PFedGate, KeepOptimizerState)
        data = (["--data.root", data_root] if data_root is not None else
                ["--data.name", "synthetic", "--data.root", "null", "--data.synthetic",
                 json.dumps({"num_train": 625 * clients, "num_test": 100, "size": 32, "channels": 3})])
        return ["--config", str(ROOT / "configs" / "cifar10_pfedgate.yaml"), *own, *data]
    if data_root is None:
        raise SystemExit(f"--data-root is required for --task {task} (a folder with CIFAR-10, see README 'Data')")
    model = {"vgg11": ["--model.backbone", "pl_fedsparse.models.VGG11GN"],
             "resnet18": ["--model.backbone", "pl_fedsparse.models.ResNet18GN"]}.get(task, [])
    return ["--config", str(ROOT / "configs" / "cifar10_fedavg.yaml"), *common, "--data.root", data_root,
            "--data.max_train_samples", str(500 * clients), "--trainer.local_epochs", "1", "--data.augment", "false",
            *model]


def one_run(task: str, executor: str | None, clients: int, rounds: int, data_root: str | None,
            samples: int = 6000, group_size: int | None = None, accelerator: str = "cpu",
            extra: list[str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*args_for(task, clients, rounds, data_root, tmp, samples, accelerator), *(extra or [])]
        sampler = GpuSampler(Path(tmp) / "gpu.csv") if accelerator == "gpu" else None
        if executor:
            init = {"max_group_size": group_size} if group_size else {}
            argv += ["--trainer.executor", json.dumps({"class_path": executor, "init_args": init})]
        with contextlib.redirect_stdout(io.StringIO()):
            cli = FedCLI(args=argv, run=False)
            loop = cli.trainer
            timed: list[float] = []
            cpu0 = [0.0]
            real_round = loop.run_round

            def timed_round(r: int) -> dict[str, Any]:
                if r == 1:
                    cpu0[0] = time.process_time()
                if r == rounds - 1:
                    timed.append(time.process_time() - cpu0[0])
                return real_round(r)

            loop.run_round = timed_round  # type: ignore[method-assign]
            loop.fit(cli.model, cli.datamodule)
        gpu = sampler.stop() if sampler is not None else {}
    rows = loop.history
    train = [r["time_train_s"] for r in rows[1:-1]]
    return {"train_s": statistics.median(train), "cpu_s": timed[0] / max(1, rounds - 2),
            "acc": rows[-1].get("acc_mean"), "loss": rows[-1].get("loss_mean"), **gpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=["mlp", "fedrep", "fedem", "lenet", "vgg11", "resnet18", "pfedgate"],
                   default="mlp")
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--data-root", default=None)
    p.add_argument("--samples", type=int, default=6000,
                   help="mlp, fedrep, fedem: synthetic images in all, shared by the clients (6000: the quickstart's)")
    p.add_argument("--group-size", type=int, default=None, help="VectorizedExecutor.max_group_size (default: its own)")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], default="cpu",
                   help="gpu: also the GPU's utilisation (nvidia-smi samples every 250 ms, mean over the run)")
    p.add_argument("--out", default=None, help="write the raw results as JSON here")
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    a.extra = extra
    if a.rounds < 3:
        p.error("--rounds must be >= 3 (the first and the last round are not timed)")
    logging.disable(logging.WARNING)
    tune_malloc()  # as `pl-fed` does at start-up, for both executors
    torch.set_num_threads(max(1, torch.get_num_threads()))
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in EXECUTORS}
    for pair in range(a.pairs):
        order = list(EXECUTORS) if pair % 2 == 0 else list(reversed(EXECUTORS))
        for name in order:
            runs[name].append(one_run(a.task, EXECUTORS[name], a.clients, a.rounds, a.data_root, a.samples,
                                      a.group_size, a.accelerator, a.extra))
        print(f"pair {pair}: " + ", ".join(f"{n} {runs[n][-1]['train_s']:.3f} s" for n in EXECUTORS), flush=True)
    med = {n: {k: statistics.median(r[k] for r in runs[n]) for k in ("train_s", "cpu_s")} for n in EXECUTORS}
    ref, vec = runs["in_process"][-1], runs["vectorized"][-1]
    dacc = abs(ref["acc"] - vec["acc"])
    print(f"task {a.task}, {a.clients} clients per round, {a.rounds} rounds x {a.pairs} pairs, "
          f"{torch.get_num_threads()} thread(s)" + (f", with {' '.join(a.extra)}" if a.extra else ""))
    for n in EXECUTORS:
        util = [r["gpu_util_mean"] for r in runs[n] if r.get("gpu_util_mean") is not None]
        extra = f"   GPU util {statistics.median(util):.0f} %" if util else ""
        print(f"  {n:<11} train {med[n]['train_s']:.3f} s/round   cpu {med[n]['cpu_s']:.3f} s/round{extra}")
    print(f"  speed-up (in-process / vectorised): wall {med['in_process']['train_s'] / med['vectorized']['train_s']:.2f}x"
          f"   cpu {med['in_process']['cpu_s'] / med['vectorized']['cpu_s']:.2f}x")
    print(f"  final accuracy: in-process {ref['acc']:.6f}, vectorised {vec['acc']:.6f} (|diff| {dacc:.1e})")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "runs": runs, "median": med}, indent=1))
    if dacc > 1e-5 and a.accelerator == "cpu":  # bit-exact on the CPU (tests/test_vectorized.py)
        raise SystemExit(f"the executors disagree: |acc diff| = {dacc:.2e} > 1e-5")
    if dacc > 1e-5:  # cuBLAS/cuDNN may round batched and single products differently: reported, not an error
        print(f"  note: on the GPU the final accuracies differ by {dacc:.2e}")


if __name__ == "__main__":
    main()
