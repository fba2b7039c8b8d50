"""A local Ray instance the engine starts prints no notice of its own: not Ray's token-authentication notice (the
instance keeps token authentication on; ``RayExecutor`` leaves that one record out), and no error-looking line but the
one Ray's C++ core worker prints for every actor restartable from an object in the store, which has no switch of its
own and is explained in docs/scaling.md ("How do I run a round's fits in parallel on Ray?")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_CLI

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
#: a line of Ray's C++ logger at level E (error) or F (fatal): ``[2026-01-01 10:00:00,000 E 123 123] file.cc:1: ...``
RAY_ERROR_LINE = re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+ [EF] \d+ \d+\] ")
#: the one such line a local run prints, explained in docs/scaling.md
EXPLAINED = "has constructor arguments in the object store and max_restarts > 0"


@pytest.mark.slow
def test_a_local_ray_run_prints_no_token_notice_and_no_unexplained_error_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # Ray's default: the notice's case
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", "fit", *TINY_CLI, "--trainer.num_rounds", "1",
                          "--trainer.executor", "pl_fedsparse.executors.RayExecutor",
                          "--trainer.executor.num_workers", "1", "--trainer.default_root_dir", str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=300, check=False)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert not [x for x in lines if "Token authentication" in x or "RAY_AUTH_MODE" in x], res.stderr
    assert [x for x in lines if RAY_ERROR_LINE.match(x) and EXPLAINED not in x] == [], res.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
