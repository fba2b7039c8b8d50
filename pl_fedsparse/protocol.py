"""What the loop needs from *your* model and data, checked when a federation starts.

The :class:`~pl_fedsparse.loop.FederatedLoop` drives any :class:`lightning.pytorch.LightningModule` — the shipped
:class:`~pl_fedsparse.module.FederatedModule` is one of them, not a requirement. ``docs/your-own-model.md`` walks
through an example; this module is the contract, and :func:`check_model` enforces it with one-line errors.

Required (a local fit is a Lightning ``Trainer.fit`` of the module on one client's batches):

* a :class:`lightning.pytorch.LightningModule` with its own ``training_step(batch, batch_idx)`` returning the loss
  (a tensor, or a dict with ``"loss"``) and its own ``configure_optimizers()``. Batches are what the datamodule's
  loaders yield: ``(x, y)`` with ``x`` the inputs and ``y`` int64 class labels.
* ``forward(x)`` returning **logits** ``[batch, num_classes]`` (float): evaluation computes accuracy, loss, macro-F1
  and calibration from them, on every client's data and every evaluation view.
* no per-client state of its own: one instance is shared by all clients, the loop loads a client's weights into it
  (``state_dict`` keys are what masks, messages and aggregation address) and copies them out after the fit. What a
  method keeps per client is client state declared by callbacks.

Optional (the loop uses them when present, and says what it does without them):

* ``loss(logits, y) -> Tensor``: the training loss, used where the loop itself needs gradients outside a fit
  (e.g. gradient-based regrowth: RigL/FedSpa ``GradientRegrow``, SNIP); without it, cross-entropy.
* ``fit_metrics() -> dict[str, float | Tensor]``: per-fit metrics, at least ``train_loss`` (mean over the samples
  seen) and ``samples_seen`` (what FLOPs are charged for); without it, the loop measures both itself from the loss
  each ``training_step`` returns and the size of each batch's labels. A value may be a 0-dim tensor where the fit
  ran: it is read with the fit's update, in its one copy to the host (no wait for the device), and is a float from
  the fit's end on.
* a datamodule's ``place_data(device)``: called once after ``setup`` with the device the fits run on, where they
  run in the loop's process (not Ray's workers), to put in-memory data there
  (:meth:`~pl_fedsparse.data.FederatedDataModule.place_data`: ``data.device: auto``); without it the data stays
  where the datamodule put it.
* learning rate by round: read :func:`pl_fedsparse.current_fit` in ``configure_optimizers`` (its ``lr_round``: the
  round whose rate the fit uses — ``FineTune(lr: reference)`` asks for round −1) as ``FederatedModule.current_lr``
  does; a module that ignores it trains every round at one rate.

Callbacks that need more than this say so when the federation starts, naming the callback and what to add: FedEM
needs ``backbone`` to be a :class:`~pl_fedsparse.models.Mixture`, PFedGate needs image inputs ``[N, C, H, W]`` for its
gating layer, ``PersonalLayers(mode: fedrep, personal_lr: ...)`` needs an ``lr`` attribute; masks address the
module's parameter names (``state_dict`` keys), which every module has.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from pl_fedsparse.errors import ConfigError, user_code

__all__ = ["check_model", "check_datamodule", "model_name", "training_loss"]


def model_name(model: Any) -> str:
    """``model=<Class>``-style name of the configured module, for messages.

    Example:
        >>> model_name(torch.nn.Linear(1, 1))
        'Linear'
    """
    return type(model).__name__


def _overrides(model: pl.LightningModule, name: str) -> bool:
    """Whether the module's class (or an instance attribute) provides ``name`` instead of LightningModule's stub."""
    if name in vars(model):
        return True
    return getattr(type(model), name, None) is not getattr(pl.LightningModule, name, None)


def check_datamodule(datamodule: Any) -> None:
    """Refuse, in one line, a datamodule that is not a :class:`~pl_fedsparse.data.FederatedDataModule`."""
    from pl_fedsparse.data import FederatedDataModule

    if not isinstance(datamodule, FederatedDataModule):
        raise ConfigError(f"data={type(datamodule).__name__} is invalid: expected a "
                          "pl_fedsparse.data.FederatedDataModule (or a subclass overriding load_base_dataset; see "
                          "docs/your-own-data.md)")


def check_model(model: Any, example: Tensor, num_classes: int, data_label: str) -> None:
    """Check the module protocol (module docstring) on one example batch; raise a one-line :class:`ConfigError`.

    Args:
        model: the configured module.
        example: a batch of inputs as the datamodule yields them (on the CPU).
        num_classes: the dataset's number of classes (the logits' width).
        data_label: how messages name the data (``data.name='cifar10'``, ``data=MyData``).
    """
    name = model_name(model)
    if not isinstance(model, pl.LightningModule):
        raise ConfigError(f"model={name} is invalid: expected a lightning.pytorch.LightningModule (wrap a plain "
                          "torch.nn.Module as the backbone of pl_fedsparse.FederatedModule)")
    for hook, what in (("training_step", "training_step(batch, batch_idx) returning the loss"),
                       ("configure_optimizers", "configure_optimizers() returning the optimizer of a local fit")):
        if not _overrides(model, hook) or not callable(getattr(model, hook, None)):
            raise ConfigError(f"model={name} is invalid: expected a LightningModule that defines {what} (see "
                              "docs/your-own-model.md)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"model={name} is invalid: expected trainable parameters (it has none)")
    for opt in ("fit_metrics", "loss"):
        if hasattr(model, opt) and not callable(getattr(model, opt)):
            raise ConfigError(f"model={name}.{opt} is invalid: expected a method (see docs/your-own-model.md)")
    where = f"the model check: a batch of {example.shape[0]} from {data_label}"
    try:
        with torch.no_grad():
            out = model(example)
    except RuntimeError as e:  # shape/dtype mismatches of the network and the data
        detail = f"model.backbone={type(model.backbone).__name__}" if _has_backbone(model) else f"model={name}"
        raise ConfigError(f"{detail} is invalid: expected a network accepting inputs of shape "
                          f"{tuple(example.shape[1:])} ({example.dtype}) from {data_label} "
                          f"({' '.join(str(e).split())})") from None
    except Exception as e:  # noqa: BLE001 - the user's forward: its own exception, named as such
        with user_code(model, "forward", where):
            raise e
    _check_logits(out, name, num_classes, data_label, example.shape[0], "", _has_backbone(model))
    was_training = model.training
    model.eval()  # evaluation runs the module in eval mode: check that forward too (no random draw, no update)
    try:
        with torch.no_grad(), user_code(model, "forward", where + ", eval mode"):
            out = model(example)
    finally:
        model.train(was_training)
    _check_logits(out, name, num_classes, data_label, example.shape[0], " in eval mode", _has_backbone(model))


def _check_logits(out: Any, name: str, num_classes: int, data_label: str, rows: int, mode: str,
                  has_backbone: bool) -> None:
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise ConfigError(f"model={name} is invalid: expected forward(x) to return a float tensor of logits "
                          f"[batch, {num_classes}], got {type(out).__name__}"
                          f"{'' if not isinstance(out, Tensor) else ' of dtype ' + str(out.dtype)}")
    if out.ndim != 2 or out.shape[1] != num_classes:
        where = "model.backbone.init_args.num_classes" if has_backbone else f"model={name}: its logits' width"
        raise ConfigError(f"{where}={out.shape[-1] if out.ndim else out.shape} is invalid: expected {num_classes} "
                          f"(the number of classes of {data_label}; forward(x){mode} returned shape "
                          f"{tuple(out.shape)})")
    if out.shape[0] != rows:
        raise ConfigError(f"model={name} is invalid: expected forward(x){mode} to return one row of logits per "
                          f"input, got {out.shape[0]} rows for a batch of {rows} from {data_label}")


def _has_backbone(model: Any) -> bool:
    return isinstance(getattr(model, "backbone", None), torch.nn.Module)


def training_loss(module: Any, logits: Tensor, y: Tensor) -> Tensor:
    """The module's ``loss(logits, y)`` when it has one (the optional protocol method), else cross-entropy."""
    loss = getattr(module, "loss", None)
    if callable(loss):
        return loss(logits, y)
    return torch.nn.functional.cross_entropy(logits, y)
