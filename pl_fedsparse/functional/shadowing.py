"""Methods put on a module for a while as instance attributes, shadowing the class's (and compiled ones), and taken
off again: what a callback's own ``forward`` during a fit (``PFedGate``, ``FedEM``) and pFedGate's sliced layers use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["replace_methods", "restore_methods"]


def replace_methods(module: Any, **methods: Any) -> dict[str, Any]:
    """Put ``methods`` on ``module`` for a fit as instance attributes (``forward=...``, ``loss=...``), shadowing the
    class's methods and the compiled ones ``trainer.compile`` set on the instance; :func:`restore_methods` with what
    this returns puts back what was there.

    A compiled module's graphs are guarded on the methods they call: install the same bound method every fit (keep
    it in an attribute), or each fit compiles them again until ``torch.compile`` gives up and runs them uncompiled.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> before = replace_methods(m, forward=lambda x: x)
        >>> m(torch.ones(1, 2)).tolist()
        [[1.0, 1.0]]
        >>> restore_methods(m, before); "forward" in vars(m)
        False
    """
    before = {name: vars(module).get(name) for name in methods}
    vars(module).update(methods)
    return before


def restore_methods(module: Any, before: dict[str, Any]) -> None:
    """Undo :func:`replace_methods`: each replaced name gets its earlier instance attribute back, or none."""
    for name, method in before.items():
        if method is None:
            vars(module).pop(name, None)
        else:
            vars(module)[name] = method
