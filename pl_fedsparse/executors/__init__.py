"""Executors: what runs a round's local fits.

One folder, one executor per file, over a common base:

* :mod:`~pl_fedsparse.executors.base` — :class:`ClientExecutor` (the interface), :class:`FitRequest`, and the start
  and end of every fit whatever runs it (seeding, the callback contract, faults and roll-back);
* :mod:`~pl_fedsparse.executors.runner` — :class:`FitRunner`, the persistent fit loop that drives a
  ``LightningModule`` without building a ``Trainer`` per fit (the default where it applies);
* :mod:`~pl_fedsparse.executors.in_process` — :class:`InProcessExecutor`, fits one after another in this process
  (the default executor);
* :mod:`~pl_fedsparse.executors.vectorized` — :class:`VectorizedExecutor`, many clients per step with
  ``torch.func``; its maths in :mod:`~pl_fedsparse.executors.stacked` and the callbacks' side of it (the in-fit hook
  protocol) in :mod:`~pl_fedsparse.executors.hooks`;
* :mod:`~pl_fedsparse.executors.ray_executor` — :class:`RayExecutor` and :class:`FitWorker`, fits on Ray actors (one
  machine or a cluster); imported on first use, so that importing the package never imports Ray's wire format.

Names are imported from here (``pl_fedsparse.executors.VectorizedExecutor``, ``class_path`` in a config); the old
module paths ``pl_fedsparse.execution`` and ``pl_fedsparse.vectorized`` still work.
"""

from __future__ import annotations

from typing import Any

from pl_fedsparse.executors.base import (
    ClientExecutor,
    ClientFaultError,
    FitMeter,
    FitRequest,
    check_environment,
    load_state,
)
from pl_fedsparse.executors.hooks import IN_FIT_HOOKS, StackedFit, VectorizedFitHooks, in_fit_hooks
from pl_fedsparse.executors.in_process import InProcessExecutor
from pl_fedsparse.executors.vectorized import VectorizedExecutor

#: names of :mod:`~pl_fedsparse.executors.ray_executor`, imported when first asked for
_RAY_NAMES = ("FitWorker", "RayExecutor", "pack_tree", "sync_state", "tune_malloc", "unpack_tree", "worker_spec")

__all__ = ["IN_FIT_HOOKS", "ClientExecutor", "ClientFaultError", "FitMeter", "FitRequest", "InProcessExecutor",
           "StackedFit", "VectorizedExecutor", "VectorizedFitHooks", "check_environment", "in_fit_hooks",
           "load_state", *_RAY_NAMES]


def __getattr__(name: str) -> Any:
    if name in _RAY_NAMES:
        from pl_fedsparse.executors import ray_executor

        return getattr(ray_executor, name)
    raise AttributeError(f"module 'pl_fedsparse.executors' has no attribute {name!r}")
