"""Worked example: a SNIP initial mask (Lee, Ajanthan, Torr, ICLR 2019) for FedSpa, by overriding one score method.

:class:`~pl_fedsparse.callbacks.SparseMask` draws each client's initial mask as the top-k of
:meth:`~pl_fedsparse.callbacks.SparseMask.mask_scores` at every layer's (ERK) density — random scores by default.
SNIP keeps the connections whose removal would change the loss most, the saliency ``|g ⊙ w|`` at initialisation.
Here each client scores them on one batch of its own training data, so masks are personal and data-dependent. The
loop calls the score once per client when the federation starts, with the initial weights loaded; the gradient
pass (``loop.local_gradients``) charges its FLOPs to the client. Composed with FedSpa's aggregation this is FedSpa
with a SNIP mask instead of a random one (``configs/synthetic_snip_fedspa.yaml``; tested in
``tests/test_user_callbacks.py``):

.. code-block:: yaml

    trainer:
      callbacks:
        - class_path: callbacks.snip.SnipMask
          init_args: {density: 0.5}
        - class_path: pl_fedsparse.callbacks.FedSpaAggregation
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pl_fedsparse.callbacks import SparseMask
from pl_fedsparse.streams import register_stream

register_stream("snip")  # the batch SNIP scores on: keyed by (0, client)


class SnipMask(SparseMask):
    """A static per-client sparse mask chosen by SNIP saliency |g ⊙ w| on one local batch."""

    def mask_scores(self, loop: Any, client_idx: int) -> dict[str, Tensor]:
        grads = loop.local_gradients(client_idx, self.shapes, keys=(0, client_idx), stream="snip")
        return {n: (grads[n].cpu() * loop.initial_state[n]).abs() if n in grads else torch.zeros(s)
                for n, s in self.shapes.items()}
