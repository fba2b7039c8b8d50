"""The extension API: :class:`FederatedCallback`.

A ``FederatedCallback`` is a :class:`lightning.pytorch.Callback`: every Lightning hook keeps its meaning and fires
inside one client's local fit (``on_train_batch_end``, ``on_before_optimizer_step``, ...); inside them,
:func:`~pl_fedsparse.context.current_fit` says which fit it is. On top of those it has federation hooks, which the
:class:`~pl_fedsparse.loop.FederatedLoop` calls with itself as first argument (as Lightning passes the trainer);
the hooks are annotated with what they may read of it, :class:`~pl_fedsparse.view.FederationView`.
``docs/extending.md`` lists them in the order they fire (a test keeps that table true).

=========================================  ==========================================================================
broadcast hooks (every callback, -> None)  ``setup_federation``, ``on_federation_start``, ``on_round_start``,
                                           ``on_client_message``, ``on_client_fit_start``, ``on_client_fit_end``,
                                           ``on_before_aggregate``, ``on_after_aggregate``,
                                           ``on_client_evaluate_start``, ``on_client_evaluate_end``,
                                           ``on_client_predictions``, ``on_evaluation_end``, ``on_round_end``,
                                           ``on_federation_end``
collected hooks (every callback's list)    ``fit_requests`` (extra fits, run by the loop at a stage; results go to
                                           the requester's ``on_requested_fits_end``), ``eval_views``,
                                           ``report_rows``
policies (one owner, return a value)       ``select_clients``, ``client_message``, ``aggregate``, ``personal_state``,
                                           ``client_masks``
=========================================  ==========================================================================

A policy is *owned* by a callback whose class overrides it; two owners of one policy is a configuration error.
Without an owner the loop uses its defaults: uniform seeded sampling, the dense global model as the downstream
message, sample-weighted FedAvg, the global model as every client's personal model, and no masks.

Per-client state is declared, not hand-serialised::

    class CountRounds(FederatedCallback):
        def setup_federation(self, loop):
            self.add_client_state(loop, "rounds", lambda k: torch.zeros((), dtype=torch.long))

        def on_client_fit_end(self, loop, module, update):
            if update.kind == "train":
                k = update.client_idx
                self.set_client_state(loop, k, "rounds", self.get_client_state(loop, k, "rounds") + 1)

The loop creates every client's entries when the federation starts, keeps them compact on CPU, ships a client's
entries with each of its fits, checkpoints them and restores them on resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from pl_fedsparse.client import ClientUpdate, Message, StateInit, TensorTree
from pl_fedsparse.context import FitContext, FitSpec, FitStage
from pl_fedsparse.executors.compiling import graph_outputs_reused, outside_graphs
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.shadowing import replace_methods, restore_methods
from pl_fedsparse.view import EvalView

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["POLICIES", "FederatedCallback", "declares", "fits_device", "graph_outputs_reused", "message_device",
           "outside_graphs", "replace_methods", "restore_methods", "takes_device_update"]
#: methods a callback overrides to declare something, asked once when the federation starts (not hooks that fire)
DECLARATIONS = ("vectorized_fit", "evaluation_start_is_shared", "evaluation_batch_matters")

POLICIES: tuple[str, ...] = ("select_clients", "client_message", "aggregate", "personal_state", "client_masks")


def takes_device_update(callbacks: Sequence[Any]) -> bool:
    """Whether every callback with an ``on_client_fit_end`` takes the update where the weights are: for each, the
    class in its MRO that defines the hook sets ``device_update = True`` in its own body (a user's override of a
    built-in callback's hook gets CPU copies unless it says so too).

    Example:
        >>> class Mine(FederatedCallback):
        ...     def on_client_fit_end(self, loop, module, update): ...
        >>> takes_device_update([FederatedCallback()]), takes_device_update([Mine()])
        (True, False)
    """
    return _all_declare(callbacks, "on_client_fit_end", "device_update")


def declares(callback: Any, hook: str, flag: str) -> bool:
    """Whether the class in ``callback``'s MRO that defines ``hook`` sets ``flag = True`` in its own body (the base
    class's hook, which does nothing, needs no declaration): a subclass that overrides the hook says it again.

    Example:
        >>> class Mine(FederatedCallback):
        ...     device_aggregate = True
        ...     def aggregate(self, loop, updates): ...
        >>> class Yours(Mine):
        ...     def aggregate(self, loop, updates): ...
        >>> declares(Mine(), "aggregate", "device_aggregate"), declares(Yours(), "aggregate", "device_aggregate")
        (True, False)
    """
    owner = next((c for c in type(callback).__mro__ if hook in vars(c)), None)
    return owner is None or owner is FederatedCallback or bool(vars(owner).get(flag, False))


def _all_declare(callbacks: Sequence[Any], hook: str, flag: str) -> bool:
    """Whether every one of ``callbacks`` :func:`declares` ``flag`` for ``hook``."""
    return all(declares(cb, hook, flag) for cb in callbacks)


def message_device(loop: FederationView) -> torch.device | None:
    """Where this round's messages may be computed: the accelerator the fits run on in this process
    (:attr:`~pl_fedsparse.executors.ClientExecutor.message_device`), when every callback with an
    ``on_client_message`` takes a message there (:attr:`FederatedCallback.device_message`); ``None`` — the host —
    otherwise: on the CPU, with fits in other processes (Ray), or with a callback that edits messages with host
    tensors. A ``client_message`` policy that works on the device (:class:`~pl_fedsparse.callbacks.Gossip`) asks
    here; its message then reaches the fit without crossing the link. In a device run simulated on the CPU
    (``pl_fedsparse.testing.simulated_device``) the CPU stands for the device.

    Example:
        >>> class Loop:  # (a federation whose fits run on the CPU)
        ...     executor, callbacks = type("E", (), {"message_device": torch.device("cpu")})(), []
        >>> message_device(Loop()) is None
        True
    """
    device = fits_device(loop)
    return device if device is not None and _all_declare(loop.callbacks, "on_client_message", "device_message") \
        else None


def fits_device(loop: FederationView) -> torch.device | None:
    """The accelerator the fits run on in this process
    (:attr:`~pl_fedsparse.executors.ClientExecutor.message_device`; in a device run simulated on the CPU, the CPU),
    or ``None``: on the CPU, or with fits in other processes (Ray). Where a callback's own server-side work may run
    (then handing its results to the host itself)."""
    # (a worker's loop, evaluating for the driver, runs no executor: the host)
    device = getattr(getattr(loop, "executor", None), "message_device", None)
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu" and not transfer.ALWAYS_PACK:
        return None
    return device


class FederatedCallback(pl.Callback):
    """Base class of every federated technique (see the module docstring for the hooks)."""

    #: constructor arguments that may differ when a run is resumed (they cannot change the rounds already run);
    #: any other difference from the checkpoint's configuration is refused
    resume_may_change: tuple[str, ...] = ()
    #: whether an out-of-process executor may run this callback's evaluation hooks in its workers
    #: (``on_client_evaluate_start``/``_end`` run where the client's forward pass runs; ``on_client_predictions``
    #: and ``on_evaluation_end`` always run in the driver). ``None``: yes, unless the class overrides
    #: ``on_client_evaluate_end`` — which usually collects something the driver reads later; a class that keeps
    #: nothing there sets ``True``, one whose evaluation hooks keep state in ``self`` sets ``False``
    evaluate_in_workers: bool | None = None
    #: attributes only driver-side hooks read: an out-of-process executor ships the callback to its workers with
    #: these set to ``None`` — e.g. a snapshot of every client's state taken in ``on_round_start`` for
    #: ``client_message`` (shipped, it would carry every client's state to every worker before every stage)
    driver_only_attributes: tuple[str, ...] = ()
    #: attributes that hold nothing a later fit or round needs — state of the current fit (its context, device
    #: copies made in ``on_train_start``, a value cached in ``on_fit_start``) or a value recomputed before it is
    #: read (the last evaluation's figures). The loop checks the callback contract (:mod:`pl_fedsparse.contract`,
    #: ``trainer.callback_contract``): an attribute changed during a fit, which an out-of-process worker would
    #: never send back, and an attribute a checkpoint's ``state_dict`` does not restore are errors — except these
    #: (and, for the checkpoint check, ``driver_only_attributes``). A subclass's list adds to its bases' lists
    scratch_attributes: tuple[str, ...] = ()
    #: whether the callback only adds evaluations and changes nothing that is trained, sent or aggregated
    #: (:class:`~pl_fedsparse.callbacks.ShiftEvaluation`): ``pl-fed report`` leaves the library's own such classes out
    #: of a run's method label (it never imports a user's module to ask)
    evaluation_only: bool = False
    #: whether fits may run a module compiled by ``torch.compile`` (``trainer.compile``, or ``torch.compile(model)``
    #: given to ``fit``) with this callback: ``False`` refuses the combination in one line. A callback that puts its
    #: own ``forward`` in the module during fits can run compiled when it does so with :func:`replace_methods` and
    #: :func:`restore_methods` (as :class:`~pl_fedsparse.callbacks.PFedGate` and
    #: :class:`~pl_fedsparse.callbacks.FedEM` do): the compiled training step then runs it. What it keeps from one
    #: step to the next (a running sum) is made with :func:`outside_graphs` where :func:`graph_outputs_reused` (the
    #: steps run as CUDA graphs, whose outputs the next step overwrites)
    supports_compile: bool = True

    # ---- per-client state -------------------------------------------------------------------------------------
    @property
    def client_state_prefix(self) -> str:
        """Namespace of this callback's client state (its :attr:`state_key`)."""
        return self.state_key

    def add_client_state(self, loop: FederationView, name: str, init: StateInit) -> None:
        """Declare a per-client entry created by ``init(client_idx)`` when the federation starts (call from
        ``setup_federation``; the working module then holds the initial weights)."""
        loop.client_store.declare(f"{self.client_state_prefix}/{name}", init)

    def get_client_state(self, loop: FederationView, client_idx: int, name: str) -> TensorTree:
        """This callback's entry ``name`` for ``client_idx``."""
        return loop.client_store.get(client_idx, f"{self.client_state_prefix}/{name}")

    def set_client_state(self, loop: FederationView, client_idx: int, name: str, value: TensorTree) -> None:
        """Replace this callback's entry ``name`` for ``client_idx``."""
        loop.client_store.set(client_idx, f"{self.client_state_prefix}/{name}", value)

    def has_client_state(self, loop: FederationView, client_idx: int, name: str) -> bool:
        """Whether the entry exists (without creating it)."""
        return loop.client_store.has(client_idx, f"{self.client_state_prefix}/{name}")

    # ---- federation hooks (broadcast) -------------------------------------------------------------------------
    def setup_federation(self, loop: FederationView) -> None:
        """Called once before the first round (and before a checkpoint is restored): declare client state here."""

    def on_federation_start(self, loop: FederationView) -> None:
        """Called once when the federation starts (after a checkpoint was restored)."""

    def on_round_start(self, loop: FederationView, round_idx: int) -> None:
        """Called at the start of every round."""

    def on_client_message(self, loop: FederationView, client_idx: int, message: Message) -> None:
        """Called with the message ``client_idx`` receives this round (from the ``client_message`` policy); may edit it
        in place (e.g. sparsify it under the client's mask). Its tensors are on the host — unless the class that
        defines this hook sets ``device_message = True`` (see :attr:`device_message`)."""

    #: whether this class's ``on_client_message`` takes a message whose tensors are on the device the fits run on
    #: (a ``client_message`` policy may compute it there: :func:`message_device`): it moves what it combines with
    #: them there (:func:`~pl_fedsparse.functional.transfer.to_where`) and reads no value of them on the host. Read
    #: from the class that defines ``on_client_message``, as :attr:`device_update`; while one callback in the run
    #: does not say so, every message is made on the host.
    device_message: bool = False

    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        """Called after the client's starting weights are loaded into ``module`` and before its local fit;
        ``context`` says which client, round and kind of fit it is (also :func:`~pl_fedsparse.current_fit`)."""

    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        """Called after the local fit (``update.context`` is the fit's context); may edit ``update`` (its message,
        masks, extras). ``update.state`` holds CPU copies of the trained weights — unless the class that defines this
        hook sets ``device_update = True`` (see :attr:`device_update`)."""

    #: whether this class's ``on_client_fit_end`` takes ``update.state`` (and ``update.message``) on the device the
    #: weights trained on: it moves whatever it combines with them there, and may leave tensors on that device in
    #: the update and in ``set_client_state`` — the engine brings all of them to the host in one copy when the fit
    #: ends. Read from the class that defines ``on_client_fit_end`` (a subclass overriding the hook says it again):
    #: when every callback's says so, a fit on a GPU moves its results to the host once instead of once before and
    #: once after the callbacks (:func:`takes_device_update`). On the CPU nothing changes. Then, too, the fit's
    #: ``train_loss`` is read with that copy where the metrics are the engine's own: in ``on_client_fit_end`` it is
    #: a :class:`~pl_fedsparse.metrics.PendingMetric` (a number from the fit's end on); a value the hook computes on
    #: the device can be read the same way (:meth:`~pl_fedsparse.client.ClientUpdate.on_host`).
    device_update: bool = False

    def on_before_aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> None:
        """Called with all updates of the round before aggregation."""

    def on_after_aggregate(self, loop: FederationView) -> None:
        """Called after aggregation (``loop.global_state`` holds the new global model, if any)."""

    def fit_requests(self, loop: FederationView, stage: FitStage,
                     updates: Sequence[ClientUpdate]) -> list[FitSpec]:
        """Extra fits this callback needs at ``stage`` (``"before_aggregate"``: after ``on_before_aggregate``, with
        the round's ``updates``; ``"after_aggregate"``: after ``on_after_aggregate``). The loop runs them through the
        client executor — every callback's fit hooks fire, with the fit's kind in its context — and passes the
        results to :meth:`on_requested_fits_end` of this callback. Default: none."""
        return []

    def on_requested_fits_end(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> None:
        """Called on the requester with the updates of the fits it asked for at ``stage``."""

    def on_client_evaluate_start(
        self, loop: FederationView, module: pl.LightningModule, client_idx: int, kind: str
    ) -> None:
        """Called after the ``kind`` ("personal" or "global") model of a client is loaded, before it is evaluated."""

    def on_client_evaluate_end(
        self, loop: FederationView, module: pl.LightningModule, client_idx: int, kind: str, metrics: dict[str, float]
    ) -> None:
        """Called with the client's evaluation metrics (may add entries)."""

    def eval_views(self, loop: FederationView) -> list[EvalView]:
        """Extra evaluation views for the coming evaluation (shift levels, corruptions, auxiliary data; see
        :mod:`pl_fedsparse.evaluation`). Collected from every callback; default: none."""
        return []

    def on_client_predictions(self, loop: FederationView, client_idx: int, outputs: dict[str, dict[str, Tensor]],
                              labels: dict[str, Tensor]) -> None:
        """Called once per client and evaluation with the CPU logits of every model kind on every view
        (``outputs[view][kind]``, kinds ``"personal"`` and, if any, ``"global"``) and the views' labels; may add
        kinds (e.g. ``outputs[view]["adaptive"]``), which the loop then reports as ``<kind>_acc``."""

    def on_evaluation_end(self, loop: FederationView, metrics: dict[str, Any]) -> None:
        """Called after every client was evaluated (during ``fit`` and in ``validate``/``test``) with the evaluation's
        metrics; may add derived entries (e.g. averages over shift levels)."""

    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        """``(label, metric key)`` lines this callback adds to the printed results table (shown when present)."""
        return []

    def on_round_end(self, loop: FederationView, round_idx: int, metrics: dict[str, Any]) -> None:
        """Called at the end of a round with the round's metrics row (may add entries before it is logged)."""

    def on_federation_end(self, loop: FederationView) -> None:
        """Called once after the last round."""

    # ---- policies (one owner each; the base versions are never called) ----------------------------------------
    def select_clients(self, loop: FederationView, round_idx: int, client_ids: Sequence[int]) -> list[int]:
        """Return the clients that take part in ``round_idx``."""
        raise NotImplementedError

    def client_message(self, loop: FederationView, client_idx: int) -> Message | None:
        """Return what the server sends to ``client_idx`` this round (``None``: nothing; start from personal state)."""
        raise NotImplementedError

    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        """Return the new global state from the round's updates (``None``: no global model). Its tensors, and the
        updates', are on the host — unless the class that defines this policy sets ``device_aggregate = True`` (see
        :attr:`device_aggregate`)."""
        raise NotImplementedError

    #: whether this class's ``aggregate`` works on the device the fits run on: it may be given the updates
    #: (``state``, ``masks``, ``message``) and ``loop.global_state`` there (where the fits run in this process on
    #: an accelerator: :meth:`~pl_fedsparse.loop.FederatedLoop.aggregation_device`), combines them only with each
    #: other or with tensors it moves there (``to_where``), reads no value of them on the host, and keeps none of
    #: them but through ``loop.set_server_update`` (the loop brings the new state and that update to the host in one
    #: copy). The loop's default, FedAvg, does; so do FedSpa's, pFedGate's, FedPSE's (EWA) and DM-PFL's.
    device_aggregate: bool = False

    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """Return the state of ``client_idx``'s personal model (what is evaluated as "personal"): every entry of the
        module's ``state_dict()``, each of its shape (checked: a missing entry or a wrong shape is one line)."""
        raise NotImplementedError

    def client_masks(self, loop: FederationView, client_idx: int) -> dict[str, Tensor] | None:
        """Return ``client_idx``'s current (bool) masks by tensor name (``None``: dense)."""
        raise NotImplementedError

    def vectorized_fit(self) -> Any:
        """What this callback does inside a local fit, in the form the
        :class:`~pl_fedsparse.executors.VectorizedExecutor` applies to a stacked group of fits: a
        :class:`~pl_fedsparse.executors.VectorizedFitHooks`, or ``None`` when it does nothing inside a fit.

        The default is ``None`` for a callback that overrides none of Lightning's in-fit hooks
        (:data:`~pl_fedsparse.executors.IN_FIT_HOOKS`) and ``NotImplemented`` otherwise: the executor then refuses
        the run in one line naming the callback. Override it to make a callback with in-fit hooks vectorisable
        (``docs/extending.md``).
        """
        from pl_fedsparse.executors.hooks import in_fit_hooks

        return NotImplemented if in_fit_hooks(self) else None

    @classmethod
    def workers_may_evaluate(cls) -> bool:
        """Whether this class's evaluation hooks may run in an executor's workers (see ``evaluate_in_workers``)."""
        if cls.evaluate_in_workers is not None:
            return bool(cls.evaluate_in_workers)
        return cls.on_client_evaluate_end is FederatedCallback.on_client_evaluate_end

    def evaluation_start_is_shared(self, loop: FederationView, kind: str) -> bool:
        """Whether this callback's ``on_client_evaluate_start`` does the same to the ``kind`` model whatever the
        client: then a model that is the same for every client (the global model, the default personal model,
        an :func:`~pl_fedsparse.evaluation.shared_models` kind) may be evaluated on every client's data in one stream
        of large batches, with the hook called once for the stream (see :class:`~pl_fedsparse.evaluation.Evaluator`).

        Default: ``True`` when the class does not override ``on_client_evaluate_start`` (a hook that does nothing
        cannot depend on the client), ``False`` otherwise. A subclass whose hook depends on the client only for some
        kinds (e.g. it loads the client's fine-tuned weights for ``"personal"``) says which.
        """
        return type(self).on_client_evaluate_start is FederatedCallback.on_client_evaluate_start

    def evaluation_batch_matters(self, loop: FederationView) -> bool:
        """Whether the predictions this callback makes at evaluation depend on how the test samples are batched
        (pFedGate draws one mask per test batch). Then ``data.eval_batch_size: null`` is ``data.batch_size`` on every
        device instead of the device's throughput choice, so the metrics do not change with the hardware (an
        explicit ``data.eval_batch_size`` still wins). Default: ``False``.
        """
        return False

    @classmethod
    def owned_policies(cls) -> list[str]:
        """The policies this class overrides."""
        return [p for p in POLICIES if getattr(cls, p) is not getattr(FederatedCallback, p)]
