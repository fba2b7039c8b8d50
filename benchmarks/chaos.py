"""Chaos: kill a seeded run with SIGKILL at random moments, resume it each time, compare with an uninterrupted run.

    OMP_NUM_THREADS=1 python benchmarks/chaos.py --trials 5 --kills 4 --seed 0

For every trial: start ``pl-fed fit`` into a fresh run directory, SIGKILL it after a random delay, and continue the
run as a user would — the README's resume command when ``checkpoints/last.ckpt`` exists, else a plain rerun of the
same command — killing it again until ``--kills`` kills have landed, then let it finish. The final
``metrics.jsonl`` (every key but wall times) must equal the uninterrupted run's. One kill in three waits for a checkpoint
or run file being written (a ``.tmp`` file in the run) and kills right then; kills that find such a file are
counted separately. Prints one line per trial and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

CONFIG = "configs/synthetic_fedavg_ft.yaml"
ARGS = ["--trainer.num_rounds", "8", "--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.logger", "true"]
TIME_KEYS = ("time_s", "time_train_s", "time_cum_s")


def _cmd(run: Path, resume: bool) -> list[str]:
    base = [sys.executable, "-m", "pl_fedsparse.cli", "fit"]
    if resume:
        return base + ["--config", str(run / "config.yaml"), "--trainer.default_root_dir", str(run),
                       "--ckpt_path", str(run / "checkpoints" / "last.ckpt")]
    return base + ["--config", CONFIG, *ARGS, "--trainer.default_root_dir", str(run)]


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in rows]


def _tmp_files(run: Path) -> bool:
    for d in (run, run / "checkpoints"):
        try:
            if any(name.endswith(".tmp") for name in os.listdir(d)):
                return True
        except OSError:
            pass
    return False


def _kill(proc: subprocess.Popen, run: Path, delay: float, at_write: bool) -> bool:
    """SIGKILL ``proc`` after ``delay`` s, or (``at_write``) as soon as a ``.tmp`` file appears in the run; False
    when the process ended first."""
    deadline = time.perf_counter() + (4 * delay if at_write else delay)
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            return False
        if at_write and _tmp_files(run):
            break
        time.sleep(0.0005 if at_write else 0.01)
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--kills", type=int, default=4, help="SIGKILLs per trial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/_runs/chaos")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    ref = out / "reference"
    t = time.perf_counter()
    subprocess.run(_cmd(ref, resume=False), env=env, check=True, capture_output=True)
    duration = time.perf_counter() - t
    expected = _rows(ref)
    print(f"reference run: {len(expected)} rows in {duration:.1f} s")

    identical = kills_total = during_write = restarts_plain = 0
    for trial in range(args.trials):
        run = out / f"trial{trial}"
        kills = 0
        while True:
            resume = (run / "checkpoints" / "last.ckpt").exists()
            restarts_plain += int(not resume and kills > 0)
            proc = subprocess.Popen(_cmd(run, resume), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if kills < args.kills:
                # a random moment, or (one kill in three) the moment a checkpoint or run file is being written
                if _kill(proc, run, rng.uniform(0.2, duration), at_write=rng.random() < 1 / 3):
                    kills += 1
                    during_write += int(_tmp_files(run))
                    continue
            else:
                proc.wait()
            err = proc.stderr.read().decode() if proc.stderr else ""
            if proc.returncode != 0:
                print(f"trial {trial}: exit {proc.returncode} after {kills} kills: {err.strip()[-300:]}")
                break
            if (run / "summary.json").exists() and len(_rows(run)) == len(expected):
                break
        kills_total += kills
        same = (run / "metrics.jsonl").exists() and _rows(run) == expected
        identical += int(same)
        print(f"trial {trial}: {kills} kills, {'identical' if same else 'DIFFERENT'} to the uninterrupted run")
    print(f"summary: {args.trials} trials, {kills_total} SIGKILLs ({during_write} during a checkpoint write, "
          f"{restarts_plain} restarts without a checkpoint), {identical}/{args.trials} runs identical")
    return 0 if identical == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
