"""Test-time shift evaluation for every method: :class:`ShiftEvaluation` (DM-PFL, Zhang et al. KDD 2023, §4.1).

Two kinds of shift, both reported for every model kind the method has (personal, global, adaptive, ...):

* **x % shift** — x % of each client's test samples are replaced by samples drawn from the global test distribution
  (:func:`~pl_fedsparse.data.shift.shifted_test_split`); x ∈ {0, 20, 40, 60, 80, 100} by default (Table 1).
* **corruptions** — CIFAR-10-C-style corruptions of the client's own test samples at Hendrycks & Dietterich's five
  severities, generated on the fly from the clean data (:mod:`pl_fedsparse.data.corruptions`).

Metrics (``metrics.jsonl`` and TensorBoard, see :mod:`pl_fedsparse.evaluation`): ``shift<x>/acc_mean``,
``shift<x>/global_acc``, ... per level (the 0 % level is the clean ``acc_mean``), ``shift_avg/<metric>`` the average
over the levels (Table 1's "average"), ``<corruption>_s<severity>/acc_mean`` per corruption and severity and
``corruption_avg/<metric>`` their average.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback
from pl_fedsparse.data.corruptions import CORRUPTION_NAMES, CORRUPTIONS
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.evaluation import CLEAN, EvalView, view_metric_prefix

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["ShiftEvaluation"]

_AVERAGED = ("acc_mean", "acc_weighted", "acc_bottom10", "global_acc")


class ShiftEvaluation(FederatedCallback):
    """Evaluate every client's models under test-time distribution shift.

    Args:
        shifts: shift fractions in ``[0, 1]`` (DM-PFL: 0, .2, .4, .6, .8, 1).
        corruptions: corruption names among :data:`~pl_fedsparse.data.corruptions.CORRUPTION_NAMES` (the
            published 15 need ``data.cifar10c_root``); ``"all"`` for every one the data module can give (the
            generator's :data:`~pl_fedsparse.data.corruptions.CORRUPTIONS`, or all 15 with the published arrays);
            ``[]`` for none.
        severities: corruption severities (1-5; Hendrycks & Dietterich use all five).
        when: ``"last"`` (only at the final evaluation: shift views cost one evaluation pass each) or ``"every"``
            (at every evaluation).

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.ShiftEvaluation
                  init_args: {shifts: [0, 0.5, 1.0], corruptions: [gaussian_noise, contrast], severities: [3, 5]}
    """

    #: arguments that may change when a run is resumed (they only change what is evaluated, and when)
    resume_may_change: tuple[str, ...] = ("when",)
    #: only evaluates: a run with FedAvg and this callback is labelled ``FedAvg`` by ``pl-fed report``
    evaluation_only = True

    def __init__(self, *, shifts: list[float] | None = None, corruptions: list[str] | str | None = None,
                 severities: list[int] | None = None, when: Literal["last", "every"] = "last") -> None:
        shifts = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0] if shifts is None else shifts
        for x in shifts:
            check(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1,
                  "ShiftEvaluation.shifts", x, "numbers in [0, 1]")
        #: ``"all"``: every corruption the data module can give, resolved when the federation starts (the generator's
        #: nine, or with ``data.cifar10c_root`` the published 15 and the generator's others)
        self.all_corruptions = corruptions == "all"
        corruptions = list(CORRUPTIONS) if self.all_corruptions else list(corruptions or [])
        for c in corruptions:
            check(c in CORRUPTION_NAMES, "ShiftEvaluation.corruptions", c,
                  "'all' or names among " + ", ".join(CORRUPTION_NAMES))
        severities = [1, 2, 3, 4, 5] if severities is None else severities
        for s in severities:
            check(isinstance(s, int) and not isinstance(s, bool) and 1 <= s <= 5, "ShiftEvaluation.severities", s,
                  "ints in 1..5")
        check(when in ("last", "every"), "ShiftEvaluation.when", when, "one of last, every")
        self.shifts = sorted({float(x) for x in shifts})
        self.corruptions = corruptions
        self.severities = sorted(set(severities))
        self.when = when

    @staticmethod
    def shift_view_name(shift: float) -> str:
        """``"clean"`` for 0, else ``"shift<percent>"``.

        Example:
            >>> ShiftEvaluation.shift_view_name(0.0), ShiftEvaluation.shift_view_name(0.2)
            ('clean', 'shift20')
        """
        return CLEAN.name if shift == 0 else f"shift{round(100 * shift):d}"

    def views(self) -> list[EvalView]:
        """All views this callback evaluates (the 0 % level is the loop's clean view)."""
        out = [EvalView(self.shift_view_name(x), shift=x) for x in self.shifts if x > 0]
        out += [EvalView(f"{c}_s{s}", corruption=c, severity=s) for c in self.corruptions for s in self.severities]
        return out

    @override
    def setup_federation(self, loop: FederationView) -> None:
        dm = loop.datamodule
        if self.corruptions and not getattr(dm, "supports_corruptions", True):
            raise ConfigError(f"ShiftEvaluation.corruptions={self.corruptions!r} is invalid: expected [] for "
                              f"{dm.source_label()} (corruptions are image transforms; its inputs are "
                              f"{dm.input_kind}); shifts work for any data")
        available = getattr(dm, "available_corruptions", None)
        if available is None or not self.corruptions:
            return
        if self.all_corruptions:
            self.corruptions = list(available)
        missing = [c for c in self.corruptions if c not in available]
        if missing:
            raise ConfigError(f"ShiftEvaluation.corruptions={missing!r} is invalid: the generator makes only "
                              f"{', '.join(CORRUPTIONS)}; the others are read from the published CIFAR-10-C arrays "
                              "(set data.cifar10c_root to their folder)")

    def _due(self, loop: FederationView) -> bool:
        return self.when == "every" or loop.round_idx >= loop.num_rounds - 1

    @override
    def eval_views(self, loop: FederationView) -> list[EvalView]:
        return self.views() if self._due(loop) else []

    @override
    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        return [("personal acc @ 100 % shift", "shift100/acc_mean"), ("global acc @ 100 % shift", "shift100/global_acc"),
                ("personal acc, mean over shifts", "shift_avg/acc_mean"),
                ("personal acc, mean over corruptions", "corruption_avg/acc_mean")]

    @override
    def on_evaluation_end(self, loop: FederationView, metrics: dict[str, Any]) -> None:
        views = self.views()
        if not views or f"{views[0].name}/acc_mean" not in metrics:  # not evaluated under shift this round
            return
        kinds = [k for k in metrics if "/" not in k and (k in _AVERAGED or k.endswith("_acc"))]
        groups = {"shift_avg": [self.shift_view_name(x) for x in self.shifts],
                  "corruption_avg": [f"{c}_s{s}" for c in self.corruptions for s in self.severities]}
        for group, names in groups.items():
            if not names:
                continue
            for key in kinds:
                vals = [metrics.get(f"{view_metric_prefix(n)}{key}") for n in names]
                if all(isinstance(v, float) for v in vals):
                    metrics[f"{group}/{key}"] = sum(vals) / len(vals)  # type: ignore[arg-type]
