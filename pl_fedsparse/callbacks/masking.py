"""Static sparse masks on client models: :class:`SparseMask`.

A mask is per-client state (a bool tensor per masked weight). Before a client's local fit the mask is applied to the
weights; during the fit the gradient is masked after every backward pass (optional) and the weights are re-masked
after every optimizer step, so a masked entry stays exactly zero — under mixed precision too (Lightning keeps fp32
master weights, and the re-masking writes them). The downstream message is the masked global model and the upstream
message the masked trained model, both counted as sparse tensors; FLOPs of masked layers are charged at the mask's
density.

Composed with the loop's default FedAvg this is "FedAvg with a static sparse mask"; FedSpa-RSM (Huang et al. 2022)
is the same with its own aggregation (Eq. 4). Dynamic masks (prune-and-regrow) build on this callback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.functional.masks import apply_masks, check_density, random_mask, uniform_densities

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["SparseMask"]

_STREAM_MASK = 11


class SparseMask(FederatedCallback):
    """Keep every client's model sparse under a fixed random mask.

    Args:
        density: fraction of kept entries in every masked tensor, in (0, 1].
        same_mask: one mask for all clients (FedSpa's "same seed" scheme) instead of one per client.
        mask_gradients: also zero the gradient of masked entries after each backward pass (weights are re-masked
            after each step either way; masking the gradient keeps momentum buffers and clipping norms sparse).
        dense_1d: leave 1-D tensors (biases, norm affines) dense.

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.SparseMask
                  init_args: {density: 0.5}
    """

    def __init__(self, *, density: float = 0.5, same_mask: bool = True, mask_gradients: bool = True,
                 dense_1d: bool = True) -> None:
        check_density(density, "SparseMask.density")
        self.density = float(density)
        self.same_mask = same_mask
        self.mask_gradients = mask_gradients
        self.dense_1d = dense_1d
        self._active: dict[str, Tensor] = {}
        self._params: dict[str, Tensor] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(density=self.density, same_mask=self.same_mask)

    def draw_mask(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        """The initial mask of ``client_idx``, seeded by the federation seed (and the client unless ``same_mask``)."""
        from pl_fedsparse.loop import stream_seed

        shapes = {k: tuple(v.shape) for k, v in loop.initial_state.items() if v.is_floating_point()}
        densities = uniform_densities(shapes, self.density, self.dense_1d)
        gen = torch.Generator().manual_seed(
            stream_seed(loop.seed, _STREAM_MASK, 0 if self.same_mask else client_idx + 1))
        return {k: random_mask(shapes[k], d, gen) for k, d in densities.items() if d < 1.0}

    def masks(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        """The current mask of ``client_idx``."""
        return self.get_client_state(loop, client_idx, "mask")

    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        self.add_client_state(loop, "mask", lambda k: self.draw_mask(loop, k))

    @override
    def client_message(self, loop: FederatedLoop, client_idx: int) -> Message | None:
        if loop.global_state is None:
            return None
        masks = self.masks(loop, client_idx)
        return Message(apply_masks(loop.global_state, masks), dict(masks))

    def _activate(self, loop: FederatedLoop, module: pl.LightningModule, client_idx: int) -> None:
        self._active = self.masks(loop, client_idx)
        self._params = dict(module.named_parameters())
        self._mask_weights()

    @torch.no_grad()
    def _mask_weights(self) -> None:
        for name, mask in self._active.items():
            p = self._params.get(name)
            if p is not None:
                p.mul_(mask.to(p.device, p.dtype))

    @override
    def on_client_fit_start(self, loop: FederatedLoop, module: pl.LightningModule, client_idx: int) -> None:
        self._activate(loop, module, client_idx)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the module is on its device now: keep device copies of the masks for the per-step hooks
        self._params = dict(pl_module.named_parameters())
        self._active = {k: m.to(pl_module.device) for k, m in self._active.items()}

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.mask_gradients:
            return
        for name, mask in self._active.items():
            p = self._params.get(name)
            if p is not None and p.grad is not None:
                p.grad.mul_(mask.to(p.grad.dtype))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._mask_weights()

    @override
    def on_client_fit_end(self, loop: FederatedLoop, module: pl.LightningModule, update: ClientUpdate) -> None:
        masks = self.masks(loop, update.client_idx)
        update.masks = dict(masks)
        if update.message is not None:
            update.message = Message(apply_masks(update.message.tensors, masks), dict(masks))
        self._active, self._params = {}, {}

    @override
    def on_client_evaluate_start(self, loop: FederatedLoop, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind == "personal":  # the personal model is the client's masked model
            self._activate(loop, module, client_idx)
            self._active, self._params = {}, {}
