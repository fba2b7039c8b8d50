"""``torch.compile`` for the clients' fits: ``trainer.compile``, or a module the user compiled themselves.

Lightning's way is kept: ``Trainer.fit(torch.compile(model))`` compiles the module's ``forward``, ``training_step``,
``validation_step``, ``test_step`` and ``predict_step`` in place (Lightning's own
:func:`lightning.pytorch.utilities.compile.from_compiled`), so the module stays a ``LightningModule`` with the same
parameters and the same ``state_dict`` names — masks, checkpoints and resumes do not see the difference. The
federation compiles **one** module, the one every client's fit reuses, so the compilation is paid once per process
(a few seconds to a minute), not per fit: the clients' weights are loaded into the same parameters, which the
compiled graphs take as inputs (``tests/test_compile.py`` counts the compilations of a whole federation).

Two ways in, the same effect:

* ``trainer.compile: true`` (``torch.compile``'s defaults) or a mapping of its arguments
  (``{mode: max-autotune-no-cudagraphs, dynamic: false}``) — from a config, and the way that works with every
  executor: each process that runs fits compiles its own module (Ray's workers theirs);
* ``loop.fit(torch.compile(model), data)`` from Python, as with ``Trainer.fit``: the module inside is compiled as
  ``torch.compile`` was asked. A compiled module cannot travel to Ray's workers (its compiled methods do not pickle):
  there, ``trainer.compile`` is the way, and a compiled module is refused in one line.

What it is not: the checks, the FLOP count and the model protocol run on the module uncompiled (the compilation is
applied when the executor sets up, after them); the ``VectorizedExecutor``'s stacked fits run their own stacked
layers (:mod:`~pl_fedsparse.executors.stacked`), not the module's ``forward``, so compilation reaches only the fits
it runs one by one.

CUDA graphs (``mode: reduce-overhead`` or ``max-autotune``, ``options: {triton.cudagraphs: true}``, ``backend:
cudagraphs``): on a GPU, each compiled step's kernels are launched as one graph — what pays where a step's time is
its launches (small models, small batches). A graph's replay overwrites its previous outputs, so whatever is kept past
a step is a copy made outside the graphs (:func:`outside_graphs`): the library does so where
:func:`graph_outputs_reused` (each step's loss, one copy a step; pFedGate's and FedEM's running sums; the evaluation's
logits), and a module or callback of the user's that keeps a step's output past the next step gets torch's own
error naming the tensor ("accessing tensor output of CUDAGraphs that has been overwritten"). On the CPU these modes
compile as ``default`` (CUDA graphs are for CUDA tensors). Does compiling pay? On the CPU it did not for the
papers' models (``benchmarks/compile_fit.py``; ``docs/scaling.md``: "Should I compile the model with
torch.compile?"); on a GPU, whose small steps are bound by kernel launches, the next lease measures it
(``benchmarks/gpu/lease_next.sh``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch

from pl_fedsparse.errors import ConfigError, check

log = logging.getLogger(__name__)
_T = TypeVar("_T")

__all__ = ["COMPILE_KEYS", "COMPILE_MODES", "OUTPUT_REUSING_BACKENDS", "check_compile", "check_compile_callbacks",
           "compile_module", "graph_outputs_reused", "is_compiled", "outside_graphs", "running_uncompiled",
           "uncompiled_copy", "unwrap_compiled"]

#: ``trainer.compile``'s keys: ``torch.compile``'s keyword arguments
COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options")
#: ``trainer.compile.mode`` values accepted (torch.compile's modes)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: the methods Lightning's ``from_compiled`` replaces by compiled ones (kept to undo it on a copy)
_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def check_compile(value: Any) -> dict[str, Any] | None:
    """``trainer.compile`` as ``torch.compile``'s keyword arguments (``None``: off), or a one-line
    :class:`~pl_fedsparse.errors.ConfigError`.

    Example:
        >>> check_compile(False), check_compile(True), check_compile({"mode": "default", "dynamic": False})
        (None, {}, {'mode': 'default', 'dynamic': False})
        >>> check_compile({"mode": "fastest"})
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: trainer.compile.mode='fastest' is invalid: expected one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    check(isinstance(value, Mapping), "trainer.compile", value,
          "true, false or a mapping of torch.compile's arguments (" + ", ".join(COMPILE_KEYS) + ")")
    kwargs = dict(value)
    for key in kwargs:
        check(key in COMPILE_KEYS, "trainer.compile", value,
              f"keys among {', '.join(COMPILE_KEYS)} (torch.compile's arguments); got {key!r}")
    mode = kwargs.get("mode")
    check(mode is None or mode in COMPILE_MODES, "trainer.compile.mode", mode, "one of " + ", ".join(COMPILE_MODES))
    if "fullgraph" in kwargs:
        check(isinstance(kwargs["fullgraph"], bool), "trainer.compile.fullgraph", kwargs["fullgraph"], "true or false")
    if "dynamic" in kwargs:
        check(kwargs["dynamic"] is None or isinstance(kwargs["dynamic"], bool), "trainer.compile.dynamic",
              kwargs["dynamic"], "true, false or null")
    if "backend" in kwargs:
        allowed = sorted(torch._dynamo.list_backends(None))
        check(isinstance(kwargs["backend"], str) and kwargs["backend"] in allowed, "trainer.compile.backend",
              kwargs["backend"], "one of " + ", ".join(allowed))
    if "options" in kwargs:
        options = kwargs["options"]
        check(isinstance(options, Mapping), "trainer.compile.options", options, "a mapping of inductor options")
        check("mode" not in kwargs, "trainer.compile", value, "mode or options, not both (torch.compile's rule)")
    return kwargs


def check_compile_callbacks(callbacks: Any, value: Any, compiled: Any) -> None:
    """A one-line :class:`~pl_fedsparse.errors.ConfigError` where the module is to be compiled (``value``:
    ``trainer.compile``; ``compiled``: the ``torch.compile`` wrapper given to ``fit``) and a callback says it does not
    support it (``supports_compile = False``: a callback that replaces the module's ``forward`` during fits)."""
    if check_compile(value) is None and compiled is None:
        return
    for cb in callbacks:
        if getattr(cb, "supports_compile", True) is False:
            what, hint = (f"trainer.compile={value!r}", "drop trainer.compile") if compiled is None else (
                "model=torch.compile(...)", "pass the module itself, not torch.compile(module)")
            raise ConfigError(f"{what} is invalid with {type(cb).__name__}: expected the module uncompiled "
                              f"({type(cb).__name__} replaces the module's forward during fits; {hint})")


#: ``torch.compile`` backends whose graphs give their outputs in memory the next run overwrites, as CUDA graphs do
#: (besides inductor with ``triton.cudagraphs``, what the CUDA-graph modes set): their fits keep copies of what they
#: keep from a step (:func:`graph_outputs_reused`)
OUTPUT_REUSING_BACKENDS = {"cudagraphs"}


def _backend(dynamo_ctx: Any) -> Any:
    """The backend ``torch.compile`` was given, behind dynamo's wrappers (``None`` where they are not as torch 2.x
    makes them)."""
    fn = getattr(getattr(dynamo_ctx, "callback", None), "_torchdynamo_orig_backend", None)
    return getattr(fn, "_torchdynamo_orig_backend", None)


def graph_outputs_reused(module: Any) -> bool:
    """Whether ``module`` runs compiled (:func:`compile_module`) with graphs whose outputs are overwritten when they
    run again — CUDA graphs (``mode: reduce-overhead`` or ``max-autotune``, ``options: {triton.cudagraphs: true}``,
    ``backend: cudagraphs``): what a fit keeps of a step past the next must then be a copy (each step's loss: one
    copy a step). Where the backend cannot be told, assumed so (a copy a step is the safe side).

    Example:
        >>> import lightning.pytorch as pl
        >>> graph_outputs_reused(pl.LightningModule())
        False
    """
    ctx = getattr(module, "_compiler_ctx", None)
    if not ctx:
        return False
    backend = _backend(ctx.get("dynamo_ctx"))
    if backend is None:
        return True
    config = getattr(backend, "config", None) or {}
    return bool(config.get("triton.cudagraphs")) or getattr(backend, "__name__", None) in OUTPUT_REUSING_BACKENDS


@torch.compiler.disable
def outside_graphs(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """``fn(*args, **kwargs)`` run by torch's own operators, outside any compiled graph (called from a compiled
    method, it ends the graph there and the method resumes in another after it).

    For what code running in a compiled step keeps past the step (a copy of the loss, a running sum) where the steps
    run as CUDA graphs (:func:`graph_outputs_reused`): a graph's outputs are overwritten when it runs again, so what
    is kept must be made outside it, from outputs read before the next step. Elsewhere keep it in the graph (no
    break)::

        if graph_outputs_reused(module):
            self.total = outside_graphs(torch.add, self.total, batch_sum)
        else:
            self.total = self.total + batch_sum
    """
    return fn(*args, **kwargs)


def unwrap_compiled(model: Any) -> tuple[Any, Any]:
    """``(module, compiled)``: a module ``torch.compile`` returned (an ``OptimizedModule``) as the module it wraps
    (run uncompiled until :func:`compile_module`) and the wrapper itself; any other object as it is, and ``None``.
    A compiled module that does not wrap a ``LightningModule`` is a one-line error."""
    from torch._dynamo.eval_frame import OptimizedModule

    if not isinstance(model, OptimizedModule):
        return model, None
    inner = model._orig_mod
    if not isinstance(inner, pl.LightningModule):
        raise ConfigError(f"model=torch.compile({type(inner).__name__}) is invalid: expected a compiled "
                          "lightning.pytorch.LightningModule (wrap a plain torch.nn.Module as the backbone of "
                          "pl_fedsparse.FederatedModule, or compile the backbone inside your module)")
    return inner, model


def is_compiled(module: Any) -> bool:
    """Whether ``module``'s methods were replaced by compiled ones (:func:`compile_module`, Lightning's
    ``from_compiled``)."""
    return getattr(module, "_compiler_ctx", None) is not None


def compile_module(module: pl.LightningModule, setting: Any, compiled: Any = None) -> bool:
    """Compile ``module`` in place as ``Trainer.fit(torch.compile(module))`` does (Lightning's ``from_compiled``):
    by ``compiled`` (the ``torch.compile`` wrapper the user passed, :func:`unwrap_compiled`) or else as ``setting``
    (``trainer.compile``, :func:`check_compile`; off: nothing). A module compiled already is left as it is.
    Returns whether the module is compiled."""
    if is_compiled(module):
        return True
    kwargs = check_compile(setting)
    if compiled is None and kwargs is None:
        return False
    from lightning.pytorch.utilities.compile import from_compiled

    from_compiled(compiled if compiled is not None else torch.compile(module, **kwargs))  # type: ignore[arg-type]
    log.info("client fits run %s compiled by torch.compile (%s)", type(module).__name__,
             "as passed" if compiled is not None else kwargs)
    return True


def _take_compiled(module: Any) -> dict[str, Any]:
    """The compiled methods ``from_compiled`` set on ``module`` (instance attributes shadowing the class's), removed
    from it."""
    return {name: vars(module).pop(name) for name in _COMPILED_METHODS if name in vars(module)}


def uncompiled_copy(module: Any) -> Any:
    """``module`` itself when it is not compiled; else a shallow copy without the compiled methods (the same
    parameters and submodules): what can be pickled for another process, which compiles its own."""
    if not is_compiled(module):
        return module
    clone = copy.copy(module)
    _take_compiled(clone)
    clone._compiler_ctx = None
    return clone


@contextlib.contextmanager
def running_uncompiled(module: Any) -> Iterator[None]:
    """``module`` with its own methods while the block runs, its compiled ones again after it (nothing happens to
    a module that is not compiled): for code that calls the module's ``forward`` where a compiled one cannot run
    (``torch.func.vmap`` over the clients: the ``VectorizedExecutor``'s stacked fits)."""
    if not is_compiled(module):
        yield
        return
    saved = _take_compiled(module)
    try:
        yield
    finally:
        vars(module).update(saved)
