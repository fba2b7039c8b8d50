"""Evaluation views: what a client's models are evaluated on besides its own clean test data.

The loop always evaluates every client's models on the *clean* view (its own ``eval_split`` data). Callbacks add
views through :meth:`~pl_fedsparse.callbacks.FederatedCallback.eval_views` — test-time shift (x % of the samples
from the global test distribution), CIFAR-10-C-style corruptions, or an unreported view such as the client's own
training data (DM-PFL+'s base entropies). For every client the loop computes the logits of each model kind
(``"personal"``, ``"global"``) on each view, lets callbacks add kinds built from them
(:meth:`~pl_fedsparse.callbacks.FederatedCallback.on_client_predictions`, e.g. DM-PFL+'s adaptive choice) and
reports the accuracy of every kind on every reported view. A callback may also lend the evaluation models shared by
every client that exist for evaluation only (:func:`shared_models`, e.g. :class:`~pl_fedsparse.callbacks.Gossip`'s
``consensus``, the uniform average of all clients' models): each is one more kind, evaluated on every client's data
like the global model.

=======================  ===================================================================================
metric                   meaning
=======================  ===================================================================================
``acc_mean`` …           personal model, clean view (mean / weighted / std / bottom decile over clients)
``global_acc``           global model, clean view
``<kind>_acc``           an added or shared kind (e.g. ``adaptive_acc``, ``consensus_acc``), clean view; also
                         ``<kind>_acc_weighted`` (for ``global`` too)
``<view>/acc_mean`` …    personal model on a view (e.g. ``shift100/acc_mean``, ``contrast_s5/acc_mean``)
``<view>/global_acc``    global model on a view
``<view>/<kind>_acc``    an added kind on a view
``f1_macro_mean`` …      with ``trainer.eval_metrics: [f1_macro, ece]``: per-client macro-F1 / expected
                         calibration error of the personal model (mean / weighted / std / worst decile:
                         ``f1_macro_bottom10``, ``ece_top10``); ``global_f1_macro``, ``<kind>_ece``, view prefixes
                         as for the accuracy
=======================  ===================================================================================

The extra metrics are computed with torchmetrics' functional API on the per-client logits the evaluator already holds
(one call per client, model kind and view; no per-batch state or sync). Macro-F1 averages over the classes present
in the client's labels or predictions (torchmetrics ignores classes with no true or predicted sample); the
calibration error is torchmetrics' top-label ECE with 15 equal-width bins (L1).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pl_fedsparse.data.loaders import TensorBatchLoader, batch_to
from pl_fedsparse.errors import ConfigError, UserCodeError, check, user_code
from pl_fedsparse.executors.base import load_state
from pl_fedsparse.executors.compiling import graph_outputs_reused
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.transfer import to_host
from pl_fedsparse.metrics import summarize_accuracies, summarize_metric
from pl_fedsparse.view import EvalView

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

log = logging.getLogger(__name__)

__all__ = ["CLEAN", "EvalView", "Evaluator", "kind_metric", "shared_models", "view_metric_prefix"]


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


def shared_models(loop: FederationView) -> dict[str, dict[str, Tensor]]:
    """Evaluation-only models shared by every client, by model kind: what the callbacks' ``eval_models(loop)``
    return (an optional method; e.g. :meth:`pl_fedsparse.callbacks.Gossip.eval_models` gives
    ``{"consensus": state}``).

    Every client's data is evaluated with each of them besides its personal (and the global) model, reported as
    ``<kind>_acc``, ``<kind>_acc_weighted``, ``<view>/<kind>_acc``, ``<kind>_<metric>``. Such a model is no one's
    message: nothing is counted as communication. The evaluator asks in the driver before any forward pass, then
    again wherever a client's forward pass runs (an out-of-process executor's worker asks its replica of the
    callbacks), so a provider returns the same states throughout an evaluation (e.g. computed at the first call and
    dropped in ``on_evaluation_end``).
    """
    out: dict[str, dict[str, Tensor]] = {}
    for cb in loop.fed_callbacks:
        provide = getattr(cb, "eval_models", None)
        for kind, state in (provide(loop) if provide is not None else {}).items():
            check(kind not in ("personal", "global", *out) and bool(kind) and "/" not in kind,
                  f"{type(cb).__name__}.eval_models", kind,
                  "a model kind name without '/', other than personal, global and another callback's kinds")
            out[kind] = state
    return out


#: bins of the expected calibration error
ECE_BINS = 15


def logits_metrics(logits: Tensor, labels: Tensor, extra: Sequence[str] = ()) -> dict[str, float]:
    """Accuracy, mean cross-entropy and sample count of a client's logits, plus the ``extra`` metrics
    (:data:`~pl_fedsparse.metrics.EVAL_METRICS`: ``f1_macro``, ``ece``).

    Example:
        >>> logits_metrics(torch.tensor([[2., 0.], [0., 1.]]), torch.tensor([0, 0]))["acc"]
        0.5
        >>> m = logits_metrics(torch.tensor([[2., 0.], [0., 1.]]), torch.tensor([0, 0]), ["f1_macro"])
        >>> round(m["f1_macro"], 4)  # class 0: precision 1, recall 0.5 -> 2/3; class 1: 0 (predicted, never true)
        0.3333
    """
    out = pending_metrics(logits, labels, extra)
    resolve_metrics([out])
    return out


def pending_metrics(logits: Tensor, labels: Tensor, extra: Sequence[str] = ()) -> dict[str, Any]:
    """:func:`logits_metrics` with the accuracy and the loss not yet read to the host: their sums stay on the logits'
    device until :func:`resolve_metrics` reads many clients' at once (one copy, where one per value would make the
    host wait for the device each time). The same numbers."""
    n = int(labels.shape[0])
    if n == 0:
        return {"acc": 0.0, "loss": 0.0, "n": 0.0, **{name: float("nan") for name in extra}}
    out: dict[str, Any] = {"acc": None, "loss": None, "n": float(n)}
    # (the count and the float32 loss sum are exact in float64: read back, the same floats as read one by one)
    out[_SUMS] = torch.stack([(logits.argmax(1) == labels).sum().double(),
                              torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum").double()])
    if extra:
        from torchmetrics.functional.classification import multiclass_calibration_error, multiclass_f1_score

        c = int(logits.shape[1])
        if "f1_macro" in extra:
            out["f1_macro"] = float(multiclass_f1_score(logits.argmax(1), labels, num_classes=c, average="macro"))
        if "ece" in extra:
            out["ece"] = float(multiclass_calibration_error(logits.float().softmax(1), labels, num_classes=c,
                                                            n_bins=ECE_BINS, norm="l1"))
    return out


#: where :func:`pending_metrics` keeps the sums it has not read yet
_SUMS = "_sums"


def resolve_metrics(metrics: Sequence[dict[str, Any]]) -> None:
    """Fill in the accuracy and loss of every :func:`pending_metrics` dict, reading their sums in one copy per
    device (in place)."""
    pending = [m for m in metrics if _SUMS in m]
    by_device: dict[torch.device, list[dict[str, Any]]] = {}
    for m in pending:
        by_device.setdefault(m[_SUMS].device, []).append(m)
    for group in by_device.values():
        for m, (correct, loss) in zip(group, torch.stack([m[_SUMS] for m in group]).tolist()):
            n = m["n"]
            m["acc"], m["loss"] = correct / n, loss / n
            del m[_SUMS]


def merge_views(views: dict[str, EvalView], new: list[EvalView]) -> None:
    """Add ``new`` to ``views`` (by name); a name used twice for different views is an error."""
    for v in new:
        old = views.get(v.name)
        check(old is None or old == v, "eval_views", v.name, "distinct names for distinct views")
        views[v.name] = v


def merge_loaders(loaders: Sequence[Any]) -> TensorBatchLoader | None:
    """One unshuffled loader over the rows of every loader in ``loaders``, in order, or ``None`` where they cannot be
    one stream: each must be an unshuffled, unaugmented :class:`~pl_fedsparse.data.loaders.TensorBatchLoader`
    selecting ``indices`` of the same inputs and labels, normalised alike.

    Example:
        >>> x, y = torch.arange(6, dtype=torch.uint8).view(6, 1, 1, 1), torch.arange(6)
        >>> a, b = (TensorBatchLoader(x, y, 4, shuffle=False, generator_seed=0, mean=[0], std=[1], indices=i)
        ...         for i in (torch.tensor([4, 0]), torch.tensor([2, 3, 5])))
        >>> [yb.tolist() for _, yb in merge_loaders([a, b])]
        [[4, 0, 2, 3], [5]]
    """
    if not loaders or not all(type(p) is TensorBatchLoader for p in loaders):
        return None
    first = loaders[0]
    alike = all(p.images is first.images and p.labels is first.labels and p.indices is not None
                and not p.shuffle and not p.augment and not p.drop_last and p.mean == first.mean and p.std == first.std
                and p.batch_size == first.batch_size for p in loaders)
    if not alike:
        return None
    return TensorBatchLoader(first.images, first.labels, first.batch_size, shuffle=False, generator_seed=0,
                             mean=first.mean, std=first.std, indices=torch.cat([p.indices for p in loaders]))


def _same_state(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Whether two states hold the same tensors, value for value (``torch.equal``'s answer for every entry: a NaN
    equals nothing), read in one copy per device rather than one wait per tensor.

    Example:
        >>> x = {"w": torch.ones(2), "b": torch.tensor([float("nan")])}
        >>> _same_state(x, {"w": torch.ones(2), "b": x["b"]}), _same_state(x, {"w": torch.ones(2), "b": torch.zeros(1)})
        (False, False)
        >>> _same_state({"w": torch.ones(2)}, {"w": torch.ones(2)}), _same_state({"w": torch.ones(2)}, {"w": torch.ones(3)})
        (True, False)
    """
    if a.keys() != b.keys():
        return False
    pairs = [(a[k], b[k].to(a[k].device)) for k in a]
    if any(x.shape != y.shape or x.dtype != y.dtype for x, y in pairs):
        return all(torch.equal(x, y) for x, y in pairs)  # (shapes or dtypes differ: torch.equal's own rules)
    flags: dict[torch.device, list[Tensor]] = {}
    for x, y in pairs:
        flags.setdefault(x.device, []).append(torch.eq(x, y).all())
    return all(bool(torch.stack(f).all()) for f in flags.values())


class Evaluator:
    """Evaluates every client's models — ``"personal"``, the ``"global"`` one when there is one, and the shared
    evaluation-only ones (:func:`shared_models`) — on every view.

    For each client: one loader per distinct view (shifted / corrupted once, shared by every model kind); for each
    model kind, its state is loaded into the working module, ``on_client_evaluate_start`` lets callbacks adjust it
    (e.g. apply a mask), the logits of every view are computed (mixed precision as in training) and
    ``on_client_evaluate_end`` sees the clean metrics. When the personal model is the global model and, after those
    hooks, the module holds exactly the weights it held for the personal kind, the logits are reused instead of
    recomputed (the weights are compared only in that case). Then ``on_client_predictions`` may add
    kinds built from the logits (e.g. an adaptive choice), and every kind is reported on every reported view.

    **One stream for a shared model.** A model that is the same for every client — the global model, the personal
    model when no callback owns ``personal_state`` (FedAvg), a :func:`shared_models` kind (D-PSGD's consensus) — is
    evaluated on every client's data of a view as one stream of ``data.eval_batch_size`` batches instead of one short
    run per client, when every callback's
    :meth:`~pl_fedsparse.callbacks.FederatedCallback.evaluation_start_is_shared` says its
    ``on_client_evaluate_start`` treats that kind alike for every client and the view's per-client loaders select
    rows of one in-memory tensor (the clean view, shift views; a corrupted view is built per client and evaluated per
    client, as before). Then ``on_client_evaluate_start`` is called once for the stream (with the first client) and
    again before a client's other views, ``on_client_evaluate_end`` once per client with its own clean metrics. Each
    client's logits are its slice of the stream: with a per-sample forward pass (no batch statistics in ``eval``
    mode) they are the per-client ones up to the last bits: on one CPU thread they were bitwise equal in every
    measurement; with several threads, or on a GPU, another batch size may make a kernel split the work otherwise
    and move a logit's last bits (the tests compare metrics to 1e-6). A module whose ``eval``-mode forward pass
    mixes the samples of a batch (checked once on two inputs) is never streamed. ``stream_shared = False`` (an
    attribute of the evaluator) turns it off; an out-of-process executor's evaluation is unchanged (per client, in
    its workers).
    """

    #: evaluate models shared by every client as one stream per view (see the class doc)
    stream_shared: bool = True

    def __init__(self, loop: FederationView, device_type: str | None = None,
                 fixed_batch_size: int | None = None) -> None:
        self.loop = loop
        self._independent: tuple[Any, bool] | None = None  # (module, answer): see samples_independent
        #: the type of device ``data.eval_batch_size: null`` is chosen for (the loop's; set by
        #: :meth:`choose_batch_size`, ``None`` before: where the data lives)
        self.device_type = device_type
        #: the evaluation batch size on every device where ``data.eval_batch_size`` is null and the evaluation
        #: depends on the batch (``data.batch_size``; set by :meth:`choose_batch_size`), else ``None``
        self.fixed_batch_size = fixed_batch_size

    def choose_batch_size(self, device_type: str) -> None:
        """Decide what ``data.eval_batch_size: null`` means for this federation on a ``device_type`` device (the
        loop calls it once the module, the data and every callback are set up). It is the device's throughput choice
        (:data:`~pl_fedsparse.data.datamodule.AUTO_EVAL_BATCH_SIZE`) only where predictions do not depend on the
        batch; where they do (a callback's ``evaluation_batch_matters``, a module whose eval forward mixes the
        samples of a batch) it is ``data.batch_size`` on every device, so the metrics do not change with the
        hardware. The data module is only read: the choice is the evaluator's."""
        loop = self.loop
        datamodule = loop.datamodule
        self.device_type = device_type
        self.fixed_batch_size = None
        batch_size = getattr(datamodule, "batch_size", None)
        if getattr(datamodule, "eval_batch_size", None) is not None or not isinstance(batch_size, int):
            return
        why = [type(cb).__name__ for cb in loop.fed_callbacks if cb.evaluation_batch_matters(loop)]
        if not why and not self.samples_independent():
            why = [type(loop.model).__name__]
        if why:
            self.fixed_batch_size = batch_size
            log.info("data.eval_batch_size: null is %d (data.batch_size) on every device: %s's evaluation depends on "
                     "the batch", batch_size, ", ".join(why))

    def batch_size(self, device: str | None = None) -> int:
        """The evaluation batch size: ``data.eval_batch_size``, or when it is null the size :meth:`choose_batch_size`
        fixed for every device, else the data module's throughput choice for ``device`` (default: the loop's)."""
        datamodule = self.loop.datamodule
        if getattr(datamodule, "eval_batch_size", None) is None and self.fixed_batch_size is not None:
            return int(self.fixed_batch_size)
        return int(datamodule.eval_batch(device if device is not None else self.device_type))

    def loader(self, client_idx: int, split: str, shift: float = 0.0, corruption: str | None = None,
               severity: int = 0) -> Any:
        loop = self.loop
        return loop.datamodule.eval_loader(client_idx, split=split, shift=shift,
                                           seed=loop.streams.seed("eval", client_idx), corruption=corruption,
                                           severity=severity, batch_size=self.batch_size())

    def logits(self, loader: Any, where: str = "") -> tuple[Tensor, Tensor]:
        """CPU float logits and labels of the working module over an evaluation loader (autocast as in training),
        gathered on the device and copied to the host once.

        The module's forward is the user's code: what it raises, or logits that are not one row per input, end in one
        :class:`~pl_fedsparse.errors.UserCodeError` line naming ``where`` (client, round, model kind)."""
        loop = self.loop
        assert loop.model is not None
        device = loop.device
        # moved outside inference mode: a module moved inside it gets inference-tensor parameters, which the next
        # training fit of the same working module cannot use ("Inference tensors cannot be saved for backward")
        module = loop.model.to(device)
        module.eval()
        dtype = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(loop.precision)
        autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        logits, labels = [], []
        copy = graph_outputs_reused(module)  # (CUDA graphs: a batch's logits are overwritten by the next batch's)
        where = f"{where}, " if where else ""
        where += f"round {loop.round_idx}, evaluation"
        with torch.inference_mode():
            for x, y in loader:
                x, y = batch_to(x, y, device, non_blocking=True)
                with autocast, user_code(module, "forward", where):
                    out = module(x)
                if not isinstance(out, Tensor) or out.ndim != 2 or out.shape[0] != x.shape[0]:
                    shape = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
                    raise UserCodeError(f"{type(module).__qualname__}.forward returned {shape} for a batch of "
                                        f"{x.shape[0]} inputs ({where}); expected logits [batch, classes]")
                logits.append(out.to(torch.float32, copy=copy))  # kept where they are: no wait for the device
                labels.append(y)
            if logits:  # all of them to the host in one copy
                both = to_host({"logits": torch.cat(logits), "labels": torch.cat(labels)})
                all_logits, all_labels = both["logits"], both["labels"]
        module.train()
        if not logits:
            return torch.zeros(0, int(loop.datamodule.num_classes)), torch.zeros(0, dtype=torch.long)
        return all_logits, all_labels

    def views(self) -> dict[str, EvalView]:
        """The views of the coming evaluation: the clean one plus every callback's."""
        views: dict[str, EvalView] = {CLEAN.name: CLEAN}
        for cb in self.loop.fed_callbacks:
            with user_code(cb, "eval_views", f"round {self.loop.round_idx}"):
                mine = list(cb.eval_views(self.loop))
            merge_views(views, mine)
        dm = self.loop.datamodule
        if not getattr(dm, "supports_corruptions", True):
            bad = [v.name for v in views.values() if v.corruption is not None]
            if bad:
                raise ConfigError(f"trainer.callbacks is invalid: evaluation views {bad} corrupt images, but "
                                  f"{dm.source_label()} has {dm.input_kind} inputs; expected no corruption views")
        return views

    def _view_loader(self, k: int, split: str, v: EvalView) -> Any:
        return self.loader(k, "train" if v.split == "train" else split, v.shift, v.corruption, v.severity)

    def forward(self, k: int, split: str, views: dict[str, EvalView], has_global: bool,
                streamed: Mapping[str, Mapping[tuple, tuple[Tensor, Tensor]]] | None = None
                ) -> tuple[dict[str, dict[str, Tensor]], dict[str, Tensor]]:
        """Client ``k``'s logits of every model kind on every view, and the labels of every view: the forward part
        of an evaluation, with the ``on_client_evaluate_start``/``_end`` hooks (an out-of-process executor runs it
        in its workers, :meth:`~pl_fedsparse.executors.ClientExecutor.forward_clients`).

        ``streamed[kind][view key]``: this client's results already computed in one stream (:meth:`forward_shared`);
        such a kind computes only its other views here, and its ``on_client_evaluate_end`` was called already.
        """
        loop = self.loop
        assert loop.model is not None
        streamed = streamed or {}
        personal = loop.personal_state(k)
        kinds = [("personal", personal)] + ([("global", loop.global_state)] if has_global else [])
        kinds += list(shared_models(loop).items())  # e.g. the consensus: evaluated like the global model
        keys = list(dict.fromkeys(v.key for v in views.values()))
        todo = {kind: [key for key in keys if key not in streamed.get(kind, {})] for kind, _ in kinds}
        loaders: dict[tuple, Any] = {}
        for v in views.values():
            if v.key not in loaders and any(v.key in t for t in todo.values()):
                loaders[v.key] = self._view_loader(k, split, v)
        # the global logits can only be the personal ones when both kinds start from the same state
        may_reuse = has_global and personal is loop.global_state
        outputs: dict[str, dict[str, Tensor]] = {name: {} for name in views}
        labels: dict[str, Tensor] = {}
        evaluated: dict[str, Tensor] | None = None  # the weights the personal logits were computed with
        personal_results: dict[tuple, tuple[Tensor, Tensor]] = {}
        for kind, st in kinds:
            results = dict(streamed.get(kind, {}))
            if todo[kind]:
                load_state(loop.model, st)  # type: ignore[arg-type]
                loop.call("on_client_evaluate_start", loop.model, k, kind)
                current = ({n: t.detach().clone() for n, t in loop.model.state_dict().items()} if may_reuse
                           else None)
                if (kind == "global" and evaluated is not None and current is not None
                        and _same_state(evaluated, current) and all(key in personal_results for key in todo[kind])):
                    results.update({key: personal_results[key] for key in todo[kind]})  # same weights, same logits
                else:
                    results.update({key: self.logits(loaders[key], f"client {k}, {kind} model")
                                    for key in todo[kind]})
                if kind == "personal":
                    evaluated, personal_results = current, results
                if kind not in streamed:
                    loop.call("on_client_evaluate_end", loop.model, k, kind, logits_metrics(*results[CLEAN.key]))
            for name, v in views.items():
                outputs[name][kind], labels[name] = results[v.key]
        return outputs, labels

    def samples_independent(self) -> bool:
        """Whether the module's ``eval``-mode forward pass treats the samples of a batch independently (checked once,
        on the data module's first two inputs: together and one by one). A module that does not (batch statistics
        at evaluation, say) is evaluated client by client, never in a stream mixing clients' samples."""
        loop = self.loop
        assert loop.model is not None
        if self._independent is None or self._independent[0] is not loop.model:
            module, was_training = loop.model, loop.model.training
            x = loop.datamodule.example_input(2).to(loop.device)
            transfer.mark_placed((x,), loop.device)  # (a device run simulated on the CPU: on "the device")
            module.to(loop.device).eval()
            try:
                copy = graph_outputs_reused(module)  # (CUDA graphs: each call's outputs overwritten by the next's)
                with torch.no_grad():
                    together = module(x).to(torch.float32, copy=copy)
                    alone = torch.cat([module(x[i:i + 1]).to(torch.float32, copy=copy) for i in range(len(x))])
                # (NaN where the rows are NaN alone too is no mixing: a diverged model is evaluated, not misnamed)
                self._independent = (module, bool(torch.allclose(together, alone, rtol=1e-4, atol=1e-5,
                                                                 equal_nan=True)))
            finally:
                module.train(was_training)
            if not self._independent[1]:
                log.warning("%s's forward pass in eval mode mixes the samples of a batch: every client is evaluated "
                            "on its own batches (its metrics then depend on data.eval_batch_size; null is "
                            "data.batch_size on every device)", type(module).__name__)
        return self._independent[1]

    def _shared_kinds(self, has_global: bool) -> list[tuple[str, dict[str, Tensor]]]:
        """The kinds whose model is the same for every client and whose start hooks treat every client alike."""
        loop = self.loop
        kinds: list[tuple[str, dict[str, Tensor]]] = []
        if has_global:
            if loop.policy_owner("personal_state") is None:  # the default policy: the global model itself
                kinds.append(("personal", loop.global_state))  # type: ignore[arg-type]
            kinds.append(("global", loop.global_state))  # type: ignore[arg-type]
        kinds += list(shared_models(loop).items())
        return [(kind, st) for kind, st in kinds
                if all(cb.evaluation_start_is_shared(loop, kind) for cb in loop.fed_callbacks)]

    def forward_shared(self, clients: Sequence[int], split: str, views: dict[str, EvalView], has_global: bool
                      ) -> list[dict[str, dict[tuple, tuple[Tensor, Tensor]]]]:
        """Every client's results of the shared kinds (:meth:`_shared_kinds`) on the views that can be streamed,
        each kind's model evaluated once per view over the concatenation of every client's rows (see the class
        doc); ``[{}] * len(clients)`` when nothing can be streamed. Calls ``on_client_evaluate_start`` once per
        kind and ``on_client_evaluate_end`` once per client and kind."""
        loop = self.loop
        assert loop.model is not None
        none: list[dict[str, dict[tuple, tuple[Tensor, Tensor]]]] = [{} for _ in clients]
        if not self.stream_shared or len(clients) < 2 or not self.samples_independent():
            return none
        kinds = self._shared_kinds(has_global)
        if not kinds:
            return none
        streams: dict[tuple, tuple[Any, list[int]]] = {}
        for v in views.values():
            if v.corruption is None and v.key not in streams:  # a corrupted view is built per client: not here
                parts = [self._view_loader(k, split, v) for k in clients]
                merged = merge_loaders(parts)
                if merged is not None:
                    streams[v.key] = (merged, [p.num_samples for p in parts])
        if CLEAN.key not in streams:  # every client's clean metrics go to its on_client_evaluate_end
            return none
        out = none
        done: list[tuple[dict[str, Tensor], dict[tuple, list[tuple[Tensor, Tensor]]]]] = []
        for kind, st in kinds:
            load_state(loop.model, st)
            loop.call("on_client_evaluate_start", loop.model, clients[0], kind)
            weights = {n: t.detach().clone() for n, t in loop.model.state_dict().items()}
            per_client = next((res for w, res in done if _same_state(w, weights)), None)  # FedAvg: personal = global
            if per_client is None:
                per_client = {}
                for key, (loader, counts) in streams.items():
                    logits, labels = self.logits(loader, f"clients {clients[0]}-{clients[-1]}, {kind} model")
                    per_client[key] = list(zip(logits.split(counts), labels.split(counts)))
                done.append((weights, per_client))
            # every client's clean metrics of this kind read in one copy (one wait on a device, not one a client),
            # then handed to on_client_evaluate_end client by client, the kind's model still loaded
            metrics = [pending_metrics(*per_client[CLEAN.key][i]) for i in range(len(clients))]
            resolve_metrics(metrics)
            for i, k in enumerate(clients):
                out[i][kind] = {key: res[i] for key, res in per_client.items()}
                loop.call("on_client_evaluate_end", loop.model, k, kind, metrics[i])
        return out

    def _summarize(self, k: int, views: dict[str, EvalView], outputs: dict[str, dict[str, Tensor]],
                   labels: dict[str, Tensor]) -> dict[str, dict[str, dict[str, float]]]:
        self.loop.call("on_client_predictions", k, outputs, labels)
        extra = self.loop.eval_metrics
        return {name: {kind: pending_metrics(lg, labels[name], extra) for kind, lg in kinds_out.items()}
                for name, kinds_out in outputs.items() if views[name].report}

    @staticmethod
    def _progress_label(views: dict[str, EvalView], models: int) -> str:
        """``"evaluating clients (51 views x 2 models)"``: what each step of the evaluation progress bar covers."""
        return f"evaluating clients ({len(views)} view{'s' * (len(views) > 1)} x {models} model{'s' * (models > 1)})"

    def evaluate(self, split: str) -> dict[str, Any]:
        """Metrics of every model kind on every reported view, plus ``client_acc`` (the clean personal accuracy of
        every client)."""
        loop = self.loop
        views = self.views()
        has_global = loop.global_state is not None and loop.eval_global
        # here, in the driver, before the forward passes run (here or in an executor's workers): a provider builds its
        # shared models from every client's state now (the workers hold only their clients' state)
        models = 1 + has_global + len(shared_models(loop))
        clients = list(range(loop.num_clients))
        spread = loop.executor.forward_clients(clients, split, views, has_global)  # None: here
        # clients done / total, on a terminal only (as the rounds' bar; an out-of-process executor has already
        # computed every forward here): the order and the numbers are unchanged
        todo = list(enumerate(clients))
        # the shared models, all clients at once
        streamed = self.forward_shared(clients, split, views, has_global) if spread is None else []
        if spread is None:
            todo = loop.reporter.progress(todo, self._progress_label(views, models), leave=False)
        per_client = [self._summarize(k, views, *(spread[i] if spread is not None else
                                                  self.forward(k, split, views, has_global, streamed[i])))
                      for i, k in todo]
        resolve_metrics([m for pc in per_client for kinds in pc.values() for m in kinds.values()])  # one read
        out: dict[str, Any] = {}
        for name, v in views.items():
            if not v.report:
                continue
            prefix = view_metric_prefix(name)
            with_data = [pc for pc in per_client if pc[name]["personal"]["n"] > 0]  # clients without data: no say
            nv = [int(pc[name]["personal"]["n"]) for pc in with_data]
            for kind in per_client[0][name] if per_client else []:
                s = summarize_accuracies([pc[name][kind]["acc"] for pc in with_data], nv)
                if kind == "personal":
                    out.update({f"{prefix}{key}": val for key, val in s.items()})
                    if name == CLEAN.name:
                        out["loss_mean"] = (float(np.mean([pc[name][kind]["loss"] for pc in with_data])) if with_data
                                            else None)
                        if len(with_data) < len(per_client):  # the client metrics average those with data only
                            out["eval_clients"] = len(with_data)
                else:
                    out[f"{prefix}{kind_metric(kind)}"] = s["acc_mean"]
                    out[f"{prefix}{kind}_acc_weighted"] = s["acc_weighted"]
                for metric in loop.eval_metrics:
                    m = summarize_metric(metric, [pc[name][kind][metric] for pc in with_data], nv)
                    if kind == "personal":
                        out.update({f"{prefix}{key}": val for key, val in m.items()})
                    else:
                        out[f"{prefix}{kind}_{metric}"] = m[f"{metric}_mean"]
        out.setdefault("global_acc", None)
        loop.call("on_evaluation_end", out)
        out["client_acc"] = [pc[CLEAN.name]["personal"]["acc"] for pc in per_client]
        return out
