"""Evaluation views: what a client's models are evaluated on besides its own clean test data.

The loop always evaluates every client's models on the *clean* view (its own ``eval_split`` data). Callbacks add
views through :meth:`~pl_fedsparse.callbacks.FederatedCallback.eval_views` — test-time shift (x % of the samples
from the global test distribution), CIFAR-10-C-style corruptions, or an unreported view such as the client's own
training data (DM-PFL+'s base entropies). For every client the loop computes the logits of each model kind
(``"personal"``, ``"global"``) on each view, lets callbacks add kinds built from them
(:meth:`~pl_fedsparse.callbacks.FederatedCallback.on_client_predictions`, e.g. DM-PFL+'s adaptive choice) and
reports the accuracy of every kind on every reported view:

=======================  ===================================================================================
metric                   meaning
=======================  ===================================================================================
``acc_mean`` …           personal model, clean view (mean / weighted / std / bottom decile over clients)
``global_acc``           global model, clean view
``<kind>_acc``           an added kind (e.g. ``adaptive_acc``), clean view
``<view>/acc_mean`` …    personal model on a view (e.g. ``shift100/acc_mean``, ``contrast_s5/acc_mean``)
``<view>/global_acc``    global model on a view
``<view>/<kind>_acc``    an added kind on a view
=======================  ===================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from pl_fedsparse.data.corruptions import CORRUPTIONS
from pl_fedsparse.errors import check

__all__ = ["CLEAN", "EvalView", "kind_metric", "view_metric_prefix"]


@dataclass(frozen=True)
class EvalView:
    """One evaluation view of a client's data.

    Args:
        name: metric prefix (``"clean"`` is the loop's own view and has no prefix).
        split: ``"eval"`` (the loop's ``eval_split``, i.e. test or val) or ``"train"`` (the client's training data,
            unshuffled and unaugmented).
        shift: fraction of samples replaced by samples of the global test distribution (DM-PFL §4.1).
        corruption: a CIFAR-10-C corruption name (:data:`~pl_fedsparse.data.corruptions.CORRUPTIONS`) or ``None``.
        severity: corruption severity 1-5 (ignored without a corruption).
        report: whether the loop reports metrics for this view (``False`` for auxiliary views).
    """

    name: str
    split: Literal["eval", "train"] = "eval"
    shift: float = 0.0
    corruption: str | None = None
    severity: int = 0
    report: bool = True

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, "EvalView.name", self.name, "a non-empty name without '/'")
        check(self.split in ("eval", "train"), "EvalView.split", self.split, "one of eval, train")
        check(0.0 <= self.shift <= 1.0, "EvalView.shift", self.shift, "a number in [0, 1]")
        check(self.corruption is None or self.corruption in CORRUPTIONS, "EvalView.corruption", self.corruption,
              "null or one of " + ", ".join(CORRUPTIONS))
        check(self.corruption is None or 1 <= self.severity <= 5, "EvalView.severity", self.severity,
              "an int in 1..5")

    @property
    def key(self) -> tuple:
        """Views with equal keys see the same samples (their logits are computed once)."""
        return (self.split, float(self.shift), self.corruption, self.severity if self.corruption else 0)


#: the loop's own view: the client's clean ``eval_split`` data
CLEAN = EvalView("clean")


def view_metric_prefix(view_name: str) -> str:
    """``""`` for the clean view, ``"<name>/"`` otherwise.

    Example:
        >>> view_metric_prefix("clean"), view_metric_prefix("shift20")
        ('', 'shift20/')
    """
    return "" if view_name == CLEAN.name else f"{view_name}/"


def kind_metric(kind: str) -> str:
    """Metric name of a model kind's mean accuracy.

    Example:
        >>> kind_metric("personal"), kind_metric("global"), kind_metric("adaptive")
        ('acc_mean', 'global_acc', 'adaptive_acc')
    """
    return {"personal": "acc_mean", "global": "global_acc"}.get(kind, f"{kind}_acc")


def logits_metrics(logits: Tensor, labels: Tensor) -> dict[str, float]:
    """Accuracy, mean cross-entropy and sample count of a client's logits.

    Example:
        >>> logits_metrics(torch.tensor([[2., 0.], [0., 1.]]), torch.tensor([0, 0]))["acc"]
        0.5
    """
    n = int(labels.shape[0])
    if n == 0:
        return {"acc": 0.0, "loss": 0.0, "n": 0.0}
    acc = float((logits.argmax(1) == labels).sum()) / n
    loss = float(torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum")) / n
    return {"acc": acc, "loss": loss, "n": float(n)}


def merge_views(views: dict[str, EvalView], new: list[EvalView]) -> None:
    """Add ``new`` to ``views`` (by name); a name used twice for different views is an error."""
    for v in new:
        old = views.get(v.name)
        check(old is None or old == v, "eval_views", v.name, "distinct names for distinct views")
        views[v.name] = v
