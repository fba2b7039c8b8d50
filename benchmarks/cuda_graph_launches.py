"""Kernel launches per training step as CUDA graphs would make them, counted on the CPU.

A launch-bound step (pFedGate's: 3.1 % of an H200 round in kernels) costs its number of kernel launches. With
``trainer.compile: {mode: reduce-overhead}`` each compiled graph — the forward's and the backward's, AOTAutograd's
pieces between graph breaks — is replayed as one launch; what runs outside the graphs (the optimizer's step, the
copies the fits keep of a step, a callback's eager statistics) still launches kernel by kernel. This script runs a
config twice on the CPU under ``torch.profiler``: uncompiled, and compiled by AOTAutograd with every graph (forward,
backward, inference) run inside a marked range, the engine treating it as CUDA graphs (so it makes the copies it makes
there; ``pl_fedsparse.executors.compiling.graph_outputs_reused``). Per training step it counts the leaf ATen operators
that launch a kernel (not views, allocations or metadata: as ``device_traffic.py`` counts them) outside the graphs,
and the graphs. What it predicts for a GPU: launches per step = graphs + operators outside them, against the
uncompiled step's operators; torch's optimizers take their multi-tensor path, as on CUDA by default. It does not
time anything; the GPU suite measures what the launches cost
(``compile_fit_pfedgate_cudagraphs.txt``). pFedGate runs its knapsack as on a GPU (tensor operations, no host
solve: ``pl_fedsparse.testing.device_paths``).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/cuda_graph_launches.py                  # every config
    OMP_NUM_THREADS=1 python benchmarks/cuda_graph_launches.py pfedgate_lenet   # one
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from device_traffic import _NO_KERNEL, CONFIGS  # noqa: E402  (the same configs and the same kernel rule)

from pl_fedsparse.executors import compiling  # noqa: E402
from pl_fedsparse.executors.runner import FitRunner  # noqa: E402
from pl_fedsparse.testing import device_paths  # noqa: E402

#: the profiler ranges: a compiled graph's run, and a training step
GRAPH, STEP = "counted_cuda_graph", "counted_training_step"
BACKEND = "pl_fedsparse_counted_graphs"


def _in_range(gm: Any, example_inputs: Any) -> Any:
    """AOTAutograd's compiler: the graph run as it is, inside the :data:`GRAPH` range."""
    from functorch.compile import make_boxed_func

    def run(*args: Any) -> Any:
        with record_function(GRAPH):
            return gm(*args)

    return make_boxed_func(run)


def counted_graphs(gm: Any, example_inputs: Any) -> Any:
    """The backend: AOTAutograd's forward, backward and inference graphs, each run inside the :data:`GRAPH` range."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_in_range, bw_compiler=_in_range, inference_compiler=_in_range)(gm,
                                                                                                   example_inputs)


torch._dynamo.register_backend(counted_graphs, name=BACKEND)
compiling.OUTPUT_REUSING_BACKENDS.add(BACKEND)  # the engine keeps copies as under CUDA graphs


@functools.cache
def _is_view(name: str) -> bool:
    op = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    try:
        return op is not None and any(getattr(op, o).is_view for o in op.overloads())
    except Exception:  # (an odd overload packet: taken for a kernel)
        return False


def _launches(event: Any) -> bool:
    """A leaf ATen operator that launches a kernel."""
    name = event.name
    if not name.startswith("aten::") or any(c.name.startswith("aten::") for c in event.cpu_children):
        return False
    return name.removeprefix("aten::") not in _NO_KERNEL and not _is_view(name)


def _count(events: Any, where: Counter[str] | None = None) -> tuple[int, int, int]:
    """(steps, graphs in steps, launching operators in steps outside graphs); ``where``, if given, gets the outside
    operators by the nearest range around them that is not an operator (a hook, the optimizer's step, the step)."""
    steps = graphs = ops = 0

    def launch(c: Any) -> None:
        nonlocal ops
        ops += 1
        if where is not None:
            p = c.cpu_parent
            while p is not None and p.name.startswith("aten::"):
                p = p.cpu_parent
            where[p.name if p is not None else "?"] += 1

    def walk(e: Any, in_graph: bool) -> None:
        nonlocal graphs
        for c in e.cpu_children:
            if _compiling(c.name):  # (the compilation's own tracing, in the first steps: not a launch)
                continue
            if c.name == GRAPH:
                graphs += 1
                walk(c, True)
            elif c.name.startswith("aten::_foreach_"):  # (one multi-tensor kernel on CUDA; a loop on the CPU)
                if not in_graph:
                    launch(c)
            else:
                if not in_graph and _launches(c):
                    launch(c)
                walk(c, in_graph)

    for e in events:
        if e.name == STEP and not any(p.name == STEP for p in _parents(e)):
            steps += 1
            walk(e, False)
    return steps, graphs, ops


def _compiling(name: str) -> bool:
    """A profiler range of the compilation itself (dynamo's tracing, AOTAutograd's)."""
    return "(dynamo_timed)" in name or name == "PythonDispatchMode"


@contextlib.contextmanager
def _multi_tensor_optimizers() -> Iterator[None]:
    """torch's optimizers on their multi-tensor path on the CPU, as they take it by default on CUDA (on the CPU they
    default to a loop over tensors: several operators a tensor where CUDA launches a few for all of them)."""
    import torch.optim.optimizer as optimizer

    real = optimizer._get_foreach_kernels_supported_devices
    optimizer._get_foreach_kernels_supported_devices = lambda: [*real(), "cpu"]  # type: ignore[assignment]
    try:
        yield
    finally:
        optimizer._get_foreach_kernels_supported_devices = real  # type: ignore[assignment]


def _parents(e: Any) -> Iterator[Any]:
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


@contextlib.contextmanager
def _marked_steps() -> Iterator[None]:
    """:meth:`FitRunner._step` inside the :data:`STEP` range."""
    real = FitRunner._step

    def step(*args: Any, **kwargs: Any) -> Any:
        with record_function(STEP):
            return real(*args, **kwargs)

    FitRunner._step = staticmethod(step)  # type: ignore[method-assign]
    try:
        yield
    finally:
        FitRunner._step = staticmethod(real)  # type: ignore[method-assign]


def measure(name: str, rounds: int, compiled: bool, where: Counter[str] | None = None) -> tuple[int, int, int]:
    """Config ``name`` for ``rounds`` rounds (evaluation only at the end), uncompiled or compiled as counted graphs."""
    from pl_fedsparse.cli import main

    cfg, extra = CONFIGS[name]
    args = ["fit", "--config", str(REPO / cfg), *extra, "--trainer.enable_progress_bar", "false",
            "--trainer.eval_every", "100"]
    if "--trainer.num_rounds" not in extra:
        args += ["--trainer.num_rounds", str(rounds)]
    if compiled:
        args += ["--trainer.compile", '{"backend": "%s"}' % BACKEND]
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as tmp, device_paths(), _marked_steps(), _multi_tensor_optimizers():
        with profile(activities=[ProfilerActivity.CPU]) as prof, contextlib.redirect_stdout(sys.stderr):
            try:
                code = main([*args, "--trainer.default_root_dir", str(Path(tmp) / name)])
            except SystemExit as e:
                code = int(e.code or 0)
    if code != 0:
        raise RuntimeError(f"{name}: pl-fed exited {code}")
    return _count(prof.events(), where)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--detail", action="store_true", help="where the operators outside the graphs run, per config")
    a = ap.parse_args()
    print(f"# python benchmarks/cuda_graph_launches.py {' '.join(a.configs)} --rounds {a.rounds}  "
          f"(torch {torch.__version__}, CPU, {torch.get_num_threads()} threads)")
    print("| config | steps | operators / step uncompiled | graphs / step | operators / step outside graphs "
          "| launches / step as CUDA graphs | fewer launches |")
    print("|---|---|---|---|---|---|---|")
    details: dict[str, Counter[str]] = {}
    counted_steps: dict[str, int] = {}
    for name in a.configs:
        steps0, _, ops0 = measure(name, a.rounds, compiled=False)
        details[name] = where = Counter()
        steps1, graphs, ops1 = measure(name, a.rounds, compiled=True, where=where)
        counted_steps[name] = steps1
        if steps0 != steps1 or steps0 == 0:
            raise RuntimeError(f"{name}: {steps0} steps uncompiled, {steps1} compiled")
        before, g, outside = ops0 / steps0, graphs / steps1, ops1 / steps1
        print(f"| {name} | {steps0} | {before:.1f} | {g:.1f} | {outside:.1f} | {g + outside:.1f} "
              f"| {before / (g + outside):.1f}x |", flush=True)
    if a.detail:
        for name, where in details.items():
            steps = counted_steps[name]
            print(f"\n# {name}: operators outside the graphs per step, by the range they run in")
            for place, n in where.most_common(8):
                print(f"#   {n / steps:6.1f}  {place}")


if __name__ == "__main__":
    main()
