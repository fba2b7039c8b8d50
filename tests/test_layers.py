"""The package's layers, checked on its source: no import cycle longer than two files, and every import points down.

The import graph is built from the source with :mod:`ast`. Every import counts — at module level, under
``if TYPE_CHECKING:``, inside a function — since each is a dependency a reader has to follow (a type-only import
is a dependency of the code's meaning, and a function-local one of its behaviour). ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module of the package, else to ``pkg``; importing a module does not count as
importing its parent packages (their ``__init__`` runs, but no name of theirs is used).

The layers, from the bottom (``docs/design-notes.md``, "Layers")::

    base        pl_fedsparse.errors, pl_fedsparse.resources: one-line errors and memory checks; import nothing
    functional  pl_fedsparse.functional.*: pure tensor maths; imports only base
    models      pl_fedsparse.models.*: imports only functional and base
    data        pl_fedsparse.data.*: imports only functional and base
    engine      every other module: the loop and its parts (executors, evaluation, reporting, checkpoint, contract,
                policies, the run directory, ...), the read-only federation view (pl_fedsparse.view) and the
                callback base class the loop calls (pl_fedsparse.callbacks.base); imports the layers below, never
                a callback or the top; no part imports the loop (pl_fedsparse.loop): each receives the view
    callbacks   pl_fedsparse.callbacks and pl_fedsparse.callbacks.* but .base: the methods; import the layers below
                except the loop (they receive the view), never the top
    top         the package's __init__ (and ._moved, its old module paths), pl_fedsparse.cli.*, .sweep, .shipped,
                ._docgen, .testing, and pl-fed report's pl_fedsparse.run.{runs,stats,report,figures}: the command
                line, the run reports and helpers for users' tests; only they import the loop, and nothing outside
                the CLI imports it

Two-file cycles are tolerated (e.g. a dataclass and the store that holds it, the view and the callback base class
whose hooks it types); a strongly connected component of more than two files fails, naming its imports (file:line).
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "pl_fedsparse"
ROOT = Path(__file__).resolve().parents[1]

BASE = frozenset({"pl_fedsparse.errors", "pl_fedsparse.resources"})
TOP = frozenset({"pl_fedsparse", "pl_fedsparse._moved", "pl_fedsparse.sweep", "pl_fedsparse.shipped",
                 "pl_fedsparse._docgen", "pl_fedsparse.testing",
                 # pl-fed report: runs read back, grouped, compared, tabulated and drawn
                 "pl_fedsparse.run.runs", "pl_fedsparse.run.stats", "pl_fedsparse.run.report",
                 "pl_fedsparse.run.figures"})
LOOP = "pl_fedsparse.loop"
CLI = "pl_fedsparse.cli"
CALLBACK_BASE = "pl_fedsparse.callbacks.base"


@dataclass(frozen=True)
class Import:
    """One import of a module of the package: who imports what, where."""

    source: str
    target: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.target}"


def module_files(root: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root`` by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: Iterable[str]) -> set[str]:
    known = set(modules)
    names: list[str] = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:  # ``import pkg.mod.attr`` or an attribute of a module: its module
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    return out


def import_graph(root: Path, package: str = PACKAGE) -> list[Import]:
    """Every import between modules of ``package`` (module level, ``TYPE_CHECKING`` and function-local alike)."""
    files = module_files(root, package)
    edges = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, path.name == "__init__.py", files):
                    if target != module:
                        edges.append(Import(module, target, path.relative_to(root).as_posix(), node.lineno))
    return edges


def large_cycles(edges: list[Import], limit: int = 2) -> list[str]:
    """One message per strongly connected component of more than ``limit`` modules, naming its imports."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        graph.setdefault(e.source, set()).add(e.target)
        graph.setdefault(e.target, set())

    def reach(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reachable = {m: reach(m) for m in graph}
    done: set[str] = set()
    out = []
    for m in sorted(graph):
        if m in done:
            continue
        component = {n for n in reachable[m] if m in reachable[n]}
        done |= component
        if len(component) > limit:
            inside = sorted(str(e) for e in edges if e.source in component and e.target in component)
            out.append(f"an import cycle through {len(component)} modules ({', '.join(sorted(component))}):\n    "
                       + "\n    ".join(inside))
    return out


def _in_cli(module: str) -> bool:
    """The CLI package (``pl_fedsparse.cli`` and its modules)."""
    return module == CLI or module.startswith(CLI + ".")


def layer(module: str) -> str:
    """The layer of a module (see the module docstring)."""
    if module in BASE:
        return "base"
    if module in TOP or _in_cli(module):
        return "top"
    for name in ("functional", "models", "data"):
        if module == f"{PACKAGE}.{name}" or module.startswith(f"{PACKAGE}.{name}."):
            return name
    if module != CALLBACK_BASE and (module == f"{PACKAGE}.callbacks" or module.startswith(f"{PACKAGE}.callbacks.")):
        return "callbacks"
    return "engine"


#: the layers each layer may import (its own included)
ALLOWED = {
    "base": {"base"},
    "functional": {"functional", "base"},
    "models": {"models", "functional", "base"},
    "data": {"data", "functional", "base"},
    "engine": {"engine", "data", "models", "functional", "base"},
    "callbacks": {"callbacks", "engine", "data", "models", "functional", "base"},
    "top": {"top", "callbacks", "engine", "data", "models", "functional", "base"},
}


def layer_violations(edges: list[Import]) -> list[str]:
    """One message per import that breaks the layer contract."""
    out = []
    for e in edges:
        src, dst = layer(e.source), layer(e.target)
        if dst not in ALLOWED[src]:
            out.append(f"{e} ({src} may import only {', '.join(sorted(ALLOWED[src]))}; {e.target} is {dst})")
        elif e.target == LOOP and src != "top":
            out.append(f"{e} (no part imports the loop: annotate with pl_fedsparse.view.FederationView)")
        elif _in_cli(e.target) and not _in_cli(e.source):
            out.append(f"{e} (nothing imports the CLI)")
    return out


# ------------------------------------------------------------------------------------------------ the package
@functools.cache
def package_graph() -> list[Import]:
    return import_graph(ROOT)


def test_no_import_cycle_longer_than_two_files() -> None:
    problems = large_cycles(package_graph())
    assert not problems, "\n".join(problems)


def test_every_import_points_down_the_layers() -> None:
    problems = layer_violations(package_graph())
    assert not problems, "imports against the layers (tests/test_layers.py's docstring):\n" + "\n".join(problems)


def test_the_graph_sees_every_kind_of_import() -> None:
    """The known imports of each kind are in the graph (a parser that skipped one kind would pass vacuously)."""
    edges = {(e.source, e.target) for e in package_graph()}
    assert ("pl_fedsparse.loop", "pl_fedsparse.evaluation") in edges  # module level
    assert ("pl_fedsparse.evaluation", "pl_fedsparse.view") in edges  # module level, and under TYPE_CHECKING
    assert ("pl_fedsparse.view", "pl_fedsparse.callbacks.base") in edges  # under TYPE_CHECKING only
    assert ("pl_fedsparse.protocol", "pl_fedsparse.data") in edges  # inside a function
    assert ("pl_fedsparse.loop", "pl_fedsparse.policies") in edges  # ``from pl_fedsparse import policies``
    assert ("pl_fedsparse.data.datamodule", "pl_fedsparse.data.corruptions") in edges  # relative or absolute


def test_the_loop_satisfies_the_federation_view(tmp_path: Path) -> None:
    """Every member of :class:`~pl_fedsparse.view.FederationView` exists on a loop (attributes on an instance,
    properties and methods on the class), and its methods take the view's parameters."""
    from conftest import tiny_loop

    from pl_fedsparse.loop import FederatedLoop
    from pl_fedsparse.view import FederationView

    loop = tiny_loop(tmp_path)
    members = [n for n in vars(FederationView) if not n.startswith("_")]
    assert len(members) > 40
    missing = [n for n in members if n not in vars(loop) and not hasattr(FederatedLoop, n)]
    assert not missing, f"FederatedLoop lacks FederationView members {missing}"
    for name in members:
        declared = vars(FederationView)[name]
        if inspect.isfunction(declared):
            theirs = list(inspect.signature(declared).parameters)
            ours = list(inspect.signature(getattr(FederatedLoop, name)).parameters)
            assert ours == theirs, f"FederatedLoop.{name}{ours} vs FederationView.{name}{theirs}"


# ------------------------------------------------------------------------------------------------ the checks
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def fake_package(tmp_path: Path) -> Path:
    """A package laid out like pl_fedsparse whose imports keep the rules."""
    _write(tmp_path, {
        "pl_fedsparse/__init__.py": "from pl_fedsparse.loop import FederatedLoop\n",
        "pl_fedsparse/errors.py": "",
        "pl_fedsparse/functional/__init__.py": "from .masks import topk\n",
        "pl_fedsparse/functional/masks.py": "from pl_fedsparse.errors import check\n",
        "pl_fedsparse/view.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from pl_fedsparse.callbacks.base import FederatedCallback\n",
        "pl_fedsparse/callbacks/__init__.py": "from pl_fedsparse.callbacks.base import FederatedCallback\n",
        "pl_fedsparse/callbacks/base.py": "from pl_fedsparse.view import FederationView\n",
        "pl_fedsparse/evaluation.py": "from pl_fedsparse.view import FederationView\n",
        "pl_fedsparse/loop.py": "from pl_fedsparse import evaluation\nfrom pl_fedsparse.functional import masks\n",
        "pl_fedsparse/cli.py": "from pl_fedsparse.loop import FederatedLoop\n",
    })
    return tmp_path


def test_a_clean_fake_package_passes(fake_package: Path) -> None:
    edges = import_graph(fake_package)
    assert ("pl_fedsparse.loop", "pl_fedsparse.functional.masks") in {(e.source, e.target) for e in edges}
    assert large_cycles(edges) == [] and layer_violations(edges) == []


def test_an_upward_import_is_named_with_its_file_and_line(fake_package: Path) -> None:
    _write(fake_package, {"pl_fedsparse/functional/masks.py": "import torch\n\n\ndef f():\n"
                                                              "    from pl_fedsparse.loop import FederatedLoop\n"})
    problems = layer_violations(import_graph(fake_package))
    assert len(problems) == 1 and problems[0].startswith(
        "pl_fedsparse/functional/masks.py:5 imports pl_fedsparse.loop (functional may import only base, functional")


def test_a_part_importing_the_loop_under_type_checking_fails(fake_package: Path) -> None:
    _write(fake_package, {"pl_fedsparse/evaluation.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                        "    from pl_fedsparse.loop import FederatedLoop\n"})
    edges = import_graph(fake_package)
    assert layer_violations(edges) == [("pl_fedsparse/evaluation.py:3 imports pl_fedsparse.loop (no part imports "
                                        "the loop: annotate with pl_fedsparse.view.FederationView)")]


def test_a_three_file_cycle_fails_and_a_two_file_one_does_not(fake_package: Path) -> None:
    assert large_cycles(import_graph(fake_package)) == []  # view ↔ callbacks.base: two files
    _write(fake_package, {"pl_fedsparse/callbacks/base.py": "from pl_fedsparse.view import FederationView\n"
                                                            "from pl_fedsparse import evaluation\n",
                          "pl_fedsparse/evaluation.py": "from .callbacks.base import FederatedCallback\n"
                                                        "from pl_fedsparse.view import FederationView\n"})
    problems = large_cycles(import_graph(fake_package))
    assert len(problems) == 1
    assert problems[0].startswith("an import cycle through 3 modules (pl_fedsparse.callbacks.base, "
                                  "pl_fedsparse.evaluation, pl_fedsparse.view)")
    assert "pl_fedsparse/evaluation.py:1 imports pl_fedsparse.callbacks.base" in problems[0]


def test_nothing_imports_the_cli(fake_package: Path) -> None:
    _write(fake_package, {"pl_fedsparse/sweep.py": "import pl_fedsparse.cli as cli\n"})
    assert layer_violations(import_graph(fake_package)) == [
        "pl_fedsparse/sweep.py:1 imports pl_fedsparse.cli (nothing imports the CLI)"]
