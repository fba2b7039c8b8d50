"""The suite leaves nothing in the system's temporary folder: its doctests write their scratch files (made with
``tempfile.mkdtemp``, as a reader would) under pytest's own temporary directory (the repository's ``conftest.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_doctests_leave_no_files_in_the_system_temporary_folder(tmp_path: Path) -> None:
    system_tmp, base = tmp_path / "system-tmp", tmp_path / "pytest-base"
    system_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(system_tmp), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={base}",
                           "pl_fedsparse", "callbacks"], check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    left = sorted(str(p.relative_to(system_tmp)) for p in system_tmp.rglob("*") if p.is_file())
    assert left == [], f"the doctests left files in the system's temporary folder: {left}"
    assert list(base.rglob("doctest*"))  # the doctests ran, and wrote under pytest's own folder
