"""Sparse masks on client models: :class:`SparseMask` (static; FedSpa-RSM) — the base of dynamic sparse training.

A client's mask is declared per-client state, stored bit-packed on CPU (8 positions per byte) between fits. Before a
client's local fit the mask is applied to the weights; during the fit the gradient is masked after every backward
pass (optional) and the weights are re-masked after every optimizer step, so a masked entry stays exactly zero —
under mixed precision too (Lightning keeps fp32 master weights, and the re-masking writes them). The downstream
message is masked by the receiver's mask (``m_k ⊙ W``) and the upstream message the masked trained model (plus, when the
mask changed, the next mask as a bitmap), all counted as sparse tensors; FLOPs of masked layers are charged at the
mask's density.

Subclasses change the mask after local training by overriding :meth:`SparseMask.next_masks`
(:class:`~pl_fedsparse.callbacks.prune_regrow.MaskPruneRegrow`). Composed with the loop's default FedAvg this is
"FedAvg with a static sparse mask"; with :class:`~pl_fedsparse.callbacks.fedspa.FedSpaAggregation` it is FedSpa.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.errors import check
from pl_fedsparse.functional.masks import apply_masks, check_density, layer_densities, masks_from_densities
from pl_fedsparse.functional.sparse import pack_masks, unpack_masks

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["SparseMask"]

_STREAM_MASK = 11


class SparseMask(FederatedCallback):
    """Keep every client's model sparse under its own mask.

    Args:
        density: target global density of every client's model, in (0, 1].
        distribution: layer-wise densities: ``"erk"`` (Erdős–Rényi-Kernel, RigL/DisPFL/FedSpa) or ``"uniform"``.
        erk_power_scale: exponent of the ERK raw scores (1 = standard ERK).
        same_mask: one initial mask for all clients (FedSpa's "same seed" default) instead of one per client
            (DisPFL's scripts, ``--different_initial``).
        client_densities: heterogeneous densities, client ``i`` gets ``client_densities[i % len]`` (DisPFL §4.3:
            ``[0.2, 0.4, 0.6, 0.8, 1.0]``); overrides ``density``.
        mask_gradients: also zero the gradient of masked entries after each backward pass (weights are re-masked
            after each step either way; masking the gradient keeps momentum buffers and clipping norms sparse).
        dense_1d: leave 1-D tensors (biases, norm affines) dense.
        mask_personal_eval: evaluate the personal model under the client's *current* mask (FedSpa: ``m_k ⊙ W``).
            Set ``false`` when the personal model is the client's last trained model, already sparse under the mask
            it trained with (DisPFL reports that one, before the next mask is applied).

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.SparseMask
                  init_args: {density: 0.5, distribution: erk}
    """

    def __init__(self, *, density: float = 0.5, distribution: Literal["erk", "uniform"] = "erk",
                 erk_power_scale: float = 1.0, same_mask: bool = True, client_densities: list[float] | None = None,
                 mask_gradients: bool = True, dense_1d: bool = True, mask_personal_eval: bool = True) -> None:
        name = type(self).__name__
        check_density(density, f"{name}.density")
        check(distribution in ("erk", "uniform"), f"{name}.distribution", distribution, "one of erk, uniform")
        check(erk_power_scale >= 0, f"{name}.erk_power_scale", erk_power_scale, "a number >= 0")
        check(client_densities is None or len(client_densities) > 0, f"{name}.client_densities", client_densities,
              "a non-empty list of densities or null")
        for d in client_densities or []:
            check_density(d, f"{name}.client_densities")
        self.density = float(density)
        self.distribution = distribution
        self.erk_power_scale = float(erk_power_scale)
        self.same_mask = same_mask
        self.client_densities = [float(d) for d in client_densities] if client_densities else None
        self.mask_gradients = mask_gradients
        self.dense_1d = dense_1d
        self.mask_personal_eval = mask_personal_eval
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._active: dict[str, Tensor] = {}
        self._params: dict[str, Tensor] = {}
        self._step_masks: dict[str, Tensor] = {}

    @property
    def state_key(self) -> str:
        return self._generate_state_key(density=self.density, distribution=self.distribution,
                                        same_mask=self.same_mask)

    # ---- masks ---------------------------------------------------------------------------------------------------
    def client_density(self, client_idx: int) -> float:
        """Target density of ``client_idx``."""
        if self.client_densities:
            return self.client_densities[client_idx % len(self.client_densities)]
        return self.density

    def draw_mask(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        """The initial mask of ``client_idx`` (only tensors with density < 1), seeded by the federation seed, and
        by the client unless ``same_mask`` (clients of equal density then share one draw)."""
        from pl_fedsparse.loop import stream_seed

        density = self.client_density(client_idx)
        densities = layer_densities(self._shapes, density, self.distribution, self.erk_power_scale, self.dense_1d)
        key = 0 if self.same_mask else client_idx + 1
        gen = torch.Generator().manual_seed(stream_seed(loop.seed, _STREAM_MASK, key, int(density * 1e6)))
        masks = masks_from_densities(self._shapes, densities, gen)
        return {k: m for k, m in masks.items() if densities[k] < 1.0}

    def masks(self, loop: FederatedLoop, client_idx: int) -> dict[str, Tensor]:
        """The current (unpacked, bool) mask of ``client_idx``."""
        return unpack_masks(self.get_client_state(loop, client_idx, "mask"), self._shapes)

    def set_masks(self, loop: FederatedLoop, client_idx: int, masks: dict[str, Tensor]) -> None:
        """Replace the mask of ``client_idx`` (stored bit-packed)."""
        self.set_client_state(loop, client_idx, "mask", pack_masks(masks))

    def next_masks(self, loop: FederatedLoop, module: pl.LightningModule,
                   update: ClientUpdate) -> dict[str, Tensor] | None:
        """The client's mask for its next round, computed after local training (``None``: keep it). Override for
        dynamic sparse training; ``module`` holds the trained weights."""
        return None

    # ---- federation hooks ----------------------------------------------------------------------------------------
    @override
    def setup_federation(self, loop: FederatedLoop) -> None:
        self._shapes = {k: tuple(v.shape) for k, v in loop.initial_state.items() if v.is_floating_point()}
        self.add_client_state(loop, "mask", lambda k: pack_masks(self.draw_mask(loop, k)))

    @override
    def on_client_message(self, loop: FederatedLoop, client_idx: int, message: Message) -> None:
        # the client receives (and starts from) its sparse share: m_k ⊙ W (FedSpa), m_k ⊙ gossip average (DisPFL)
        masks = self.masks(loop, client_idx)
        message.tensors = apply_masks(message.tensors, masks)
        message.masks.update({k: m for k, m in masks.items() if k in message.tensors})

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
    def on_client_fit_end(self, loop: FederatedLoop, module: pl.LightningModule, update: ClientUpdate) -> None:
        masks = self._active if self._active else self.masks(loop, update.client_idx)
        masks = {k: m.cpu() for k, m in masks.items()}
        self._active, self._params = {}, {}
        update.masks = masks
        nxt = self.next_masks(loop, module, update)
        sent: dict[str, Tensor] = dict(masks)
        if nxt is not None:
            update.extras["next_mask"] = nxt
            self.set_masks(loop, update.client_idx, nxt)
            # the next mask travels as a bitmap beside the sparse values (FedSpa Alg. 1: U_k and m_{k,t+1} up)
            sent.update({f"next_mask/{k}": m for k, m in nxt.items() if not torch.equal(m, masks[k])})
        if update.message is not None:
            update.message = Message(apply_masks(update.message.tensors, masks), sent)

    @override
    def on_client_evaluate_start(self, loop: FederatedLoop, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind == "personal" and self.mask_personal_eval:  # the personal model is the client's masked model
            self._activate(loop, module, client_idx)
            self._active, self._params = {}, {}

    # ---- Lightning hooks (inside a client's local fit) -----------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the module is on its device now: keep device copies of the masks for the per-step hooks
        self._params = dict(pl_module.named_parameters())
        self._active = {k: m.to(pl_module.device) for k, m in self._active.items()}
        # float copies made once per fit, so the per-step hooks do no conversions
        self._step_masks = {k: m.to(self._params[k].dtype) for k, m in self._active.items() if k in self._params}

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.mask_gradients:
            return
        for name, mask in self._step_masks.items():
            g = self._params[name].grad
            if g is not None:
                g.mul_(mask)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        with torch.no_grad():
            for name, mask in self._step_masks.items():
                self._params[name].mul_(mask)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_masks = {}
