"""Seconds per FedAvg round: pl_fedsparse against Flower's simulation engine and PFLlib, on the same split.

The workload (``fedavg_lenet.yaml``): LeNet-CIFAR, 10 IID clients of 500 CIFAR-10 training images and 1,000 test
images each, every client training one epoch (batch 64, plain SGD, lr 0.05) and every client evaluated every round.
The split is pl_fedsparse's, exported once (normalised float images, ``<work>/dataset/<name>/{train,test}/<k>.npz``,
the layout PFLlib reads) and read by the peers' scripts (``flower_fedavg.py``, ``pfllib_fedavg.py``), which run in
their own virtual environments (created under ``<work>`` on first use: torch 2.14.1 and ``flwr[simulation]==1.42.0``;
torch and PFLlib's few imports for PFLlib) with PFLlib's code at a pinned commit (cloned from GitHub, or
``--pfllib-src``: a checkout or a folder holding its ``system/``). LeNet is the same network in all three
(``common.py``; checked against ``pl_fedsparse.models.LeNetCIFAR`` layer by layer before any run).

Each framework runs ``--rounds`` rounds in a fresh process (one torch thread; Flower: one Ray worker), the
frameworks alternate (``--pairs`` times, the order rotating), and the script prints each one's median seconds per
round over rounds 2.. (the first warms up; pl_fedsparse: its rows' ``time_s``, training and evaluation; Flower: from
one round's evaluation to the next; PFLlib: its own per-round ``Budget``) and the ratios pl_fedsparse / peer (below
1: pl_fedsparse is faster).

What each does per round besides the shared work: pl_fedsparse counts every message's bytes and the FLOPs and
summarises the per-client accuracies; Flower serialises the weights to and from its worker; PFLlib also computes the
training loss over every client's training data at every evaluation (its own default).

    python benchmarks/peers/run.py --data-root data/cifar10 --pairs 3
    python benchmarks/peers/run.py --data-root data/cifar10 --pfllib-src /path/to/PFLlib --only pfllib
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: PFLlib at the commit these numbers were taken with
PFLLIB_URL, PFLLIB_COMMIT = "https://github.com/TsingZ0/PFLlib", "d832e76f6a23b833038949ec1e4fdefe63a4d350"
FLWR = "flwr[simulation]==1.42.0"
TORCH = ["torch==2.14.1", "torchvision==0.29.1"]
DATASET = "plfs_cifar10_10"


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def venv(path: Path, packages: list[str]) -> Path:
    """``path``'s python, the environment created with ``packages`` if it does not exist yet."""
    py = path / "bin" / "python"
    if not py.exists():
        print(f"creating {path} ({' '.join(packages)})", flush=True)
        sh([sys.executable, "-m", "venv", str(path)])
        sh([str(py), "-m", "pip", "install", "-q", *TORCH])
        sh([str(py), "-m", "pip", "install", "-q", *packages])
    return py


def pfllib_system(work: Path, src: str | None) -> Path:
    """A private copy of PFLlib's ``system/`` folder (its ``../dataset`` is ours)."""
    dest = work / "PFLlib"
    if not (dest / "system").exists():
        if src is None:
            clone = work / "PFLlib-src"
            if not clone.exists():
                sh(["git", "clone", "-q", PFLLIB_URL, str(clone)])
            sh(["git", "-C", str(clone), "checkout", "-q", PFLLIB_COMMIT])
            src = str(clone)
        source = Path(src)
        if (source / ".git").exists() or (source / "HEAD").exists():  # a checkout or a bare repository: the pinned
            dest.mkdir(parents=True, exist_ok=True)                      # commit's system/ only
            archive = subprocess.run(["git", "--git-dir", str(source / ".git") if (source / ".git").exists()
                                      else str(source), "archive", PFLLIB_COMMIT, "system"],
                                     check=True, capture_output=True).stdout
            sh(["tar", "-x", "-C", str(dest)], input=archive)
        else:
            shutil.copytree(source / "system", dest / "system")
    (dest / "dataset").mkdir(exist_ok=True)
    link = dest / "dataset" / DATASET
    if not link.exists():
        link.symlink_to(work / "dataset" / DATASET, target_is_directory=True)
    return dest / "system"


def export_split(config: Path, data_root: str, work: Path) -> dict[str, Any]:
    """pl_fedsparse's split of the workload, normalised as its loaders yield it, in PFLlib's layout."""
    import numpy as np
    import torch

    from pl_fedsparse.cli import FedCLI
    from pl_fedsparse.models import LeNetCIFAR

    sys.path.insert(0, str(HERE))
    from common import LeNet

    ours, theirs = LeNetCIFAR(num_classes=10).state_dict(), LeNet().state_dict()
    shapes = [(n, tuple(t.shape)) for n, t in ours.items()]
    if [tuple(t.shape) for t in theirs.values()] != [s for _, s in shapes]:
        raise SystemExit(f"common.py LeNet is not LeNetCIFAR: {shapes} vs {[tuple(t.shape) for t in theirs.values()]}")
    out = work / "dataset" / DATASET
    if (out / "info.json").exists():
        return json.loads((out / "info.json").read_text())
    cli = FedCLI(args=["--config", str(config), "--data.root", data_root], run=False)
    dm = cli.datamodule
    dm.prepare_data()
    dm.setup("fit")
    sizes: dict[str, list[int]] = {"train": [], "test": []}
    for part in ("train", "test"):
        (out / part).mkdir(parents=True, exist_ok=True)
        for k in range(dm.num_clients):
            batches = list(dm.eval_loader(k, split=part))
            x = torch.cat([b[0] for b in batches]).numpy()
            y = torch.cat([b[1] for b in batches]).numpy()
            np.savez(out / part / f"{k}.npz", data={"x": x, "y": y})
            sizes[part].append(len(y))
    info = {"clients": dm.num_clients, "train": sizes["train"], "test": sizes["test"]}
    (out / "info.json").write_text(json.dumps(info))
    return info


def run_one(name: str, a: argparse.Namespace, work: Path, pys: dict[str, Path], system: Path | None,
            clients: int) -> list[float]:
    """One run of ``name``: its seconds per round (all rounds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = work / f"times_{name}.json"
    out.unlink(missing_ok=True)
    if name == "pl_fedsparse":
        run_dir = work / "plfs"
        cmd = [str(Path(sys.executable).parent / "pl-fed"), "fit", "--config", str(HERE / "fedavg_lenet.yaml"),
               "--data.root", a.data_root, "--trainer.num_rounds", str(a.rounds), "--model.lr", str(a.lr),
               "--trainer.default_root_dir", str(run_dir)]
        sh(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["time_s"] for r in rows]
    common = ["--clients", str(clients), "--rounds", str(a.rounds), "--lr", str(a.lr), "--out", str(out)]
    if name == "flower":
        sh([str(pys["flower"]), str(HERE / "flower_fedavg.py"), "--data", str(work / "dataset" / DATASET), *common],
           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        assert system is not None
        sh([str(pys["pfllib"]), str(HERE / "pfllib_fedavg.py"), "--dataset", DATASET, *common], env=env,
           cwd=system, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["round_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", required=True, help="CIFAR-10 (an extracted copy; see the README's 'Data')")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pairs", type=int, default=3, help="how many times each framework runs")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--only", default="flower,pfllib", help="peers to run, comma-separated: flower, pfllib")
    p.add_argument("--pfllib-src", default=None, help="a PFLlib checkout (or its bare repository) to take the pinned "
                                                      "commit's system/ from, instead of cloning it")
    p.add_argument("--work", default=str(HERE / ".work"), help="environments, the exported split, the runs")
    p.add_argument("--out", default=None, help="write the raw per-round times as JSON here")
    a = p.parse_args()
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (the first round is not timed)")
    peers = [x for x in a.only.split(",") if x]
    for x in peers:
        if x not in ("flower", "pfllib"):
            p.error(f"--only: {x!r} is not one of flower, pfllib")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    info = export_split(HERE / "fedavg_lenet.yaml", a.data_root, work)
    pys = {}
    if "flower" in peers:
        pys["flower"] = venv(work / "venv-flower", [FLWR])
    system = None
    if "pfllib" in peers:
        pys["pfllib"] = venv(work / "venv-pfllib", ["numpy<2.3", "scikit-learn", "scipy", "h5py", "ujson", "matplotlib",
                                                    "pandas"])
        system = pfllib_system(work, a.pfllib_src)
    names = ["pl_fedsparse", *peers]
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    print(f"{info['clients']} clients, {sum(info['train'])} training and {sum(info['test'])} test images, "
          f"{a.rounds} rounds per run, {a.pairs} runs each", flush=True)
    for rep in range(a.pairs):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for n in order:
            t = time.perf_counter()
            times[n].append(run_one(n, a, work, pys, system, info["clients"]))
            med = statistics.median(times[n][-1][1:])
            print(f"run {rep} {n}: {med:.3f} s/round over rounds 2-{a.rounds} ({time.perf_counter() - t:.0f} s in "
                  "all)", flush=True)
    med = {n: statistics.median(x for run in times[n] for x in run[1:]) for n in names}
    for n in names:
        print(f"  {n:<13} {med[n]:.3f} s/round (median over {a.pairs} runs x {a.rounds - 1} rounds)")
    for n in peers:
        print(f"  ratio pl_fedsparse / {n} = {med['pl_fedsparse'] / med[n]:.2f}")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "times": times, "median": med}, indent=1))


if __name__ == "__main__":
    main()
