"""Sparse masks on client models: :class:`SparseMask` (static; FedSpa-RSM) — the base of dynamic sparse training.

A client's mask is declared per-client state, stored bit-packed on CPU (8 positions per byte) between fits. Before a
client's local fit the mask is applied to the weights; during the fit the gradient is masked after every backward
pass (optional) and the weights are re-masked after every optimizer step, so a masked entry stays exactly zero —
under mixed precision too (Lightning keeps fp32 master weights, and the re-masking writes them). The downstream
message is masked by the receiver's mask (``m_k ⊙ W``) and the upstream message the masked trained model (plus, when the
mask changed, the next mask as a bitmap), all counted as sparse tensors; FLOPs of masked layers are charged at the
mask's density.

Two methods are meant to be overridden: :meth:`SparseMask.mask_scores` (the initial mask is the top-k of these
scores at each layer's density; random by default, SNIP's ``|g ⊙ w|`` in ``callbacks/snip.py``) and
:meth:`SparseMask.next_masks` (the mask after local training; :class:`~pl_fedsparse.callbacks.MaskPruneRegrow`).
The per-step mechanics — trainable positions, gradients masked before the optimizer step (unscaled under mixed
precision), weights re-masked after it, an optional frozen part added back — are the reusable part
:class:`MaskedTraining`, which :class:`~pl_fedsparse.callbacks.DualMask` composes too. Composed with the loop's default FedAvg this is
"FedAvg with a static sparse mask"; with :class:`~pl_fedsparse.callbacks.fedspa.FedSpaAggregation` it is FedSpa.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext
from pl_fedsparse.errors import check
from pl_fedsparse.executors.runner import ignores_batch_outputs
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.masks import apply_masks, check_density, layer_densities, permutation_scores, topk_mask
from pl_fedsparse.functional.sparse import pack_masks, packed_count, segment_layout, unpack_masks
from pl_fedsparse.functional.transfer import to_device, to_host, to_where

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["MaskedTraining", "SparseMask", "UsesMaskedTraining", "random_mask_scores", "top_masks"]


def random_mask_scores(loop: FederationView, shapes: dict[str, tuple[int, ...]], key: int,
                       density: float) -> dict[str, Tensor]:
    """The default initial-mask scores: one ``randperm`` per tensor (in order) from the ``mask`` stream at
    ``(key, density·1e6)`` — DisPFL's ``init_masks`` draw; ``key`` 0 is shared by all clients."""
    gen = loop.streams.generator("mask", key, int(density * 1e6))
    return {k: permutation_scores(s, gen) for k, s in shapes.items()}


def random_top_masks(loop: FederationView, shapes: dict[str, tuple[int, ...]], key: int, density: float,
                     densities: dict[str, float]) -> dict[str, Tensor]:
    """``top_masks(random_mask_scores(loop, shapes, key, density), densities)`` without sorting: the top ``k`` of a
    permutation score are the permutation's first ``k`` entries (the same draws, in the same order, so the same
    masks). O(n) per tensor instead of an argsort: a ResNet-18 client's mask took ~1 s, 100 clients ~2 minutes."""
    gen = loop.streams.generator("mask", key, int(density * 1e6))
    perms = {k: torch.randperm(math.prod(s), generator=gen) for k, s in shapes.items()}
    out = {}
    for k, d in densities.items():
        if d < 1.0:
            flat = torch.zeros(perms[k].numel(), dtype=torch.bool)
            flat[perms[k][:math.floor(d * perms[k].numel())]] = True
            out[k] = flat.view(shapes[k])
    return out


def top_masks(scores: dict[str, Tensor], densities: dict[str, float]) -> dict[str, Tensor]:
    """Per tensor with density < 1, the top ``floor(d · n)`` positions of its scores."""
    return {k: topk_mask(scores[k], math.floor(d * scores[k].numel())) for k, d in densities.items() if d < 1.0}


def _names_of(names: list[str], differs: Tensor) -> list[str]:
    """The names whose entry of :func:`_differences`' tensor (read here) is not 0."""
    return [k for k, d in zip(names, differs.tolist()) if d]


def _differences(new: Mapping[str, Tensor], old: Mapping[str, Tensor]) -> tuple[list[str], Tensor | None]:
    """``new``'s names and, where the masks are, one tensor of how many positions each mask differs by from
    ``old``'s (or whether it differs) — not read (``None`` for no masks): all of them decided in one go, read in one
    copy (:func:`_names_of`), not one wait per mask as ``torch.equal`` would make."""
    names = list(new)
    if not names:
        return names, None
    a, b = [new[k] for k in names], [old[k] for k in names]
    first = a[0]
    if len(names) > 1 and all(x.shape == y.shape and x.dtype == y.dtype == first.dtype and x.device == y.device ==
                              first.device and x.layout == y.layout == torch.strided for x, y in zip(a, b)):
        # joined: one comparison of all the masks, its differences counted per mask (segment_layout: cached)
        segment, _ = segment_layout(tuple(x.numel() for x in a), first.device)
        diff = torch.cat([x.reshape(-1) for x in a]) != torch.cat([y.reshape(-1) for y in b])
        return names, torch.zeros(len(names), dtype=torch.int64, device=first.device).index_add_(0, segment,
                                                                                              diff.long())
    # (shapes that broadcast, mixed dtypes or devices: mask by mask, still one read)
    return names, torch.stack([torch.ne(x, y).any() for x, y in zip(a, b)])


def _send_changed(update: ClientUpdate, names: list[str], differs: Tensor, nxt: Mapping[str, Tensor]) -> None:
    """The readjusted masks that changed (``differs``: :func:`_differences`, on the host) added to the message the
    update holds when its fit ends, as ``next_mask/<name>`` (none where it uploads nothing)."""
    if update.message is not None:
        update.message.masks.update({f"next_mask/{k}": nxt[k] for k in _names_of(names, differs)})


class MaskedTraining:
    """One fit's masked training, as a reusable part: only ``trainable`` positions move.

    :meth:`begin` (from ``on_client_fit_start``) takes the trainable masks — bool, by parameter name — and optionally
    ``frozen`` values (a parameter's fixed part, zero at its trainable positions) and may apply the masks to the
    weights. During the fit, gradients are multiplied by the masks before every optimizer step (unscaled then, under
    mixed precision) and after every step the weights are re-masked and the frozen part is added back, so frozen
    entries stay bit-identical also under weight decay and momentum, and masked entries stay exactly zero. The owner
    forwards its Lightning hooks ``on_train_start``, ``on_before_optimizer_step``, ``on_train_batch_end`` and
    ``on_train_end``, and calls :meth:`end` after the fit.
    """

    def __init__(self, *, mask_gradients: bool = True) -> None:
        self.mask_gradients = mask_gradients
        self.active: dict[str, Tensor] = {}
        self._given: dict[str, Tensor] = {}
        self._frozen: dict[str, Tensor] = {}
        self._params: dict[str, Tensor] = {}
        # per fit, in the parameters' dtype on their device: (masked parameters, their masks) and (parameters with
        # frozen entries, those entries), as lists for the per-step multi-tensor operations
        self._step_masks: tuple[list[Tensor], list[Tensor]] = ([], [])
        self._frozen_dev: tuple[list[Tensor], list[Tensor]] = ([], [])
        self._on: torch.device | None = None  # where ``active`` and ``_frozen`` are (None: as given)
        # the masks in their parameters' dtype and device, by name, for one fit (see _masked_params)
        self._converted: dict[str, Tensor] | None = None

    def begin(self, module: pl.LightningModule, trainable: dict[str, Tensor],
              frozen: dict[str, Tensor] | None = None, apply: bool = True) -> None:
        """Start a fit: ``module`` holds the start weights; ``apply`` multiplies them by ``trainable`` now."""
        self.active, self._frozen = trainable, dict(frozen or {})
        self._given = trainable  # (what end() hands back where it is on the host: the masks do not change in a fit)
        self._params = dict(module.named_parameters())
        self._on = None
        self._converted = None
        if apply and self._params:
            self._move(next(iter(self._params.values())).device)
            params, masks = self._masked_params()
            with torch.no_grad():
                if params:  # (one multi-tensor product: the same values as tensor by tensor)
                    torch._foreach_mul_(params, masks)

    def _masked_params(self) -> tuple[list[Tensor], list[Tensor]]:
        """The masked parameters and their masks in the parameters' dtype on their device, converted once per fit
        (``begin`` and ``on_train_start`` share them; a conversion is made again only where a parameter's device or
        dtype changed in between)."""
        names = [k for k in self.active if k in self._params]
        params = [self._params[k] for k in names]
        conv = self._converted
        if conv is None or any(k not in conv or conv[k].device != p.device or conv[k].dtype != p.dtype
                               for k, p in zip(names, params)):
            conv = self._converted = {k: (self.active[k] if self.active[k].device == p.device
                                          else self.active[k].to(p.device)).to(p.dtype)
                                      for k, p in zip(names, params)}
        return params, [conv[k] for k in names]

    def _move(self, device: torch.device) -> None:
        """The masks and frozen values to ``device``, in one copy across the link (none when they are there)."""
        if self._on == device:
            return
        both = to_device({**{f"a/{k}": m for k, m in self.active.items()},
                          **{f"f/{k}": v for k, v in self._frozen.items()}}, device)
        self.active = {k: both[f"a/{k}"] for k in self.active}
        self._frozen = {k: both[f"f/{k}"] for k in self._frozen}
        self._on, self._converted = device, None

    def on_train_start(self, module: pl.LightningModule) -> None:
        # the module is on its device now: device copies of the masks, converted once per fit
        self._params = dict(module.named_parameters())
        self._move(module.device)
        self._step_masks = self._masked_params()
        self._frozen_dev = ([self._params[k] for k in self._frozen],
                            [v.to(self._params[k].dtype) for k, v in self._frozen.items()])

    def on_before_optimizer_step(self) -> None:
        if not self.mask_gradients:
            return
        # (one multi-tensor operation: on a GPU a few kernel launches for every masked tensor, the same products)
        pairs = [(p.grad, mask) for p, mask in zip(*self._step_masks) if p.grad is not None]
        if pairs:
            torch._foreach_mul_([g for g, _ in pairs], [m for _, m in pairs])

    def on_train_batch_end(self) -> None:
        with torch.no_grad():
            if self._step_masks[0]:
                torch._foreach_mul_(*self._step_masks)
            if self._frozen_dev[0]:  # weight decay and momentum must not move frozen entries
                torch._foreach_add_(*self._frozen_dev)

    def on_train_end(self) -> None:
        self._step_masks, self._frozen_dev, self._converted = ([], []), ([], []), None

    def end(self) -> dict[str, Tensor]:
        """Finish the fit; returns the trainable masks (on CPU: those given to :meth:`begin` where they were there,
        else one copy from the device)."""
        given = {k: m for k, m in self._given.items() if m.device.type == "cpu"}
        rest = to_host({k: m for k, m in self.active.items() if k not in given}, share=False)
        masks = {k: given[k] if k in given else rest[k] for k in self.active}
        self.active, self._frozen, self._params, self._on, self._given = {}, {}, {}, None, {}
        return masks


class _VectorizedMaskedTraining:
    """:class:`MaskedTraining` over a stacked group of fits (:class:`~pl_fedsparse.executors.VectorizedExecutor`):
    each client's trainable masks and frozen values, captured after its ``begin``, stacked; the same two edits per
    step — gradients times the masks before the optimizer step, weights times the masks plus the frozen part after
    it. A client without a mask for a tensor gets ones (times 1 and plus 0 are exact)."""

    def __init__(self, training: MaskedTraining) -> None:
        self.training = training
        self.captured: list[tuple[dict[str, Tensor], dict[str, Tensor]]] = []
        self.masks: dict[str, Tensor] = {}
        self.frozen: dict[str, Tensor] = {}

    def capture(self, index: int, module: pl.LightningModule, context: Any) -> None:
        if index == 0:
            self.captured = []
        self.captured.append((dict(self.training.active), dict(self.training._frozen)))

    def start(self, fit: Any) -> None:
        names = [n for n in fit.params if any(n in m for m, _ in self.captured)]
        frozen = [n for n in fit.params if any(n in f for _, f in self.captured)]
        self.masks, self.frozen = {}, {}
        for n in names:
            p = fit.params[n]
            self.masks[n] = torch.stack([m[n].to(p.dtype) if n in m else torch.ones(p.shape[1:], dtype=p.dtype)
                                         for m, _ in self.captured]).to(p.device)
        for n in frozen:
            p = fit.params[n]
            self.frozen[n] = torch.stack([f[n].to(p.dtype) if n in f else torch.zeros(p.shape[1:], dtype=p.dtype)
                                          for _, f in self.captured]).to(p.device)
        self.captured = []

    @staticmethod
    def _at(t: Tensor, fit: Any) -> Tensor:
        return t if fit.rows is None else t.index_select(0, fit.rows)  # the rows of the clients still training

    def before_optimizer_step(self, fit: Any) -> None:
        if self.training.mask_gradients:
            for n, m in self.masks.items():
                fit.grads[n].mul_(self._at(m, fit))

    def after_optimizer_step(self, fit: Any) -> None:
        with torch.no_grad():
            for n, m in self.masks.items():
                fit.params[n].mul_(self._at(m, fit))
            for n, f in self.frozen.items():
                fit.params[n].add_(self._at(f, fit))


class UsesMaskedTraining(FederatedCallback):
    """Base of callbacks that train through a :class:`MaskedTraining` part (``self.training``): forwards the four
    Lightning hooks of a local fit to it. The subclass calls ``self.training.begin(...)`` in ``on_client_fit_start``
    and ``self.training.end()`` in ``on_client_fit_end``."""

    training: MaskedTraining

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.training.on_train_start(pl_module)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.training.on_before_optimizer_step()

    @override
    @ignores_batch_outputs
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.training.on_train_batch_end()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.training.on_train_end()

    @override
    def vectorized_fit(self) -> Any:
        """The masked training's two per-step edits on stacked fits (:class:`_VectorizedMaskedTraining`)."""
        return _VectorizedMaskedTraining(self.training)


class SparseMask(UsesMaskedTraining):
    """Keep every client's model sparse under its own mask.

    Args:
        density: target global density of every client's model, in (0, 1].
        distribution: layer-wise densities: ``"erk"`` (Erdős–Rényi-Kernel, RigL/DisPFL/FedSpa) or ``"uniform"``.
        erk_power_scale: exponent of the ERK raw scores (1 = standard ERK).
        same_mask: one initial mask for all clients (FedSpa's "same seed" default) instead of one per client
            (DisPFL's scripts, ``--different_initial``); applies to the default random scores.
        client_densities: heterogeneous densities, client ``i`` gets ``client_densities[i % len]`` (DisPFL §4.3:
            ``[0.2, 0.4, 0.6, 0.8, 1.0]``); overrides ``density``.
        mask_gradients: also zero the gradient of masked entries before each optimizer step (weights are re-masked
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
        self.shapes: dict[str, tuple[int, ...]] = {}  #: shapes of the floating-point tensors (set at setup)
        self.training = MaskedTraining(mask_gradients=mask_gradients)

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

    def layer_densities(self, client_idx: int) -> dict[str, float]:
        """Density of every tensor of ``client_idx``'s mask (ERK or uniform at the client's density)."""
        return layer_densities(self.shapes, self.client_density(client_idx), self.distribution, self.erk_power_scale,
                               self.dense_1d)

    def mask_scores(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """Scores of every position of every tensor; the initial mask keeps the top ``floor(d_l · n_l)`` of each layer.

        Called once per client when the federation starts, with the initial weights in ``loop.model`` (and in
        ``loop.initial_state``). Default: random — one ``randperm`` per tensor from the ``mask`` stream, keyed by the
        client (0 for all with ``same_mask``) and its density, as DisPFL's ``init_masks``. Override for a
        data-dependent initial mask (SNIP: ``callbacks/snip.py``).
        """
        key = 0 if self.same_mask else client_idx + 1
        return random_mask_scores(loop, self.shapes, key, self.client_density(client_idx))

    def draw_mask(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """The initial mask of ``client_idx``: per tensor with density < 1, the top-k of :meth:`mask_scores`."""
        if type(self).mask_scores is SparseMask.mask_scores:  # the default random scores: no sort needed
            key = 0 if self.same_mask else client_idx + 1
            return random_top_masks(loop, self.shapes, key, self.client_density(client_idx),
                                    self.layer_densities(client_idx))
        return top_masks(self.mask_scores(loop, client_idx), self.layer_densities(client_idx))

    def masks(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """The current (unpacked, bool) mask of ``client_idx``."""
        return unpack_masks(self.get_client_state(loop, client_idx, "mask"), self.shapes)

    def set_masks(self, loop: FederationView, client_idx: int, masks: dict[str, Tensor]) -> None:
        """Replace the mask of ``client_idx`` (stored bit-packed)."""
        self.set_client_state(loop, client_idx, "mask", pack_masks(masks))

    def next_masks(self, loop: FederationView, module: pl.LightningModule,
                   update: ClientUpdate) -> dict[str, Tensor] | None:
        """The client's mask for its next round, computed after local training (``None``: keep it). Override for
        dynamic sparse training; ``module`` holds the trained weights."""
        return None

    # ---- federation hooks ----------------------------------------------------------------------------------------
    @override
    def setup_federation(self, loop: FederationView) -> None:
        self.shapes = {k: tuple(v.shape) for k, v in loop.initial_state.items() if v.is_floating_point()}
        self.add_client_state(loop, "mask", lambda k: pack_masks(self.draw_mask(loop, k)))

    @override
    def client_masks(self, loop: FederationView, client_idx: int) -> dict[str, Tensor] | None:
        return self.masks(loop, client_idx)

    @override
    def on_client_message(self, loop: FederationView, client_idx: int, message: Message) -> None:
        # the client receives (and starts from) its sparse share: m_k ⊙ W (FedSpa), m_k ⊙ gossip average (DisPFL)
        like = next((t for n, t in message.tensors.items() if n in self.shapes), None)
        if like is None or not transfer.on_a_device([like]):
            masks = self.masks(loop, client_idx)
        elif type(self).masks is SparseMask.masks:  # a message made on the device: the packed mask goes there
            packed = self.get_client_state(loop, client_idx, "mask")
            masks = unpack_masks(dict(zip(packed, loop.client_store.on_device(list(packed.values()), like.device))),
                                 self.shapes)
            for k, m in masks.items():  # (the ledger's counts, read on the host from the packed bytes)
                message.know_count(k, m, packed_count(packed[k]))
        else:  # (a subclass's own masks, where they are)
            masks = to_where(self.masks(loop, client_idx), like)
        message.tensors = apply_masks(message.tensors, masks)
        message.masks.update({k: m for k, m in masks.items() if k in message.tensors})

    #: ``on_client_message`` takes a message on the device: the packed mask crosses to it (kept there while unchanged)
    #: and is unpacked there
    device_message = True

    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        self.training.begin(module, self._fit_masks(loop, context.client_idx, module))

    def _fit_masks(self, loop: FederationView, client_idx: int, module: pl.LightningModule) -> dict[str, Tensor]:
        """:meth:`masks` for a fit. Where the packed mask is on the module's device already (moved with the start
        weights: ``ClientStateStore.prefetch``), it is unpacked there too, and the device masks are remembered as the
        host masks' twins: moving the masks to the device (``MaskedTraining``, prune-and-regrow) copies nothing
        across the link."""
        packed = self.get_client_state(loop, client_idx, "mask")
        masks = unpack_masks(packed, self.shapes)
        device = next((p.device for p in module.parameters()), None)
        if device is not None and packed and transfer.twins_on(packed.values(), device):
            on_device = unpack_masks(to_device(packed, device), self.shapes)
            for name, mask in masks.items():
                transfer.remember_twin(mask, on_device[name], owner=client_idx)
        return masks

    #: ``on_client_fit_end`` works where the update is: the masks are moved there (no copy across the link where
    #: they crossed with the start weights), the readjusted ones are computed there
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        masks = self.training.end()
        update.masks = masks
        nxt = self.next_masks(loop, module, update)
        like = next(iter(update.state.values()), None)
        here = to_where(masks, like) if like is not None and masks else masks  # (where the update is)
        sent: dict[str, Tensor] = dict(here)
        if nxt is not None:
            update.extras["next_mask"] = nxt
            self.set_masks(loop, update.client_idx, nxt)
            # the next mask travels as a bitmap beside the sparse values (FedSpa Alg. 1: U_k and m_{k,t+1} up) where
            # it changed: decided where the masks are, read with the update's copy when the fit ends (no wait now)
            names, differs = _differences(nxt, here)
            if differs is not None:
                update.on_host([differs], lambda host: _send_changed(update, names, host[0], nxt))
        if update.message is not None:
            update.message = Message(apply_masks(update.message.tensors, here), sent)

    @override
    def evaluation_start_is_shared(self, loop: FederationView, kind: str) -> bool:
        return kind != "personal" or not self.mask_personal_eval  # the client's own mask on its personal model

    @override
    def on_client_evaluate_start(self, loop: FederationView, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind == "personal" and self.mask_personal_eval:  # the personal model is the client's masked model
            with torch.no_grad():
                params = dict(module.named_parameters())
                for name, mask in self.masks(loop, client_idx).items():
                    if name in params:
                        params[name].mul_(mask.to(params[name].device, params[name].dtype))
