"""Classes in the working directory (``class_path: callbacks.my_method.MyMethod`` from the project root), without
putting the working directory on ``sys.path``: for the duration of :func:`~pl_fedsparse.cli.main`, a finder at the
*end* of ``sys.meta_path`` resolves a top-level module or package from the working directory only when no installed
one of that name exists; its submodules then import normally. Installed packages always win, and nothing changes
outside :func:`~pl_fedsparse.cli.main`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType


# ---------------------------------------------------------------------------------------------- working directory
class _WorkingDirFinder(importlib.abc.MetaPathFinder):
    """Finds top-level modules and packages in ``directory`` (appended to ``sys.meta_path``: consulted only for
    names no other finder resolves)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if path is not None or "." in fullname:  # submodules are found through their package's __path__
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, [self.directory])


@contextmanager
def _working_dir_importable(directory: str) -> Iterator[None]:
    """Make ``directory``'s top-level modules importable (after every installed one) while the block runs."""
    finder = _WorkingDirFinder(directory)
    importlib.invalidate_caches()  # files written just before (a new callbacks/ folder) must be seen
    sys.meta_path.append(finder)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
