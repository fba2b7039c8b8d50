"""The per-client parts of a stacked fit (:class:`~pl_fedsparse.executors.vectorized.VectorizedExecutor`): each
client's own data stream (its loader, epochs or steps, and torch RNG state) and a snapshot of the callbacks' per-fit
attributes, put back between the clients of a group."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from pl_fedsparse.data.loaders import TensorBatchLoader

__all__ = ["ClientStream", "CallbackSnapshot"]


class CallbackSnapshot:
    """A callback's attributes (and those of helper objects it holds, one level down), to put back later: the
    per-fit state ``on_client_fit_start`` leaves for ``on_client_fit_end`` is each client's own, although all the
    group's fits start before the first one ends."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.items: list[tuple[Any, dict[str, Any]]] = []
        for cb in callbacks:
            attrs = getattr(cb, "__dict__", None)
            if attrs is None:
                continue
            self.items.append((cb, dict(attrs)))
            for value in attrs.values():
                if is_helper(value):
                    self.items.append((value, dict(vars(value))))

    def restore(self) -> None:
        for obj, attrs in self.items:
            vars(obj).clear()
            vars(obj).update(attrs)


def is_helper(value: Any) -> bool:
    """A plain helper object a callback keeps its per-fit state in (e.g. ``MaskedTraining``), not a framework part."""
    if isinstance(value, (Tensor, torch.nn.Module, type)) or not hasattr(value, "__dict__"):
        return False
    module = type(value).__module__
    return not module.startswith(("lightning", "pytorch_lightning", "torch", "builtins", "pl_fedsparse.loop"))


class ClientStream:
    """One client's batches for one fit: its loader, its epochs (or steps), its own torch RNG state.

    From a :class:`~pl_fedsparse.data.loaders.TensorBatchLoader` without augmentation it yields each batch's *rows*
    (``bulk``): the executor then gathers and normalises the rows of all the clients of a step at once (the same
    values: the normalisation is element-wise), instead of one small gather per client and a stack."""

    def __init__(self, loader: Any, epochs: int | None, steps: int | None) -> None:
        self.loader, self.epochs, self.steps = loader, epochs, steps
        self.bulk = isinstance(loader, TensorBatchLoader) and not loader.augment
        self.rng = torch.get_rng_state()
        self.it: Iterator[Any] | None = None
        self.epoch = self.taken = 0
        self.done = False

    def next(self) -> Any:
        """The next batch, or ``None`` when the fit has no more steps."""
        if self.done:
            return None
        if self.bulk:  # a TensorBatchLoader draws from its own generator, never from torch's global one
            return self._next()
        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        try:
            return self._next()
        finally:
            self.rng = torch.get_rng_state()
            torch.set_rng_state(saved)

    def _next(self) -> Any:
        """The next batch of the current epoch, starting the next epoch when one ends (as Lightning's loop)."""
        while True:
            if self.steps is not None and self.taken >= self.steps:
                break
            if self.it is None:
                if self.epochs is not None and self.epoch >= self.epochs:
                    break
                self.it = iter(self.loader.epoch_batches()[1] if self.bulk else self.loader)
            try:
                batch = next(self.it)
            except StopIteration:
                self.it, self.epoch = None, self.epoch + 1
                if self.steps is not None and self.epoch > 0 and self.taken == 0:
                    break  # an empty loader: max_steps would never be reached
                continue
            self.taken += 1
            return batch
        self.done = True
        return None
