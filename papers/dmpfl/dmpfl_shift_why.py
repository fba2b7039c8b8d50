"""Why DM-PFL+ stays below FedAvg under 100 % test-time shift here (the paper: DM-PFL+ 59.61 > FedAvg 58.56), one
change at a time, on the trained federation of a recorded run — no retraining.

The DM-PFL+ run of ``papers/dmpfl/dmpfl_table.py`` (``dmpfl_plus_seed<s>``, 30 rounds; ``--rounds 100``: the 100-round
plan's run) is restored from its last checkpoint and evaluated again at its last round (every view of
``configs/cifar10_dmpfl_plus_cpu.yaml``) with:

* ``as run`` — AdaptiveInference as configured (base entropies on the client's training data, cosine of softmax
  outputs): must reproduce the recorded ``shift100/acc_mean``;
* ``base entropies on clean test data`` — ``base_split: eval``, the other reading of Alg. 4's "unshifted inputs";
* ``cosine of logits`` — ``cosine_on: logits``;
* ``global model only`` — θ_g for every sample (DM-PFL's sparse global model);
* ``oracle`` — a sample counts as right when the personal or the global model is right: no per-sample rule between
  these two models can do better.

Per variant: accuracy at 100 % and 0 % shift (mean over clients) and the share of samples given to the personal
model; and the mean base entropies BE(θ_c), BE(θ_g) the rule subtracts. FedAvg's dense global model at 100 % shift
is read from the same seed's FedAvg record for comparison.

    python papers/dmpfl/dmpfl_table.py run          # until dmpfl_plus_seed0 and fedavg_seed0 are recorded
    OMP_NUM_THREADS=1 python papers/dmpfl/dmpfl_shift_why.py --seed 0 --data-root data/cifar10
    DMPFL_TABLE_ROUNDS=100 DMPFL_TABLE_METHODS=dmpfl_plus,fedavg,fedavg_ft python papers/dmpfl/dmpfl_table.py run
    OMP_NUM_THREADS=1 python papers/dmpfl/dmpfl_shift_why.py --seed 0 --rounds 100 --data-root data/cifar10

Records: ``papers/dmpfl/records/dmpfl_shift_why/seed<s>.{txt,json}`` (30 rounds), ``seed<s>_r<rounds>.{txt,json}`` (others).
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
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]  # the repository (papers/<paper>/<script>)
sys.path.insert(0, str(ROOT))

from pl_fedsparse.callbacks import AdaptiveInference  # noqa: E402
from pl_fedsparse.cli import FedCLI  # noqa: E402
from pl_fedsparse.functional.inference import adaptive_choice, entropy  # noqa: E402

RECORD = ROOT / "papers" / "dmpfl" / "records" / "dmpfl_shift_why"
VIEWS = ("clean", "shift100")


def restore(run_dir: Path, data_root: str | None, tmp: str) -> Any:
    """The run's loop and model, set up from its config.yaml and restored from its last checkpoint."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if not ckpt.exists():
        raise SystemExit(f"error: --seed's run {run_dir} has no checkpoints/last.ckpt: expected a finished run of "
                         "`python papers/dmpfl/dmpfl_table.py run` (its run directories are not kept in git)")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config.pop("ckpt_path", None)  # a fit's subcommand argument, not part of the federation's configuration
    (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(config))
    argv = ["--config", str(Path(tmp) / "config.yaml"), "--trainer.logger", "false", "--trainer.enable_progress_bar",
            "false", "--trainer.default_root_dir", tmp, "--trainer.checkpoint_every", "0"]
    if data_root:
        argv += ["--data.root", data_root]
    with contextlib.redirect_stdout(io.StringIO()):
        cli = FedCLI(args=argv, run=False)
    loop = cli.trainer
    loop.setup(cli.model, cli.datamodule, str(ckpt), stage="test")
    return loop


def evaluate(loop: Any) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """One evaluation; per view of :data:`VIEWS` and client: personal logits, global logits, labels."""
    seen: dict[str, dict[int, Any]] = {v: {} for v in VIEWS}
    real = loop.evaluator._summarize

    def capture(k: int, views: Any, outputs: Any, labels: Any) -> Any:
        for v in VIEWS:
            seen[v][k] = (outputs[v]["personal"], outputs[v]["global"], labels[v])
        return real(k, views, outputs, labels)

    loop.evaluator._summarize = capture
    try:
        loop.evaluate("test")
    finally:
        loop.evaluator._summarize = real
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-root", default=None)
    p.add_argument("--rounds", type=int, default=30, help="the horizon of dmpfl_table.py's plan (30 or 100)")
    a = p.parse_args()
    logging.disable(logging.WARNING)
    suffix = "" if a.rounds == 30 else f"_r{a.rounds}"
    runs_dir = ROOT / "benchmarks" / "_runs" / f"dmpfl_table{suffix}"
    table_dir = ROOT / "papers" / "dmpfl" / "records" / f"dmpfl_table{suffix}"
    for name in (f"dmpfl_plus_seed{a.seed}", f"fedavg_seed{a.seed}"):
        if not (table_dir / name / "summary.json").exists():
            raise SystemExit(f"error: --seed {a.seed} --rounds {a.rounds}: {table_dir / name} is not recorded; "
                             f"expected a finished run of papers/dmpfl/dmpfl_table.py at {a.rounds} rounds")
    run_dir = runs_dir / f"dmpfl_plus_seed{a.seed}"
    recorded = json.loads((table_dir / f"dmpfl_plus_seed{a.seed}" / "summary.json").read_text())["final"]
    fedavg = json.loads((table_dir / f"fedavg_seed{a.seed}" / "summary.json").read_text())["final"]
    rows: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        loop = restore(run_dir, a.data_root, tmp)
        ai = next(cb for cb in loop.fed_callbacks if isinstance(cb, AdaptiveInference))
        for name, change in (("as run", {}), ("base entropies on clean test data", {"base_split": "eval"}),
                             ("cosine of logits", {"cosine_on": "logits"})):
            before = {k: getattr(ai, k) for k in change}
            for k, v in change.items():
                setattr(ai, k, v)
            seen = evaluate(loop)
            be = list(ai.base_entropies.values())
            for k, v in before.items():
                setattr(ai, k, v)
            row: dict[str, float] = {"BE_personal": statistics.fmean(b[0] for b in be),
                                     "BE_global": statistics.fmean(b[1] for b in be)}
            for view in VIEWS:
                accs, chose, ent_c, ent_g = [], [], [], []
                for k, (pl, gl, y) in seen[view].items():
                    if not len(y):
                        continue
                    ent_c.append(float(entropy(pl).mean()))
                    ent_g.append(float(entropy(gl).mean()))
                    bp, bg = ai.base_entropies[k]
                    pick = adaptive_choice(pl, gl, bp, bg, cosine_on=ai.cosine_on if not change.get("cosine_on")
                                           else change["cosine_on"])
                    pred = torch.where(pick, pl.argmax(1), gl.argmax(1))
                    accs.append(float((pred == y).float().mean()))
                    chose.append(float(pick.float().mean()))
                row[f"{view}/acc"] = statistics.fmean(accs)
                row[f"{view}/chose_personal"] = statistics.fmean(chose)
                row[f"{view}/E_personal"] = statistics.fmean(ent_c)
                row[f"{view}/E_global"] = statistics.fmean(ent_g)
            rows[name] = row
            if name == "as run":  # the rule re-applied here is the run's: same number as its record
                for view, key in (("clean", "acc_mean"), ("shift100", "shift100/acc_mean")):
                    if abs(row[f"{view}/acc"] - recorded[key]) > 1e-6:  # (the mean taken in another order)
                        raise SystemExit(f"the restored run gives {row[f'{view}/acc']:.6f} at {view}, its record "
                                         f"{recorded[key]:.6f}: not the same federation")
        for name, rule in (("global model only", "global"), ("oracle", "oracle")):
            row = {}
            for view in VIEWS:
                accs = []
                for _, (pl, gl, y) in seen[view].items():
                    if not len(y):
                        continue
                    right_g = gl.argmax(1) == y
                    right = right_g if rule == "global" else (right_g | (pl.argmax(1) == y))
                    accs.append(float(right.float().mean()))
                row[f"{view}/acc"] = statistics.fmean(accs)
                row[f"{view}/chose_personal"] = float("nan")
            rows[name] = row
        loop.reporter.release()
    rows["FedAvg (dense global model, its own run)"] = {"clean/acc": fedavg["acc_mean"],
                                                        "shift100/acc": fedavg["shift100/acc_mean"],
                                                        "clean/chose_personal": float("nan"),
                                                        "shift100/chose_personal": float("nan")}
    out = io.StringIO()

    def emit(line: str = "") -> None:  # the report goes to stdout and to the .txt record
        print(line)
        out.write(line + "\n")

    emit(f"DM-PFL+ seed {a.seed}, {a.rounds} rounds, restored from {run_dir.name}/checkpoints/last.ckpt; "
         f"entropy of a uniform 10-class output: {float(entropy(torch.zeros(1, 10))[0]):.3f}")
    emit("Accuracy % and the share of samples given to the personal model: means over clients. BE: mean base "
         "entropies (nats) the rule subtracts.")
    emit("| variant | 100 % shift | 0 % shift | personal share @100 % | personal share @0 % | BE(θ_c) | BE(θ_g) |")
    emit("|---|---|---|---|---|---|---|")

    def pct(x: float) -> str:
        return "-" if x != x else f"{100 * x:.2f}"

    for name, row in rows.items():
        emit(f"| {name} | {pct(row['shift100/acc'])} | {pct(row['clean/acc'])} | "
             f"{pct(row['shift100/chose_personal'])} | {pct(row['clean/chose_personal'])} | "
             f"{row.get('BE_personal', float('nan')):.3f} | {row.get('BE_global', float('nan')):.3f} |")
    run = rows["as run"]
    emit("\nMean output entropy (nats) of each model, mean over clients:")
    emit("| model | 0 % shift | 100 % shift |")
    emit("|---|---|---|")
    for label, key in (("personal θ_c", "E_personal"), ("global θ_g", "E_global")):
        emit(f"| {label} | {run[f'clean/{key}']:.3f} | {run[f'shift100/{key}']:.3f} |")
    RECORD.mkdir(parents=True, exist_ok=True)
    (RECORD / f"seed{a.seed}{suffix}.json").write_text(json.dumps(rows, indent=1))
    (RECORD / f"seed{a.seed}{suffix}.txt").write_text(out.getvalue())


if __name__ == "__main__":
    main()
