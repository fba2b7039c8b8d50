"""Progress you can follow from a log: with output that is not a terminal (``> log 2>&1``, nohup, SLURM), ``pl-fed
fit`` prints a line per round on stdout while it runs; with ``--trainer.enable_progress_bar false`` it prints none."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_CLI

REPO = Path(__file__).resolve().parents[1]

HOLD = '''
import os, time
from pl_fedsparse import FederatedCallback

class Hold(FederatedCallback):
    def on_round_start(self, loop, round_idx):
        if round_idx == 1:
            t = time.time()
            while not os.path.exists(os.environ["GO_FILE"]) and time.time() - t < 120:
                time.sleep(0.05)
'''


def _args(run: Path, *extra: str) -> list[str]:
    cli = list(TINY_CLI)
    i = cli.index("--trainer.enable_progress_bar")
    del cli[i:i + 2]  # left to decide: not a terminal here
    return [sys.executable, "-m", "pl_fedsparse.cli", "fit", *cli, "--trainer.num_rounds", "3",
            "--trainer.default_root_dir", str(run), *extra]


@pytest.mark.slow
def test_a_line_per_round_appears_in_the_log_while_the_run_runs(tmp_path: Path) -> None:
    (tmp_path / "holdcb.py").write_text(HOLD)
    go, log = tmp_path / "go", tmp_path / "log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GO_FILE": str(go),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONUNBUFFERED", None)  # a log file is block-buffered: the lines must be flushed as they come
    with log.open("w") as out:
        p = subprocess.Popen(_args(tmp_path / "run", "--trainer.callbacks+", "holdcb.Hold"), stdout=out,
                             stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            t = time.time()
            while "round 1/3" not in log.read_text() and time.time() - t < 120 and p.poll() is None:
                time.sleep(0.05)
            assert p.poll() is None, log.read_text()  # still running (held in round 1): the line came before the end
            first = log.read_text()
            assert re.search(r"^round 1/3: [\d.]+ s, acc_mean 0\.\d{4}, elapsed [\d.]+ s, ETA \d+ s$", first, re.M), first
        finally:
            go.write_text("")
            assert p.wait(timeout=120) == 0, log.read_text()
    text = log.read_text()
    assert re.search(r"^round 3/3: .* done$", text, re.M), text
    assert text.index("round 3/3") < text.index("final results")


@pytest.mark.slow
def test_no_lines_when_progress_is_off(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([*_args(tmp_path / "run"), "--trainer.enable_progress_bar", "false"], capture_output=True,
                       text=True, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr
    assert "round 1/3" not in p.stdout + p.stderr
