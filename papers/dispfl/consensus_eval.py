"""Evaluate the *consensus* of a serverless run — the uniform average of every client's personal model — on every
client's test data, from a checkpoint.

Why: the DisPFL code reports, for D-PSGD, the uniform average of all 100 client models (``dpsgd_api.py:85,159-167``,
method notes ``dispfl_fedspa.md`` "D-PSGD"), and D-PSGD-FT fine-tunes from that average. pl_fedsparse's serverless
runs report each client's last trained model (personal accuracy, ``acc_mean``) and have no global model; with
``Gossip(consensus_eval: true)`` (the D-PSGD configs) a run also reports the consensus at every evaluation
(``consensus_acc`` in ``metrics.jsonl``). This script gives the same number for a run made without it, from a
checkpoint: it switches that evaluation view on and evaluates — the very code path of the in-run view
(:func:`pl_fedsparse.callbacks.gossip.consensus_state`, the ``"consensus"`` model kind of
:mod:`pl_fedsparse.evaluation`), so its ``consensus_acc`` equals the run's own at the same round
(``tests/test_consensus_view.py``).

    python papers/dispfl/consensus_eval.py benchmarks/_runs/long_horizon/dispfl_dpsgd [--ckpt last.ckpt] \\
        [--data-root data/cifar10] [--out papers/fedspa/records/long_horizon/dispfl_dpsgd/consensus.json]

The run directory must hold ``config.yaml`` and ``checkpoints/<ckpt>``; nothing is written to it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

from pl_fedsparse.callbacks import Gossip
from pl_fedsparse.cli import FedCLI

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)


def consensus_metrics(run_dir: Path, ckpt: str, data_root: Path) -> dict:
    """Personal and consensus accuracy of every client at the checkpoint ``run_dir/checkpoints/ckpt``."""
    with tempfile.TemporaryDirectory() as tmp:
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        config.pop("ckpt_path", None)  # a `fit` option: this builds the classes without a subcommand
        (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(config))
        cli = FedCLI(args=["--config", str(Path(tmp) / "config.yaml"), "--data.root", str(data_root),
                           "--trainer.default_root_dir", tmp, "--trainer.logger", "false",
                           "--trainer.enable_progress_bar", "false", "--trainer.accelerator", "cpu"], run=False)
        loop, model, dm = cli.trainer, cli.model, cli.datamodule
        gossip = [cb for cb in loop.callbacks if isinstance(cb, Gossip)]
        if not gossip:
            raise SystemExit(f"{run_dir}: not a Gossip run (D-PSGD, DisPFL); its config has no "
                             "pl_fedsparse.callbacks.Gossip")
        for cb in gossip:
            cb.consensus_eval = True  # the in-run view (evaluation only: it changes no state)
        loop.setup(model, dm, ckpt_path=str(run_dir / "checkpoints" / ckpt), stage="test")
        metrics = loop.evaluate("test")
        return {"run_dir": str(run_dir), "ckpt": ckpt, "round": loop.round_idx, "num_clients": loop.num_clients,
                "acc_mean": metrics["acc_mean"], "acc_bottom10": metrics["acc_bottom10"],
                "consensus_acc": metrics["consensus_acc"], "consensus_acc_weighted": metrics["consensus_acc_weighted"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dirs", type=Path, nargs="+")
    ap.add_argument("--ckpt", default="last.ckpt")
    ap.add_argument("--data-root", type=Path, default=ROOT / "data" / "cifar10")
    ap.add_argument("--out", type=Path, default=None, help="write the results (a list, one per run) as JSON here")
    args = ap.parse_args()
    rows = []
    for run_dir in args.run_dirs:
        r = consensus_metrics(run_dir, args.ckpt, args.data_root)
        rows.append(r)
        print(f"{run_dir.name}: round {r['round']}, personal {100 * r['acc_mean']:.2f} %, "
              f"consensus {100 * r['consensus_acc']:.2f} %")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
