"""What the :class:`~pl_fedsparse.executors.vectorized.VectorizedExecutor` can train exactly, checked when the
federation starts (one-line :class:`~pl_fedsparse.errors.ConfigError` otherwise): the module (its own
``training_step`` only when it says ``vectorizable = True``; no batch statistics, dropout or manual optimization) and
its optimizer (one element-wise ``torch.optim.SGD`` or ``torch.optim.Adam``, no scheduler)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.executors.stacked import ElementwiseOptim

__all__ = ["check_module", "elementwise_optimizer"]


def elementwise_optimizer(module: pl.LightningModule, names: Mapping[int, str]) -> ElementwiseOptim:
    """The element-wise form of what ``configure_optimizers`` returns (one optimizer, no scheduler)."""
    out: Any = module.configure_optimizers()
    where = f"model={type(module).__name__}.configure_optimizers()"
    if isinstance(out, dict):
        if out.get("lr_scheduler") is not None:
            raise ConfigError(f"{where} returns a learning-rate scheduler: the VectorizedExecutor supports none "
                              "(use the learning rate by round, FederatedModule.lr_decay, or the in-process executor)")
        out = out.get("optimizer")
    if isinstance(out, (list, tuple)):
        if len(out) != 1 or isinstance(out[0], (list, tuple)):
            raise ConfigError(f"{where} returns {len(out)} optimizers or schedulers: the VectorizedExecutor "
                              "supports exactly one optimizer")
        out = out[0]
    if isinstance(out, torch.optim.SGD):
        kind: Literal["sgd", "adam"] = "sgd"
    elif isinstance(out, torch.optim.Adam) and type(out) is torch.optim.Adam:
        kind = "adam"
    else:
        raise ConfigError(f"{where} returns {type(out).__name__}: the VectorizedExecutor supports torch.optim.SGD "
                          "and torch.optim.Adam (element-wise updates)")
    lr, hyper, index = {}, {}, {}
    position = -1  # torch.optim numbers every parameter of every group, in order, in its state_dict
    for group in out.param_groups:
        if group.get("maximize") or group.get("amsgrad") or group.get("differentiable"):
            raise ConfigError(f"{where}: maximize, amsgrad and differentiable are not supported by the "
                              "VectorizedExecutor")
        if kind == "sgd":
            h: tuple[Any, ...] = (float(group["momentum"]), float(group["dampening"]), bool(group["nesterov"]),
                                  float(group["weight_decay"]))
        else:
            b1, b2 = group["betas"]
            h = (float(b1), float(b2), float(group["eps"]), float(group["weight_decay"]))
        for p in group["params"]:
            position += 1
            if not p.requires_grad:
                continue
            name = names.get(id(p))
            if name is None:
                raise ConfigError(f"{where} optimizes a tensor that is not one of the module's parameters")
            lr[name], hyper[name], index[name] = float(group["lr"]), h, position
    return ElementwiseOptim(kind, lr, hyper, index)


def check_module(module: pl.LightningModule) -> None:
    """Refuse, in one line, a module the VectorizedExecutor cannot train exactly."""
    from pl_fedsparse.module import FederatedModule

    name = type(module).__name__
    own_step = getattr(type(module), "training_step", None) is not FederatedModule.training_step
    if own_step and not getattr(module, "vectorizable", False):
        raise ConfigError(f"trainer.executor=VectorizedExecutor cannot train model={name}: its training_step is its "
                          "own (set the class attribute vectorizable = True if it is loss(forward(x), y) on (x, y) "
                          "batches, or use the in-process executor)")
    for sub_name, sub in module.named_modules():
        if isinstance(sub, torch.nn.modules.batchnorm._NormBase) and sub.track_running_stats:
            raise ConfigError(f"trainer.executor=VectorizedExecutor cannot train model={name}: {sub_name} "
                              f"({type(sub).__name__}) keeps batch statistics (use GroupNorm, or the in-process "
                              "executor)")
        if isinstance(sub, torch.nn.modules.dropout._DropoutNd) and sub.p > 0:
            raise ConfigError(f"trainer.executor=VectorizedExecutor cannot train model={name}: {sub_name} is a "
                              "dropout layer (its random masks cannot follow each client's stream; use the in-process "
                              "executor)")
    if getattr(module, "automatic_optimization", True) is False:
        raise ConfigError(f"trainer.executor=VectorizedExecutor cannot train model={name}: it uses manual "
                          "optimization")
