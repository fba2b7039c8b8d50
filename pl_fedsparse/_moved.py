"""Old module paths that still work: ``from pl_fedsparse.report import load_run``, ``import pl_fedsparse.rundir``,
a config naming ``pl_fedsparse.vectorized.VectorizedExecutor``.

Modules that moved into a folder (the run directory's modules into :mod:`pl_fedsparse.run`, the executors into
:mod:`pl_fedsparse.executors`) are reachable under their old names through one import hook instead of a file each:
the old name is a module object that forwards every attribute to the new modules, in order. New code imports the
new paths; the forwarding is for users' scripts, notebooks and configs. (A test that monkeypatches a module's
global must patch the new module: the old name only forwards reads.)

Also here, :func:`lazy_exports`: the package's and ``pl_fedsparse.cli``'s public names, imported on first use.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

__all__ = ["MOVED", "lazy_exports"]

#: old module path -> the modules its names now live in (looked up in this order)
MOVED: dict[str, tuple[str, ...]] = {
    "pl_fedsparse.rundir": ("pl_fedsparse.run.directory", "pl_fedsparse.run.config_diff", "pl_fedsparse.run.names"),
    "pl_fedsparse.checkpoint": ("pl_fedsparse.run.checkpoint", "pl_fedsparse.run.atomic"),
    "pl_fedsparse.reporting": ("pl_fedsparse.run.writer",),
    "pl_fedsparse.report": ("pl_fedsparse.run.report", "pl_fedsparse.run.runs", "pl_fedsparse.run.stats",
                            "pl_fedsparse.run.figures"),
    "pl_fedsparse.execution": ("pl_fedsparse.executors.base", "pl_fedsparse.executors.in_process"),
    "pl_fedsparse.vectorized": ("pl_fedsparse.executors.vectorized",),
}


class _Forwarding(types.ModuleType):
    """An old module path: every attribute read from the new modules."""

    _targets: Sequence[types.ModuleType]

    def __getattr__(self, name: str) -> Any:
        for target in self._targets:
            if hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (it moved: see "
                             f"{', '.join(t.__name__ for t in self._targets)})")

    def __dir__(self) -> list[str]:
        return sorted({n for t in self._targets for n in dir(t)})


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Forwarding(spec.name, f"Moved: see {', '.join(MOVED[spec.name])}.")
        module._targets = [importlib.import_module(t) for t in MOVED[spec.name]]
        module.__all__ = [n for t in module._targets for n in getattr(t, "__all__", ())]  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def lazy_exports(package: str, public: dict[str, str], submodules: bool = False) -> Any:
    """A package's ``__getattr__`` (PEP 562) that imports each public name from its module on first use.

    Args:
        package: the package's ``__name__``.
        public: each public name -> the module that defines it.
        submodules: also import ``package.<name>`` (a subpackage or module, e.g. ``pl_fedsparse.callbacks``) when
            ``<name>`` is read and is not public.

    Returns:
        The ``__getattr__`` function; it stores each value it imported in the package (read once).
    """
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in public:
            value = getattr(importlib.import_module(public[name]), name)
        elif submodules and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    return __getattr__


def install() -> None:
    """Put the hook on ``sys.meta_path`` once (after the file-system finders: a real file always wins)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
