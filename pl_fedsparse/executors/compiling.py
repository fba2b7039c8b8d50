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

CUDA graphs (``mode: reduce-overhead``, ``max-autotune``, ``options: {triton.cudagraphs: true}``) are refused for
now: a graph's replay overwrites the previous step's outputs, and a fit keeps every step's loss until the fit ends
(:class:`~pl_fedsparse.metrics.StepLosses`, what keeps the steps free of host syncs) — those would be read
overwritten. Does compiling pay? On the CPU it did not for the papers' models (``benchmarks/compile_fit.py``;
``docs/scaling.md``: "Should I compile the model with torch.compile?"); on a GPU, whose small steps are bound by
kernel launches, the next lease measures it (``benchmarks/gpu/lease_next.sh``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch

from pl_fedsparse.errors import ConfigError, check

log = logging.getLogger(__name__)

__all__ = ["COMPILE_KEYS", "COMPILE_MODES", "check_compile", "check_compile_callbacks", "compile_module",
           "is_compiled", "running_uncompiled", "uncompiled_copy", "unwrap_compiled"]

#: ``trainer.compile``'s keys: ``torch.compile``'s keyword arguments
COMPILE_KEYS = ("mode", "fullgraph", "dynamic", "backend", "options")
#: ``trainer.compile.mode`` values accepted (the others use CUDA graphs: see the module docstring)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
#: ``torch.compile`` modes that capture CUDA graphs
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
#: the methods Lightning's ``from_compiled`` replaces by compiled ones (kept to undo it on a copy)
_COMPILED_METHODS = ("forward", "training_step", "validation_step", "test_step", "predict_step")


def check_compile(value: Any) -> dict[str, Any] | None:
    """``trainer.compile`` as ``torch.compile``'s keyword arguments (``None``: off), or a one-line
    :class:`~pl_fedsparse.errors.ConfigError`.

    Example:
        >>> check_compile(False), check_compile(True), check_compile({"mode": "default", "dynamic": False})
        (None, {}, {'mode': 'default', 'dynamic': False})
        >>> check_compile({"mode": "reduce-overhead"})
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: trainer.compile.mode='reduce-overhead' is invalid: expected one of default, max-autotune-no-cudagraphs (CUDA graphs overwrite a step's outputs at the next step, and a fit keeps each step's loss until it ends)
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
    if mode in _CUDA_GRAPH_MODES:
        raise ConfigError(f"trainer.compile.mode={mode!r} is invalid: expected one of {', '.join(COMPILE_MODES)} "
                          "(CUDA graphs overwrite a step's outputs at the next step, and a fit keeps each step's "
                          "loss until it ends)")
    check(mode is None or mode in COMPILE_MODES, "trainer.compile.mode", mode, "one of " + ", ".join(COMPILE_MODES))
    if "fullgraph" in kwargs:
        check(isinstance(kwargs["fullgraph"], bool), "trainer.compile.fullgraph", kwargs["fullgraph"], "true or false")
    if "dynamic" in kwargs:
        check(kwargs["dynamic"] is None or isinstance(kwargs["dynamic"], bool), "trainer.compile.dynamic",
              kwargs["dynamic"], "true, false or null")
    if "backend" in kwargs:
        allowed = sorted(b for b in torch._dynamo.list_backends(None) if b != "cudagraphs")
        check(isinstance(kwargs["backend"], str) and kwargs["backend"] in allowed, "trainer.compile.backend",
              kwargs["backend"], "one of " + ", ".join(allowed) + " (not cudagraphs: see trainer.compile.mode)")
    if "options" in kwargs:
        options = kwargs["options"]
        check(isinstance(options, Mapping), "trainer.compile.options", options, "a mapping of inductor options")
        check(not options.get("triton.cudagraphs", False), "trainer.compile.options", options,
              "no triton.cudagraphs (CUDA graphs overwrite a step's outputs at the next step, and a fit keeps each "
              "step's loss until it ends)")
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
