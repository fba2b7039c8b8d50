"""Worked example: a new aggregation rule as a callback — coordinate-wise trimmed mean (Yin et al., ICML 2018).

FedAvg's mean is sensitive to a few outlying clients; the trimmed mean drops, for every coordinate, the ``trim``
fraction of largest and smallest client values and averages the rest. Everything else (sampling, local Lightning
fits, evaluation, logging, checkpoints) is inherited from the loop. Use it from the repository root:

.. code-block:: yaml

    trainer:
      callbacks:
        - class_path: callbacks.trimmed_mean.TrimmedMean
          init_args: {trim: 0.2}

(``configs/synthetic_trimmed_mean.yaml``; test in ``tests/test_user_callbacks.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from pl_fedsparse import ClientUpdate, FederatedCallback
from pl_fedsparse.errors import check


def trimmed_mean(values: Sequence[Tensor], trim: float) -> Tensor:
    """Mean over clients after dropping the ``floor(trim · n)`` smallest and largest values of every coordinate.

    Example:
        >>> trimmed_mean([torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([100.0])], 0.34)
        tensor([2.])
    """
    stacked = torch.stack([v.float() for v in values])
    k = math.floor(trim * stacked.shape[0])
    if k == 0:
        return stacked.mean(0)
    ordered = stacked.sort(dim=0).values
    return ordered[k: stacked.shape[0] - k].mean(0)


class TrimmedMean(FederatedCallback):
    """Aggregate the uploaded models by a coordinate-wise trimmed mean (owns the ``aggregate`` policy).

    Args:
        trim: fraction of clients dropped at each end, in [0, 0.5).
    """

    def __init__(self, *, trim: float = 0.1) -> None:
        check(0 <= trim < 0.5, "TrimmedMean.trim", trim, "a number in [0, 0.5)")
        self.trim = trim

    def aggregate(self, loop, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        sent = [u.message.tensors for u in updates if u.message is not None]
        if loop.global_state is None or not sent:
            return loop.global_state
        new = dict(loop.global_state)
        for name, value in loop.global_state.items():
            if value.is_floating_point():
                new[name] = trimmed_mean([s[name] for s in sent], self.trim).to(value.dtype)
        return new
