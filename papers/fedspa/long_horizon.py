"""FedSpa's and DisPFL's orderings at a horizon where they should hold — 200+ rounds on CPU.

The setting is each paper's protocol at the smallest size that runs here (CIFAR-10, LeNet-CIFAR, Dir(0.3), 20
clients of 500 training images, per-client test sets drawn from the global test split with the client's label
proportions, batch 64, SGD lr 0.1·0.998^t, wd 5e-4, clip 10, augmentation, density 0.5 ERK). What is scaled, and why:

* 20 clients instead of 100, 500 images each (a 10,000-image subset): a round must take seconds on one core;
* **one local epoch** instead of five: 200+ rounds of 8 methods must fit in about one three-hour stretch on two
  cores (the papers' 5 epochs × 500 images would be ~5× slower); the number of local steps per round changes, the
  protocols (who trains, what is sent, how it is aggregated) do not;
* LeNet instead of VGG11-GN / ResNet18-GN (CPU); the backbone question is studied separately
  (papers/dispfl/README.md: a mostly dense ERK backbone).

FedSpa's protocol: a server, 10 of 20 clients per round (the paper samples 10 %), DST (prune |w| / regrow |grad|,
same initial mask) and RSM, FedAvg and Local as in its table. DisPFL's: no server, every client trains every round,
4 random peers per round (≈ 10 of 99), DisPFL (prune |w| / regrow |grad|, per-client masks), D-PSGD, D-PSGD-FT and
Local (every client every round). Every run evaluates every 10 rounds and checkpoints every 10 rounds, so a run cut
by the end of a session resumes (``benchmarks/runplan.py``).

    git worktree add ../bench HEAD                    # pin the code for hours of runs
    mkdir -p data/cifar10 && tar -xzf ../shared/data/cifar10-jpg.tar.gz -C data/cifar10
    # seeds 1 and 2 of one claim first (run names <name>_seed<s>; seed 0 keeps the plain name)
    LONG_HORIZON_SEEDS="1 2" LONG_HORIZON_ONLY=dispfl,dispfl_local ... python papers/fedspa/long_horizon.py run
    for w in 1 2; do LONG_HORIZON_CODE=../bench OMP_NUM_THREADS=1 nohup python papers/fedspa/long_horizon.py run \\
        > /tmp/long_horizon_w$w.log 2>&1 & done        # two workers, one core each; rerun the same to resume
    python papers/fedspa/long_horizon.py table           # the final table (personal accuracy, bytes) so far
    python papers/fedspa/long_horizon.py plan            # the commands

Records: ``papers/fedspa/records/long_horizon/<run>/{config.yaml,metrics.jsonl,summary.json}``; curves with
``pl-fed report papers/fedspa/records/long_horizon/fedspa_* --out docs/...`` (``pl-fed report`` reads run directories and
records alike).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans

import runplan
from runplan import Run

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "fedspa" / "records" / "long_horizon"
RUNS = ROOT / "benchmarks" / "_runs" / "long_horizon"
CODE = Path(os.environ.get("LONG_HORIZON_CODE", ROOT)).resolve()
DATA = os.environ.get("LONG_HORIZON_DATA", str(ROOT / "data" / "cifar10"))
ROUNDS = int(os.environ.get("LONG_HORIZON_ROUNDS", "200"))
#: seeds to run; seed s > 0 is the run ``<name>_seed<s>`` with ``--seed_everything s --data.seed s`` (another
#: initialisation, client sampling *and* partition: the spread covers all three)
SEEDS = [int(s) for s in os.environ.get("LONG_HORIZON_SEEDS", "0 1 2").split()]
#: only these runs (base names, comma-separated), e.g. ``dispfl,dispfl_local`` to settle one claim first
ONLY = [n for n in os.environ.get("LONG_HORIZON_ONLY", "").split(",") if n]

#: run -> (config, overrides beyond the common ones)
FEDSPA = {
    "fedspa_dst": ("configs/cifar10_fedspa_dst_cpu.yaml", []),
    "fedspa_rsm": ("configs/cifar10_fedspa_rsm_cpu.yaml", []),
    "fedspa_fedavg": ("configs/cifar10_fedavg.yaml", ["--data.num_clients", "20", "--data.max_train_samples", "10000",
                                                      "--trainer.join_ratio", "0.5"]),
    "fedspa_local": ("configs/cifar10_local.yaml", ["--data.num_clients", "20", "--data.max_train_samples", "10000",
                                                    "--trainer.join_ratio", "0.5"]),
}
DISPFL = {
    "dispfl": ("configs/cifar10_dispfl_cpu.yaml", []),
    "dispfl_dpsgd": ("configs/cifar10_dpsgd_cpu.yaml", []),
    "dispfl_dpsgd_ft": ("configs/cifar10_dpsgd_ft_cpu.yaml", []),
    "dispfl_local": ("configs/cifar10_local_p2p_cpu.yaml", []),
}
COMMON = ["--data.root", DATA, "--trainer.local_epochs", "1", "--trainer.eval_every", "10",
          "--trainer.checkpoint_every", "10", "--trainer.accelerator", "cpu", "--trainer.logger", "false"]


def run_name(name: str, seed: int) -> str:
    return name if seed == 0 else f"{name}_seed{seed}"


def plan() -> list[Run]:
    runs = []
    for seed in SEEDS:
        # interleaved so that two workers progress on both papers at once
        for (a, (ca, oa)), (b, (cb, ob)) in zip(FEDSPA.items(), DISPFL.items()):
            for name, config, extra in ((b, cb, ob), (a, ca, oa)):
                if ONLY and name not in ONLY:
                    continue
                seed_args = [] if seed == 0 else ["--seed_everything", str(seed), "--data.seed", str(seed)]
                runs.append(Run(run_name(name, seed), ["--config", config, *COMMON, "--trainer.num_rounds",
                                                       str(ROUNDS), *extra, *seed_args], {"seed": seed}))
    return runs


def table() -> None:
    print("| run | rounds | acc_mean | acc_bottom10 | global_acc | best acc_mean (round) | total MB |")
    print("|---|---|---|---|---|---|---|")
    for run in plan():
        for base in (RECORD, RUNS):
            metrics = base / run.name / "metrics.jsonl"
            if metrics.exists():
                break
        else:
            print(f"| {run.name} | - | | | | | |")
            continue
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        rows = [r for r in rows if r.get("acc_mean") is not None]
        if not rows:
            continue
        last, best = rows[-1], max(rows, key=lambda r: r["acc_mean"])
        g = last.get("global_acc")
        print(f"| {run.name}{'' if base == RECORD else ' (running)'} | {last['round'] + 1} | "
              f"{100 * last['acc_mean']:.2f} | {100 * last['acc_bottom10']:.2f} | "
              f"{'-' if g is None else f'{100 * g:.2f}'} | {100 * best['acc_mean']:.2f} ({best['round'] + 1}) | "
              f"{last.get('comm_cum_bytes_total', 0) / 1e6:.1f} |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
