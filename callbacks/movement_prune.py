"""Worked example: a new dynamic-sparse-training method made by overriding one score — movement pruning.

:class:`~pl_fedsparse.callbacks.GradientRegrow` (FedSpa/RigL) drops the active weights with the smallest magnitude.
Movement pruning (Sanh et al., NeurIPS 2020) instead drops the weights that *moved toward zero* during local
training: the score ``w · (w − w₀)`` is high for a weight that grew away from zero this round and low (negative) for
one that shrank. Here ``w₀`` is the client's start of the round, ``m ⊙ W``; everything else — ERK masks, regrowth by
gradient, cosine prune rate, FedSpa aggregation, accounting, checkpoints — is inherited. From the repository root:

.. code-block:: yaml

    trainer:
      callbacks:
        - class_path: callbacks.movement_prune.MovementPrune
          init_args: {density: 0.5, alpha0: 0.5}
        - class_path: pl_fedsparse.callbacks.FedSpaAggregation

(``configs/synthetic_movement_prune.yaml``; tested in ``tests/test_user_callbacks.py``.)
"""

from __future__ import annotations

from torch import Tensor

from pl_fedsparse import ClientUpdate
from pl_fedsparse.callbacks import GradientRegrow


def movement_score(weight: Tensor, start: Tensor) -> Tensor:
    """``w · (w − w₀)``: positive when a weight moved away from zero, negative when it moved toward it.

    Example:
        >>> import torch
        >>> movement_score(torch.tensor([0.5, 0.1, -0.4]), torch.tensor([0.2, 0.3, -0.1]))
        tensor([ 0.1500, -0.0200,  0.1200])
    """
    return weight * (weight - start)


class MovementPrune(GradientRegrow):
    """FedSpa-style DST that prunes by movement instead of magnitude (overrides ``drop_score`` only)."""

    def drop_score(self, loop, update: ClientUpdate, name: str, weight: Tensor) -> Tensor:
        masks = update.masks
        assert masks is not None  # (a DST client's update carries its masks)
        start = loop.global_state[name] * masks[name].to(weight.dtype)  # the client's download, m ⊙ W
        return movement_score(weight, start)
