"""``pl-fed sweep``: a grid run two at a time, ending with the report; a bad entry is one line before anything runs;
a sweep killed midway and started again with the same command ends with every run identical to an uninterrupted
sweep's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import one_line, run_main

REPO = Path(__file__).resolve().parents[1]
GRID = ["--config", "quickstart", "--config", "synthetic_fedavg", "--seeds", "0", "1", "2", "--set",
        "trainer.num_rounds=3", "--set", "data.num_clients=6", "--parallel", "2"]
NAMES = [f"{c}-seed{s}" for c in ("quickstart", "synthetic_fedavg") for s in (0, 1, 2)]


def _rows(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def _sweep(out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", "sweep", *GRID, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_the_uninterrupted_sweeps_runs(tmp_path: Path) -> None:
    whole = _sweep(tmp_path / "whole")
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    assert "sweep: 6 runs (0 already done), 2 at a time" in out
    assert "Across seeds" in out and (tmp_path / "whole" / "report" / "report.md").is_file()
    # the same sweep, killed (SIGKILL) once a run has finished and others are under way, then started again
    cut = tmp_path / "cut"
    p = _sweep(cut)
    t = time.time()
    while not any((cut / n / "summary.json").is_file() for n in NAMES) and time.time() - t < 300:
        time.sleep(0.1)
    time.sleep(1.0)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    done = [n for n in NAMES if (cut / n / "summary.json").is_file()]
    assert 0 < len(done) < len(NAMES), done
    t = time.time()  # its runs stop too (each checkpoints on the SIGTERM it gets when the sweep dies)
    while any((cut / n / ".lock").exists() and _locked(cut / n) for n in NAMES) and time.time() - t < 120:
        time.sleep(0.2)
    again = _sweep(cut)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert f"({len(done)} already done)" in out
    for n in NAMES:
        assert _rows(cut / n) == _rows(tmp_path / "whole" / n), n


def _locked(run: Path) -> bool:
    import fcntl

    try:
        fd = os.open(run / ".lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad, expected", [
    (["--config", "no_such_config"], "sweep entry no_such_config-seed0: config"),
    (["--config", "quickstart", "--set", "trainer.num_rounds=0"], "sweep entry quickstart-seed0: trainer.num_rounds"),
    (["--config", "quickstart", "--vary", "trainer.nonsense=1,2"], "sweep entry quickstart-nonsense1-seed0:"),
    (["--config", "quickstart", "--seeds", "1", "1"], "--seeds=[1, 1] is invalid: expected distinct seeds"),
    (["--config", "quickstart", "--set", "num_rounds"], "--set='num_rounds' is invalid: expected KEY=VALUE"),
], ids=["config", "value", "key", "seeds", "assignment"])
def test_a_bad_grid_entry_is_one_line_and_nothing_runs(tmp_path: Path, bad: list[str], expected: str,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    code, _, err = run_main(["sweep", *bad, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert expected in one_line(err)
    assert not (tmp_path / "out").exists()
