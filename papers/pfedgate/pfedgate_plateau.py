"""How long pFedGate's initial loss plateau lasts on real CIFAR-10, per option — our path only (no reference needed).

``papers/pfedgate/pfedgate_reference_check.py`` shows that our gated step equals the authors' code step by step and that
at initialisation every block's gated weight is M ≈ 0.5, so each of LeNet's five layers is halved and the logits'
input-dependent part is ~1/32-1/57 of the dense model's. This script measures what that costs: one client, 64 fixed
batches of 128 real CIFAR-10 training images cycled, ``--steps`` joint steps (θ lr 0.03; gate lr 1.5 at s = 0.5,
0.05 at s = 1; SGD momentum 0.9, weight decay 5e-4, clip 10 — Table 7's CIFAR-10 rates), the same initial θ and
gate for every variant, through the library's real Lightning fit with the ``PFedGate`` callback:

* ``code``: the reference code's options (``straight_through: code``, ``relu_logits: true``);
* ``defaults``: the library's defaults (the paper's straight-through, no ReLU on the logits);
* ``code_ste``: the code's straight-through without the ReLU (which of the two options matters);
* ``dense``: the same model and optimizer without the gate (FedAvg's local fit).

It prints the loss every 100 steps and the *plateau exit*: the first step whose 20-step running mean loss is below
2.2 (ln 10 = 2.303 is chance), and writes ``papers/pfedgate/records/pfedgate_reference/plateau.json``.

    mkdir -p data/cifar10 && tar -xzf ../shared/data/cifar10-jpg.tar.gz -C data/cifar10
    OMP_NUM_THREADS=1 python papers/pfedgate/pfedgate_plateau.py --steps 1000     # ~10 min on one core
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import pfedgate_reference_check as H
import torch

from pl_fedsparse.callbacks import PFedGate

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
VARIANTS = {
    "code": {"straight_through": "code", "relu_logits": True},
    "defaults": {"straight_through": "paper", "relu_logits": False},
    "code_ste": {"straight_through": "code", "relu_logits": False},
}


def exit_step(loss: list[float], window: int = 20, level: float = 2.2) -> int | None:
    """The first step whose ``window``-step running mean of ``loss`` is below ``level`` (None: never)."""
    for i in range(window, len(loss) + 1):
        if sum(loss[i - window:i]) / window < level:
            return i - 1
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--num-batches", type=int, default=64)
    ap.add_argument("--data-root", type=Path, default=ROOT / "data" / "cifar10")
    ap.add_argument("--densities", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--out", type=Path,
                    default=ROOT / "papers" / "pfedgate" / "records" / "pfedgate_reference" / "plateau.json")
    args = ap.parse_args()
    batches = H.make_batches("cifar10", args.num_batches, 0, args.data_root)
    torch.manual_seed(0)
    theta0 = {f"backbone.{k}": v.clone() for k, v in H.LeNetCIFAR(num_classes=10).state_dict().items()}
    probe = H.new_callback(0.5)
    probe.table = H.block_table(H.new_module(theta0, 0.03), H.B)
    gate0 = {k: v.clone() for k, v in probe._new_gate(1, (3, 32, 32)).state_dict().items()}
    root = tempfile.mkdtemp()
    runs: dict[str, dict] = {}
    original = H.new_callback
    try:
        for name, options in VARIANTS.items():
            for s in args.densities:
                H.new_callback = lambda s_, o=options: PFedGate(
                    density=s_, num_splits=H.B, split="equal", solver="greedy", separate_paths=False,
                    gate_lr=H.SETTINGS[s_]["gate_lr"], gate_momentum=H.MOMENTUM, gate_weight_decay=H.WD,
                    gate_clip=H.CLIP, schedule="joint", aggregation="fedavg", **o)
                steps = H.run_ours(s, theta0, gate0, batches, args.steps, root)["steps"]
                runs[f"{name}/s={s}"] = {"options": options, "density": s,
                                         "loss": [st["loss"] for st in steps],
                                         "M_mean": [float(st["M"].mean()) for st in steps]}
    finally:
        H.new_callback = original
    runs["dense"] = {"loss": [st["loss"] for st in H.run_dense(0.5, theta0, batches, args.steps, root)["steps"]]}
    print(f"{'variant':<16} {'exit':>5}  loss every 100 steps")
    summary = {}
    for name, r in runs.items():
        loss = r["loss"]
        ex = exit_step(loss)
        summary[name] = {"plateau_exit_step": ex, "loss_every_100": [round(x, 4) for x in loss[::100]],
                         "loss_last50_mean": sum(loss[-50:]) / min(50, len(loss)),
                         **({"M_mean_every_100": [round(x, 4) for x in r["M_mean"][::100]]} if "M_mean" in r else {})}
        print(f"{name:<16} {ex!s:>5}  {' '.join(f'{x:.2f}' for x in loss[::100])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "num_batches": args.num_batches, "batch": H.BATCH,
                                    "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
