"""What a local fit is: :class:`FitContext`, and what a callback asks for: :class:`FitSpec`.

Every fit — a round's local training, fine-tuning, Ditto's personal fit, DM-PFL's personal refinement — carries a
:class:`FitContext`. It is passed to ``on_client_fit_start`` (and travels in ``ClientUpdate.context`` to
``on_client_fit_end``) and is readable from inside Lightning hooks with :func:`current_fit`, so a callback can act
on the fits it means and ignore the others (e.g. a proximal term only on ``kind == "train"``)::

    from pl_fedsparse import current_fit

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        ctx = current_fit()
        if ctx is None or ctx.kind != "train":
            return
        ...

Fits other than a round's local training are never run from inside a hook. A callback *requests* them by returning
:class:`FitSpec` s from ``fit_requests(loop, stage, updates)``; the loop runs them at that stage through the client
executor and hands the results back to the requester's ``on_requested_fits_end``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from torch import Tensor

    from pl_fedsparse.client import Message

__all__ = ["FitKind", "FitStage", "FitContext", "FitSpec", "current_fit", "FIT_KINDS", "FIT_STAGES"]

#: why a client trains: a round's local fit, fine-tuning, a personal model's fit (Ditto), personal refinement (DM-PFL)
FitKind = Literal["train", "finetune", "personal", "personal_refine"]
#: when requested fits run: after the round's fits (before aggregation) or after aggregation
FitStage = Literal["before_aggregate", "after_aggregate"]
FIT_KINDS: tuple[str, ...] = get_args(FitKind)
FIT_STAGES: tuple[str, ...] = get_args(FitStage)


@dataclass(frozen=True)
class FitContext:
    """Who trains, when, why, and from which random stream.

    Attributes:
        client_idx: 0-based client.
        round_idx: 0-based round the fit belongs to.
        kind: why the client trains (:data:`FitKind`).
        stream: the fit's random stream (``pl_fedsparse.streams.FIT_STREAM_IDS``; by default the kind's name).
        seed: the fit's seed (shuffling, augmentation, torch RNG), derived from (seed, round, client, stream).
        lr_round: the round whose learning rate the fit uses (``round_idx`` unless the requester chose another,
            e.g. the DisPFL code's fine-tuning at round −1).
        epochs: local epochs (``None``: the loop's ``local_epochs`` / ``local_steps``).
        requester: ``state_key`` of the callback that requested the fit (``None`` for a round's local training).
    """

    client_idx: int
    round_idx: int
    kind: FitKind
    stream: str
    seed: int
    lr_round: int
    epochs: int | None = None
    requester: str | None = None


@dataclass
class FitSpec:
    """An extra fit a callback asks the loop to run (returned from ``fit_requests``).

    Args:
        client_idx: the client that trains.
        kind: why (:data:`FitKind`; not ``"train"``).
        start: the full state the fit starts from.
        epochs: local epochs (``None``: the loop's).
        lr_round: the round whose learning rate to use (``None``: the current round).
        download: what the client receives to start this fit; the loop counts it as downstream traffic
            (``None``: nothing is sent, e.g. the client starts from its own state).
        stream: the fit's random stream (default: ``kind``).
    """

    client_idx: int
    kind: FitKind
    start: Mapping[str, Tensor]
    epochs: int | None = None
    lr_round: int | None = None
    download: Message | None = None
    stream: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FIT_KINDS or self.kind == "train":
            raise ValueError(f"FitSpec.kind={self.kind!r} is invalid: expected one of "
                             f"{', '.join(k for k in FIT_KINDS if k != 'train')}")


_CURRENT: ContextVar[FitContext | None] = ContextVar("pl_fedsparse_fit", default=None)


def current_fit() -> FitContext | None:
    """The context of the fit running now (``None`` outside a local fit, e.g. during evaluation)."""
    return _CURRENT.get()


@contextlib.contextmanager
def fit_scope(context: FitContext) -> Iterator[FitContext]:
    """Make ``context`` the :func:`current_fit` for the duration of a fit (used by client executors)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
