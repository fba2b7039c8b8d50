"""Dynamic sparse training: :class:`MaskPruneRegrow` and its two regrowth rules.

After a client's local training (FedSpa Alg. 2 "Next_Masks"; DisPFL Alg. 1 lines 9-10; DM-PFL Alg. 1), every masked
tensor drops the ``α_t`` fraction of its active weights with the smallest drop score (|w| of the trained weights)
and regrows as many among the inactive positions by a grow score; the number of active entries is kept exactly, and
an entry dropped in a step may be regrown in the same step (:func:`~pl_fedsparse.functional.sparse.drop_and_grow`).
The prune rate follows FedSpa/DisPFL's cosine annealing ``α_t = α₀/2 · (1 + cos(π t / T))`` or stays constant.

Two subclasses override one scoring method (RigL's SET→RigL split):

* :class:`GradientRegrow` — |dense gradient| of ``grow_batches`` local batches at the trained weights (FedSpa Alg. 2,
  DisPFL paper, RigL); its FLOPs (one dense forward+backward per batch) are charged to the client.
* :class:`RandomRegrow` — uniform random scores (SET; what the DisPFL scripts ship with ``--dis_gradient_check``).

New methods subclass one of these and override :meth:`MaskPruneRegrow.drop_score` or
:meth:`MaskPruneRegrow.grow_scores` (see ``callbacks/`` at the repository root for a worked example).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.masking import SparseMask
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.errors import check
from pl_fedsparse.functional.sparse import (
    cosine_prune_rate,
    drop_and_grow,
    drop_and_grow_many,
    prune_regrow_counts,
)
from pl_fedsparse.functional.transfer import abs_tensors, to_where

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["MaskPruneRegrow", "GradientRegrow", "RandomRegrow", "PruneRegrowSchedule", "prune_regrow",
           "gradient_scores"]


class PruneRegrowSchedule:
    """When and how much to readjust: the prune rate α_t of a round (a reusable part, also used by ``DualMask``).

    Args:
        alpha0: initial prune rate α₀.
        schedule: ``"cosine"`` (α_t = α₀/2 · (1 + cos(π t / T))) or ``"constant"``.
        every_n_rounds: readjust only in rounds ``t`` with ``t % every_n_rounds == 0``.
        total_rounds: ``T`` (default: ``trainer.num_rounds``).
    """

    def __init__(self, *, alpha0: float, schedule: str, every_n_rounds: int, total_rounds: int | None,
                 owner: str) -> None:
        check(0 <= alpha0 <= 1, f"{owner}.alpha0", alpha0, "a number in [0, 1]")
        check(schedule in ("cosine", "constant"), f"{owner}.schedule", schedule, "one of cosine, constant")
        check(every_n_rounds >= 1, f"{owner}.every_n_rounds", every_n_rounds, "an int >= 1")
        check(total_rounds is None or total_rounds >= 1, f"{owner}.total_rounds", total_rounds, "an int >= 1 or null")
        self.alpha0, self.schedule = float(alpha0), schedule
        self.every_n_rounds, self.total_rounds = every_n_rounds, total_rounds

    def rate(self, loop: FederationView, round_idx: int) -> float:
        """α_t of ``round_idx`` (0 in rounds that do not readjust)."""
        if round_idx % self.every_n_rounds != 0:
            return 0.0
        if self.schedule == "constant":
            return self.alpha0
        total = self.total_rounds or loop.num_rounds
        return cosine_prune_rate(min(round_idx, total), total, self.alpha0)


def prune_regrow(masks: dict[str, Tensor], drop: dict[str, Tensor], grow: dict[str, Tensor],
                 rate: float) -> dict[str, Tensor]:
    """Every mask drops its ``α``-share of active entries with the lowest ``drop`` score and regrows as many by the
    highest ``grow`` score (:func:`~pl_fedsparse.functional.sparse.drop_and_grow`); counts are kept exactly.

    Runs where the ``drop`` scores are (the trained weights' device): the scores are not copied to the host, only the
    bool masks travel to them (in one copy, with the grow scores where those are elsewhere); there every tensor is
    readjusted at once and the counts are taken there
    (:func:`~pl_fedsparse.functional.sparse.drop_and_grow_many`). The new masks are on that device."""
    names = list(masks)
    if len({drop[name].device for name in names}) == 1:  # every mask and grow score to the drop scores' device
        moved = to_where({**{f"m/{n}": m for n, m in masks.items()}, **{f"g/{n}": grow[n] for n in masks}},
                         drop[names[0]])
        new = drop_and_grow_many([moved[f"m/{n}"] for n in names], [drop[n] for n in names],
                                 [moved[f"g/{n}"] for n in names], rate=rate)
        return dict(zip(names, new))
    counts = prune_regrow_counts(list(masks.values()), rate)
    return {n: drop_and_grow(m.to(drop[n].device), drop[n], grow[n].to(drop[n].device), k)
            for (n, m), k in zip(masks.items(), counts)}


def gradient_scores(loop: FederationView, update: ClientUpdate, names: list[str], batches: int) -> dict[str, Tensor]:
    """|dense gradient| of ``names`` at the working module's (trained) weights over ``batches`` local batches from
    the ``grow`` stream of (round, client); its FLOPs are charged to the client (``loop.local_gradients``)."""
    grads = loop.local_gradients(update.client_idx, names, keys=(update.round_idx, update.client_idx),
                                 batches=batches, stream="grow", update=update)
    return dict(zip(grads, abs_tensors(list(grads.values())), strict=True))


class MaskPruneRegrow(SparseMask):
    """A :class:`~pl_fedsparse.callbacks.SparseMask` whose masks are searched by prune-and-regrow after training.

    Args:
        alpha0: initial prune rate α₀ (FedSpa/DisPFL: 0.5).
        schedule: ``"cosine"`` (α_t = α₀/2 · (1 + cos(π t / T)), FedSpa/DisPFL) or ``"constant"`` (α_t = α₀,
            FedDST-style, e.g. α₀ = 0.01 every 10 rounds).
        every_n_rounds: readjust in rounds ``t`` with ``t % every_n_rounds == 0`` (1 = every round, as the papers).
        total_rounds: ``T`` of the cosine schedule (default: ``trainer.num_rounds``).
        **kwargs: the :class:`~pl_fedsparse.callbacks.SparseMask` arguments (density, distribution, ...).

    The readjustment runs once per round at the end of the client's local fit, as in the papers; readjusting every
    few optimizer steps inside a fit is not implemented yet.
    """

    def __init__(self, *, alpha0: float = 0.5, schedule: Literal["cosine", "constant"] = "cosine",
                 every_n_rounds: int = 1, total_rounds: int | None = None, density: float = 0.5,
                 distribution: Literal["erk", "uniform"] = "erk", erk_power_scale: float = 1.0,
                 same_mask: bool = True, client_densities: list[float] | None = None, mask_gradients: bool = True,
                 dense_1d: bool = True, mask_personal_eval: bool = True) -> None:
        super().__init__(density=density, distribution=distribution, erk_power_scale=erk_power_scale,
                         same_mask=same_mask, client_densities=client_densities, mask_gradients=mask_gradients,
                         dense_1d=dense_1d, mask_personal_eval=mask_personal_eval)
        self.rule = PruneRegrowSchedule(alpha0=alpha0, schedule=schedule, every_n_rounds=every_n_rounds,
                                        total_rounds=total_rounds, owner=type(self).__name__)
        self.alpha0, self.schedule = self.rule.alpha0, schedule
        self.every_n_rounds, self.total_rounds = every_n_rounds, total_rounds

    def prune_rate(self, loop: FederationView, round_idx: int) -> float:
        """α_t of ``round_idx`` (0 in rounds that do not readjust)."""
        return self.rule.rate(loop, round_idx)

    def drop_score(self, loop: FederationView, update: ClientUpdate, name: str, weight: Tensor) -> Tensor:
        """Score of keeping each entry; the lowest active ones are dropped (default |w|, all papers)."""
        return weight.abs()

    def drop_scores(self, loop: FederationView, update: ClientUpdate, names: list[str]) -> dict[str, Tensor]:
        """:meth:`drop_score` of every tensor ``names`` of the trained weights. Where a subclass keeps the default
        |w| (no override of :meth:`drop_score`), every |w| at once (:func:`~pl_fedsparse.functional.transfer.abs_tensors`:
        one multi-tensor operation on a GPU, where it was a launch a tensor); otherwise the override, tensor by
        tensor."""
        if type(self).drop_score is MaskPruneRegrow.drop_score:
            return dict(zip(names, abs_tensors([update.state[n] for n in names]), strict=True))
        return {name: self.drop_score(loop, update, name, update.state[name]) for name in names}

    def grow_scores(self, loop: FederationView, module: pl.LightningModule,
                    update: ClientUpdate) -> dict[str, Tensor]:
        """Score of regrowing each entry of every masked tensor; the highest inactive ones are grown."""
        raise NotImplementedError(f"{type(self).__name__} must implement grow_scores (see GradientRegrow)")

    @override
    def next_masks(self, loop: FederationView, module: pl.LightningModule,
                   update: ClientUpdate) -> dict[str, Tensor] | None:
        rate = self.prune_rate(loop, update.round_idx)
        masks = update.masks or {}
        if update.kind != "train" or rate <= 0 or not masks:
            return None
        grow = self.grow_scores(loop, module, update)
        drop = self.drop_scores(loop, update, list(masks))
        return prune_regrow(masks, drop, grow, rate)


class RandomRegrow(MaskPruneRegrow):
    """Prune by |w|, regrow uniformly at random (SET; DisPFL's shipped scripts). Scores are drawn from a generator
    seeded by ``(seed, round, client)``, so results do not depend on client order."""

    @override
    def grow_scores(self, loop: FederationView, module: pl.LightningModule,
                    update: ClientUpdate) -> dict[str, Tensor]:
        gen = loop.streams.generator("grow", update.round_idx, update.client_idx)
        return {name: torch.rand(m.shape, generator=gen) for name, m in (update.masks or {}).items()}


class GradientRegrow(MaskPruneRegrow):
    """Prune by |w|, regrow by the largest |dense gradient| (FedSpa Alg. 2, DisPFL paper Alg. 2, RigL).

    The gradient is taken at the locally trained (sparse) weights on ``grow_batches`` shuffled local batches, in
    training mode, without weight decay (DisPFL's ``screen_gradients``); masked entries get their true, dense
    gradient. One dense forward+backward per batch is charged to the client's FLOPs.

    Args:
        grow_batches: number of local batches whose summed gradient scores regrowth (papers: 1).
        **kwargs: the :class:`MaskPruneRegrow` arguments.
    """

    def __init__(self, *, grow_batches: int = 1, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        check(grow_batches >= 1, f"{type(self).__name__}.grow_batches", grow_batches, "an int >= 1")
        self.grow_batches = grow_batches

    @override
    def grow_scores(self, loop: FederationView, module: pl.LightningModule,
                    update: ClientUpdate) -> dict[str, Tensor]:
        return gradient_scores(loop, update, list(update.masks or {}), self.grow_batches)
