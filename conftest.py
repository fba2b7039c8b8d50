"""Repository-wide pytest set-up: the doctests in ``pl_fedsparse/`` and ``callbacks/`` write their files under the
test's own temporary folder, never beside it in the system's.

The docstring examples make their scratch files with :func:`tempfile.mkdtemp` (what a reader would type) and do not
remove them; run from the suite, every run would leave a folder in ``/tmp``. Here :data:`tempfile.tempdir` points at
a folder of pytest's own base temporary directory for the length of each doctest, which pytest prunes (it keeps the
last three runs' folders).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctest_scratch_in_pytest_tmp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                                   monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point :func:`tempfile.mkdtemp` at a per-doctest folder under pytest's base temporary directory."""
    if isinstance(request.node, DoctestItem):
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("doctest")))
    yield
