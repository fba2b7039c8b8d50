"""Why DisPFL trails D-PSGD on the CPU setting — one suspect changed at a time.

At 200 rounds of ``papers/fedspa/long_horizon.py`` (LeNet-CIFAR, 20 clients × 500 images, Dir(0.3), 1 local epoch, density
0.5 ERK, 4 random peers) D-PSGD reaches 70.2 % and DisPFL 66.7 %; the DisPFL paper has DisPFL 85.70 ≫ D-PSGD after 500
rounds of ResNet18-GN. The gap is already there at round 100 (60.3 vs 63.8), so each experiment below runs 100 rounds
of the same protocol and changes one thing, for DisPFL and — where the change also applies to it — for D-PSGD
(``dispfl_base`` is the unchanged DisPFL at 100 rounds: its mask-update rate α_t anneals over the run's T rounds, so
the 200-round run's round 100 is not the reference; D-PSGD has no such schedule and the 200-round run's first 100
rounds are the reference):

* ``*_vgg``: a mostly dense ERK backbone — VGG11-GN at width 0.25 (579,786 parameters, ERK keeps ≥ 41 % of every
  layer; LeNet's ERK keeps 13 % of conv2) at about LeNet's cost per batch on this CPU;
* ``dispfl_uniform``: uniform layer densities (every layer 50 %) instead of ERK, LeNet;
* ``dispfl_d08``: density 0.8 (ERK) — how much of the gap is capacity;
* ``dispfl_random``: the DisPFL scripts' random regrowth (``RandomRegrow``) instead of the paper's gradient regrowth;
* ``*_data``: more data per client — 1,500 training images each (a 30,000-image subset) instead of 500;
* ``*_e5``: the paper's 5 local epochs instead of 1 (50 rounds: 5× the steps per round);
* ``fedspa_*_vgg``: FedSpa's four runs (DST, RSM, FedAvg, Local; ``long_horizon.py``'s FedSpa protocol) on the same
  VGG11-GN: at 200 rounds of LeNet RSM trails FedAvg by 6.6 points and Local leads FedAvg, where the paper's VGG11-GN
  table has RSM ≈ FedAvg > Local.

Variant configs are written next to the runs (``benchmarks/_runs/dispfl_why/_configs``) from
``configs/cifar10_dispfl_cpu.yaml`` / ``configs/cifar10_dpsgd_cpu.yaml``; every record keeps the resolved config.

    git worktree add ../bench HEAD                    # pin the code for hours of runs
    mkdir -p data/cifar10 && tar -xzf ../shared/data/cifar10-jpg.tar.gz -C data/cifar10
    for w in 1 2; do DISPFL_WHY_CODE=../bench OMP_NUM_THREADS=1 nohup python papers/dispfl/dispfl_why.py run \\
        > /tmp/dispfl_why_w$w.log 2>&1 & done         # two workers, one core each; rerun the same to resume
    python papers/dispfl/dispfl_why.py table

Records: ``papers/dispfl/records/dispfl_why/<run>/{config.yaml,metrics.jsonl,summary.json}``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # runplan: shared by the long plans
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fedspa"))  # long_horizon: the setting varied here

import long_horizon
import runplan
import yaml
from runplan import Run

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
RECORD = ROOT / "papers" / "dispfl" / "records" / "dispfl_why"
RUNS = ROOT / "benchmarks" / "_runs" / "dispfl_why"
LONG = long_horizon.RECORD
CODE = Path(os.environ.get("DISPFL_WHY_CODE", ROOT)).resolve()
ROUNDS = 100
COMMON = long_horizon.COMMON  # the same protocol as the 200-round runs (data root: LONG_HORIZON_DATA)
#: long_horizon.py's overrides that put the dense baselines in FedSpa's CPU setting
FEDSPA_DENSE = long_horizon.FEDSPA["fedspa_fedavg"][1]
VGG = {"class_path": "pl_fedsparse.models.VGG11GN", "init_args": {"num_classes": 10, "width_mult": 0.25}}


def _mask_args(cfg: dict) -> dict:
    return cfg["trainer"]["callbacks"][0]["init_args"]


def _variants() -> dict[str, tuple[str, Callable[[dict], None], list[str]]]:
    """name -> (base config, edit of the loaded YAML, CLI overrides)."""

    def vgg(cfg):
        cfg["model"]["backbone"] = copy.deepcopy(VGG)

    def uniform(cfg):
        _mask_args(cfg)["distribution"] = "uniform"

    def d08(cfg):
        _mask_args(cfg)["density"] = 0.8

    def random_regrow(cfg):
        cfg["trainer"]["callbacks"][0]["class_path"] = "pl_fedsparse.callbacks.RandomRegrow"

    def same(cfg):
        pass

    dis, dps = "configs/cifar10_dispfl_cpu.yaml", "configs/cifar10_dpsgd_cpu.yaml"
    more_data = ["--data.max_train_samples", "30000"]
    e5 = ["--trainer.local_epochs", "5", "--trainer.num_rounds", "50", "--trainer.eval_every", "5",
          "--trainer.checkpoint_every", "5"]
    return {
        "dispfl_base": (dis, same, []),  # the reference: α_t's cosine spans T = 100 rounds here, not 200
        "dispfl_vgg": (dis, vgg, []),
        "dpsgd_vgg": (dps, vgg, []),
        "dispfl_uniform": (dis, uniform, []),
        "dispfl_random": (dis, random_regrow, []),
        "dispfl_data": (dis, same, more_data),
        "dpsgd_data": (dps, same, more_data),
        # FedSpa's protocol (long_horizon.py's FEDSPA runs) on the mostly dense ERK backbone: does RSM reach FedAvg,
        # and does FedAvg pass Local, as in the paper's VGG11-GN table?
        "fedspa_dst_base": ("configs/cifar10_fedspa_dst_cpu.yaml", same, []),  # LeNet, T = 100 (α_t, as dispfl_base)
        "fedspa_dst_vgg": ("configs/cifar10_fedspa_dst_cpu.yaml", vgg, []),
        "fedspa_rsm_vgg": ("configs/cifar10_fedspa_rsm_cpu.yaml", vgg, []),
        "fedspa_fedavg_vgg": ("configs/cifar10_fedavg.yaml", vgg, FEDSPA_DENSE),
        "fedspa_local_vgg": ("configs/cifar10_local.yaml", vgg, FEDSPA_DENSE),
        "dispfl_d08": (dis, d08, []),
        "dispfl_e5": (dis, same, e5),
        "dpsgd_e5": (dps, same, e5),
    }


def plan() -> list[Run]:
    out = RUNS / "_configs"
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, (base, edit, extra) in _variants().items():
        cfg = yaml.safe_load((ROOT / base).read_text())
        edit(cfg)
        path = out / f"{name}.yaml"
        path.write_text(f"# papers/dispfl/dispfl_why.py: {name} = {base} with one change (see the script)\n"
                        + yaml.safe_dump(cfg, sort_keys=False))
        runs.append(Run(name, ["--config", str(path), *COMMON, "--trainer.num_rounds", str(ROUNDS), *extra]))
    return runs


def _rows(name: str) -> list[dict]:
    for base in (RECORD, RUNS, LONG):
        metrics = base / name / "metrics.jsonl"
        if metrics.exists():
            rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
            return [r for r in rows if r.get("acc_mean") is not None]
    return []


def _at(rows: list[dict], rnd: int) -> str:
    hit = [r for r in rows if r["round"] + 1 == rnd]
    return f"{100 * hit[0]['acc_mean']:.1f}" if hit else "-"


def table() -> None:
    print("| run | r10 | r30 | r50 | r100 | bottom decile (last) | total MB (last) |")
    print("|---|---|---|---|---|---|---|")
    names = ["dispfl_dpsgd"] + list(_variants())
    at = names.index("fedspa_dst_base")
    names[at:at] = ["fedspa_rsm", "fedspa_fedavg", "fedspa_local"]  # 200-round LeNet runs: no T-dependent schedule
    for name in names:
        rows = _rows(name)
        if not rows:
            print(f"| {name} | - | - | - | - | - | - |")
            continue
        rows = [r for r in rows if r["round"] < ROUNDS]
        last = rows[-1]
        label = name if name in _variants() else f"{name} (long_horizon)"
        print(f"| {label} | {_at(rows, 10)} | {_at(rows, 30)} | {_at(rows, 50)} | {_at(rows, 100)} | "
              f"{100 * last['acc_bottom10']:.1f} | {last.get('comm_cum_bytes_total', 0) / 1e6:.0f} |")


if __name__ == "__main__":
    runplan.main(__doc__, plan, table, RUNS, RECORD, CODE)
