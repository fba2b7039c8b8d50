"""Adaptive inference between a client's personal and the global model: :class:`AdaptiveInference` (DM-PFL+,
Zhang et al. KDD 2023, §3.4 and Alg. 4).

For every test input the client runs both models and predicts with the personal model θ_c iff
``E_c − (1 − Sim)·BE(θ_c) < E_g − (1 − Sim)·BE(θ_g)`` (:func:`~pl_fedsparse.functional.inference.adaptive_choice`),
where ``E`` are the output entropies, ``Sim`` the cosine similarity of the two outputs and ``BE`` the models' base
entropies — their mean output entropy on unshifted inputs. Works with any method that has a global and a personal
model (DM-PFL, FedAvg-FT, Ditto, ...).

Choices the paper leaves open (all options): the base entropies are measured on the client's own **training** data
(unaugmented; ``base_split``), at every evaluation, for the models being evaluated; the cosine similarity compares
the **softmax** outputs (``cosine_on``).

Reported: ``adaptive_acc`` (and ``<view>/adaptive_acc`` on every shift/corruption view) and
``adaptive_chose_personal`` — the fraction of test samples predicted by the personal model — per view. With
``as_personal: true`` the adaptive prediction *is* the client's personal prediction (``acc_mean``), and the plain
personal model is reported as ``personal_only_acc``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.evaluation import EvalView, view_metric_prefix
from pl_fedsparse.functional.inference import adaptive_choice, entropy

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["AdaptiveInference"]

_BASE_VIEW = "adaptive_base"


class AdaptiveInference(FederatedCallback):
    """DM-PFL+'s per-sample choice between the personal and the global model (Alg. 4).

    Args:
        base_split: data of the base entropies: ``"train"`` (the client's training data) or ``"eval"`` (its clean
            evaluation data — optimistic, it is the test data).
        cosine_on: ``"softmax"`` or ``"logits"``: what ``Sim`` compares.
        as_personal: report the adaptive prediction as the personal model's (``acc_mean``; DM-PFL+ as a method).

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.AdaptiveInference
                  init_args: {as_personal: true}
    """

    #: per-evaluation figures, recomputed by every evaluation before they are read (not state a resume needs)
    scratch_attributes = ("base_entropies", "_counts")

    def __init__(self, *, base_split: Literal["train", "eval"] = "train",
                 cosine_on: Literal["softmax", "logits"] = "softmax", as_personal: bool = False) -> None:
        check(base_split in ("train", "eval"), "AdaptiveInference.base_split", base_split, "one of train, eval")
        check(cosine_on in ("softmax", "logits"), "AdaptiveInference.cosine_on", cosine_on, "one of softmax, logits")
        self.base_split = base_split
        self.cosine_on = cosine_on
        self.as_personal = as_personal
        self._counts: dict[str, list[int]] = {}
        #: the last evaluation's base entropies per client: ``{client: (BE(θ_c), BE(θ_g))}``
        self.base_entropies: dict[int, tuple[float, float]] = {}

    @staticmethod
    def _require_global(loop: FederationView) -> None:
        if loop.global_state is None or not loop.eval_global:
            raise ConfigError("trainer.callbacks is invalid: AdaptiveInference needs a global model next to the "
                              "personal ones (a server method, with trainer.eval_global: true)")

    @override
    def on_federation_start(self, loop: FederationView) -> None:
        self._require_global(loop)  # before anything is trained or checkpointed

    @override
    def eval_views(self, loop: FederationView) -> list[EvalView]:
        self._counts = {}  # called once at the start of every evaluation
        self._require_global(loop)
        return [EvalView(_BASE_VIEW, split="train" if self.base_split == "train" else "eval", report=False)]

    @override
    def on_client_predictions(self, loop: FederationView, client_idx: int, outputs: dict[str, dict[str, Tensor]],
                              labels: dict[str, Tensor]) -> None:
        base = outputs[_BASE_VIEW]
        be_c = float(entropy(base["personal"]).mean()) if len(base["personal"]) else 0.0
        be_g = float(entropy(base["global"]).mean()) if len(base["global"]) else 0.0
        self.base_entropies[client_idx] = (be_c, be_g)
        for view, kinds in outputs.items():
            if view == _BASE_VIEW:
                continue
            c, g = kinds["personal"], kinds["global"]
            choose_c = adaptive_choice(c, g, be_c, be_g, self.cosine_on)
            adaptive = torch.where(choose_c[:, None], c, g)
            cnt = self._counts.setdefault(view, [0, 0])
            cnt[0] += int(choose_c.sum())
            cnt[1] += int(choose_c.numel())
            if self.as_personal:
                kinds["personal_only"] = c
                kinds["personal"] = adaptive
            else:
                kinds["adaptive"] = adaptive

    @override
    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        return [("adaptive acc (DM-PFL+)", "adaptive_acc"), ("personal model alone", "personal_only_acc")]

    @override
    def on_evaluation_end(self, loop: FederationView, metrics: dict[str, Any]) -> None:
        if metrics.get("acc_mean") is None:
            return
        for view, (chose_c, total) in self._counts.items():
            metrics[f"{view_metric_prefix(view)}adaptive_chose_personal"] = chose_c / max(total, 1)
        self._counts = {}
