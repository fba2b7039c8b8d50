"""The repository passes its linter's named rule set (``[tool.ruff.lint]`` in ``pyproject.toml``: pyflakes and
pycodestyle's errors — an unused or undefined name, a star import, a bare ``except``, a statement after ``;``), and
the package its type checker (``[tool.mypy]``): it ships ``py.typed``, so its annotations are what a user's own
type checker reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_repository_passes_ruff() -> None:
    pytest.importorskip("ruff")  # (installed with the [test] and [dev] extras)
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          check=False, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


@pytest.mark.slow  # (about 20 s without a cache)
def test_the_package_passes_mypy(tmp_path: Path) -> None:
    pytest.importorskip("mypy")  # (installed with the [test] and [dev] extras)
    assert (ROOT / "pl_fedsparse" / "py.typed").is_file()
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), "--no-pretty"],
                          check=False, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
