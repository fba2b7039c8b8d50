"""What the parts of the engine and the callbacks see of a federation: :class:`FederationView`.

The :class:`~pl_fedsparse.loop.FederatedLoop` imports its parts — client execution, evaluation, reporting,
checkpoint state, the default policies, the callback contract — and hands each of them itself; none of them
imports the loop. They are written against this :class:`typing.Protocol` instead: the attributes and methods they
(and the callbacks' hooks) actually read, read-only. The loop satisfies it structurally (``tests/test_layers.py``
checks every member on a loop), so a callback's hooks keep receiving the loop itself; only the annotations name the
view. The few writes a callback makes go through named methods (:meth:`FederationView.set_server_update`,
:meth:`FederationView.drop_global_model`).

The module also holds :class:`EvalView` (an evaluation view of a client's data, returned by a callback's
``eval_views``), which the callback base class and the evaluator both name.

This module sits low in the package (``docs/design-notes.md``, "Layers"): it imports only modules that never
import it back, apart from the callback base class whose hooks it types (a two-file cycle of annotations).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pl_fedsparse.data.corruptions import CORRUPTION_NAMES
from pl_fedsparse.errors import check

if TYPE_CHECKING:
    import lightning.pytorch as pl
    import torch
    from torch import Tensor

    from pl_fedsparse.callbacks.base import FederatedCallback
    from pl_fedsparse.client import ClientStateStore, ClientUpdate
    from pl_fedsparse.context import FitContext
    from pl_fedsparse.metrics import Accounting
    from pl_fedsparse.streams import Streams
    from pl_fedsparse.topology import Topology

__all__ = ["ContractView", "EvalView", "EvaluatorView", "ExecutorView", "FederationView", "ReporterView"]


@dataclass(frozen=True)
class EvalView:
    """One evaluation view of a client's data.

    Args:
        name: metric prefix (``"clean"`` is the loop's own view and has no prefix).
        split: ``"eval"`` (the loop's ``eval_split``, i.e. test or val) or ``"train"`` (the client's training data,
            unshuffled and unaugmented).
        shift: fraction of samples replaced by samples of the global test distribution (DM-PFL §4.1).
        corruption: a CIFAR-10-C corruption name (:data:`~pl_fedsparse.data.corruptions.CORRUPTION_NAMES`; the
            published-only ones need ``data.cifar10c_root``) or ``None``.
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
        check(self.corruption is None or self.corruption in CORRUPTION_NAMES, "EvalView.corruption", self.corruption,
              "null or one of " + ", ".join(CORRUPTION_NAMES))
        check(self.corruption is None or 1 <= self.severity <= 5, "EvalView.severity", self.severity,
              "an int in 1..5")

    @property
    def key(self) -> tuple:
        """Views with equal keys see the same samples (their logits are computed once)."""
        return (self.split, float(self.shift), self.corruption, self.severity if self.corruption else 0)


class ExecutorView(Protocol):
    """What the parts use of the client executor (:class:`~pl_fedsparse.executors.ClientExecutor`)."""

    def run(self, requests: Sequence[Any]) -> list[ClientUpdate]:
        """Run fit requests and return their updates, in order."""
        ...

    def forward_clients(self, clients: Sequence[int], split: str, views: Mapping[str, Any], has_global: bool
                        ) -> list[tuple[dict[str, dict[str, Tensor]], dict[str, Tensor]]] | None:
        """Evaluation's forward passes run elsewhere, or ``None`` (here)."""
        ...

    @property
    def message_device(self) -> torch.device | None:
        """The device the fits run on in this process (messages may be computed there), or ``None``."""
        ...


class EvaluatorView(Protocol):
    """What client execution uses of the evaluator (:class:`~pl_fedsparse.evaluation.Evaluator`): its choice of
    evaluation batch size, which an out-of-process worker's evaluator takes over."""

    @property
    def device_type(self) -> str | None: ...

    @property
    def fixed_batch_size(self) -> int | None: ...

    def batch_size(self, device: str | None = None) -> int:
        """The evaluation batch size (for ``device``; default: the loop's)."""
        ...


class ReporterView(Protocol):
    """What the parts use of the run's reporter (:class:`~pl_fedsparse.run.writer.RunReporter`)."""

    @property
    def run_id(self) -> str | None: ...

    @property
    def run_dir(self) -> Path | None: ...

    @property
    def resumes(self) -> list[dict[str, Any]]: ...

    def progress(self, it: Any, desc: str, leave: bool) -> Any:
        """``it``, shown as progress."""
        ...


class ContractView(Protocol):
    """What client execution uses of the callback contract (:class:`~pl_fedsparse.contract.CallbackContract`)."""

    def watch(self, callbacks: Iterable[pl.Callback], client_state: Mapping[str, Any] | None = None) -> Any:
        """Start watching a fit."""
        ...

    def check_fit(self, watch: Any, context: FitContext | None) -> None:
        """Report the attributes changed since ``watch`` began."""
        ...

    def check_client_state(self, watch: Any, context: FitContext) -> None:
        """Report stored client state written in place since ``watch`` began."""
        ...


class FederationView(Protocol):
    """A federation as its parts and callbacks read it (the :class:`~pl_fedsparse.loop.FederatedLoop` is one).

    Every attribute is read-only here; a hook changes the federation through its return values, its client state
    (``set_client_state``) and the two named methods at the end.
    """

    # ---- configuration (``trainer.*``) ------------------------------------------------------------------------
    @property
    def num_rounds(self) -> int: ...

    @property
    def join_ratio(self) -> float: ...

    @property
    def clients_per_round(self) -> int | None: ...

    @property
    def local_epochs(self) -> int: ...

    @property
    def local_steps(self) -> int | None: ...

    @property
    def eval_global(self) -> bool: ...

    @property
    def eval_metrics(self) -> list[str]: ...

    @property
    def accelerator(self) -> str: ...

    @property
    def precision(self) -> str: ...

    @property
    def gradient_clip_val(self) -> float | None: ...

    @property
    def default_root_dir(self) -> str | None: ...

    @property
    def overwrite(self) -> bool: ...

    @property
    def checkpoint_every(self) -> int: ...

    @property
    def keep_checkpoints(self) -> int: ...

    @property
    def logger(self) -> bool: ...

    @property
    def enable_progress_bar(self) -> bool | None: ...

    @property
    def on_client_fault(self) -> str: ...

    @property
    def fit_runner(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def config_text(self) -> str | None: ...

    # ---- the federation's parts -------------------------------------------------------------------------------
    @property
    def topology(self) -> Topology: ...

    @property
    def callbacks(self) -> list[pl.Callback]: ...

    @property
    def fed_callbacks(self) -> list[FederatedCallback]: ...

    @property
    def executor(self) -> ExecutorView: ...

    @property
    def evaluator(self) -> EvaluatorView: ...

    @property
    def reporter(self) -> ReporterView: ...

    @property
    def contract(self) -> ContractView: ...

    @property
    def streams(self) -> Streams: ...

    @property
    def accounting(self) -> Accounting: ...

    @property
    def client_store(self) -> ClientStateStore: ...

    @property
    def model(self) -> pl.LightningModule | None: ...

    @property
    def datamodule(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def num_clients(self) -> int: ...

    @property
    def run_dir(self) -> Path | None: ...

    # ---- where the federation is ------------------------------------------------------------------------------
    @property
    def round_idx(self) -> int: ...

    @property
    def global_state(self) -> dict[str, Tensor] | None: ...

    @property
    def initial_state(self) -> dict[str, Tensor]: ...

    @property
    def server_update(self) -> dict[str, Tensor] | None: ...

    @property
    def history(self) -> list[dict[str, Any]]: ...

    @property
    def last_client_acc(self) -> list[float]: ...

    @property
    def time_cum(self) -> float: ...

    # ---- methods ----------------------------------------------------------------------------------------------
    def call(self, hook: str, *args: Any) -> None:
        """Call a broadcast hook on every federated callback, in list order."""
        ...

    def policy_owner(self, name: str) -> FederatedCallback | None:
        """The callback that owns policy ``name``, or ``None`` where the loop's default applies."""
        ...

    def personal_state(self, client_idx: int) -> dict[str, Tensor]:
        """State of the client's personal model."""
        ...

    def client_masks(self, client_idx: int) -> dict[str, Tensor] | None:
        """The client's current masks (``None``: dense)."""
        ...

    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Load a (full or partial) state dict into the working module, in place."""
        ...

    def local_gradients(self, client_idx: int, names: Iterable[str], *, keys: Sequence[int], batches: int = 1,
                        stream: str = "grow", update: ClientUpdate | None = None) -> dict[str, Tensor]:
        """Summed dense gradients of ``names`` over a client's shuffled training batches (FLOPs charged)."""
        ...

    # ---- the writes a callback may make -----------------------------------------------------------------------
    def set_server_update(self, update: dict[str, Tensor] | None) -> None:
        """Record the round's aggregated update (an ``aggregate`` policy that computes one; ``None``: none)."""
        ...

    def drop_global_model(self) -> None:
        """Declare that the federation has no global model (from ``setup_federation``)."""
        ...
