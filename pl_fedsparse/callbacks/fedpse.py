"""FedPSE's three parts as reusable callbacks ("FedPSE: Personalized Sparsification with Element-wise Aggregation
for Federated Learning", anonymous ICLR submission, Alg. 1-4):

* :class:`TopKUpload` (UPS, Alg. 1 lines 9-11) — the client uploads ``Top-K(W^{r,T} − W^{r,0} + e)`` and keeps the
  rest as its error residual ``e`` (client state). Any delta-aware aggregation can use it (a FedAvg with top-k uploads).
* :class:`ElementwiseAggregation` (EWA, Alg. 2) — the aggregation policy: ``ΔW_s = Σ nᵢΔŴᵢ ⊘ Σ nᵢ1[ΔŴᵢ ≠ 0]``
  (:func:`~pl_fedsparse.functional.elementwise_average`; ``mode: mean`` = the paper's "without EWA" ablation, a
  sample-weighted mean in which zeros count). The server's model moves by ``ΔW_s``; ``ΔW_s`` is published as
  ``loop.server_update`` for the downstream policy.
* :class:`PersonalizedDownstream` (DPS, Alg. 3) — owns the downstream message and the personal model. Each client
  keeps its last start ``W_i^{r−1,0}`` and the downstream update not yet applied; its next start is their sum (Alg. 1
  line 1: the locally trained weights are not kept, as the paper's example code). After aggregation, every participant
  ``i`` gets ``M_{s,i} ⊙ ΔW_s``: ``M_{s,i}`` keeps ``nz(ΔŴ_s) ∩ nz(ΔŴ_i)`` and fills the rest of ``k = |nz(ΔŴ_s)|``
  from the client's own and the server's indices in proportion to the correlation distance ``d`` (per tensor,
  :func:`~pl_fedsparse.functional.personalized_mask`, seeded per round and client); ``ΔŴ_s = Top-K(ΔW_s, p)``.
  ``personalized: false`` broadcasts ``ΔŴ_s`` instead (the "without DPS" ablation).

**Partial participation** (App. D.2 does not say how): a client that did not take part in round ``r`` has no upload
to personalise against, so it is given the round's global sparse update ``ΔŴ_s``; these accumulate until it is next
sampled, when it receives them all at once (counted as one sparse download) — it catches up with every global step it
missed, and is personalised in the rounds it takes part in. With full participation (the paper's tables) this never
happens.

FedPSE = the three together (``configs/synthetic_fedpse.yaml``)::

    trainer:
      callbacks:
        - {class_path: pl_fedsparse.callbacks.TopKUpload, init_args: {sparsity: 0.9}}
        - {class_path: pl_fedsparse.callbacks.ElementwiseAggregation}
        - {class_path: pl_fedsparse.callbacks.PersonalizedDownstream, init_args: {sparsity: 0.9}}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.base import FederatedCallback, fits_device, message_device
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.functional.compression import ternarize
from pl_fedsparse.functional.pse import (
    correlation_distance,
    distance_from,
    dps_draws,
    elementwise_average,
    error_feedback_topk,
    personalized_mask,
    topk_sparsify,
)
from pl_fedsparse.functional.transfer import to_where
from pl_fedsparse.streams import register_stream

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["ResidualUpload", "TopKUpload", "ElementwiseAggregation", "PersonalizedDownstream", "DELTA"]

#: ``update.extras[DELTA]`` is true when ``update.message`` holds an update (a difference), not weights
DELTA = "upload_is_delta"
register_stream("dps")  # DPS's random index choice, keyed by (round, client)


def _float_names(state: dict[str, Tensor]) -> list[str]:
    return [n for n, t in state.items() if t.is_floating_point()]


def _one_magnitude(t: Tensor) -> bool:
    mags = t[t != 0].abs()
    return bool(mags.numel()) and bool(mags.max() == mags.min())


def _check_sparsity(owner: str, sparsity: float) -> None:
    check(isinstance(sparsity, (int, float)) and not isinstance(sparsity, bool) and 0 <= sparsity < 1,
          f"{owner}.sparsity", sparsity, "a number in [0, 1) (the share of entries dropped: 0.9 keeps 10 %)")


class ResidualUpload(FederatedCallback):
    """Base of the uploads that send a compressed round update and keep the rest as an error residual (client state):
    records the start of every fit, and at its end hands ``W^{r,T} − W^{r,0}`` to :meth:`compress`.

    Subclasses implement :meth:`compress` and may narrow :meth:`residual_names` (tensors without a residual are sent
    as :meth:`compress` decides, without feedback).
    """

    #: per-fit state (the fit's start weights, for its update)
    scratch_attributes = ("_start",)

    _start: dict[str, Tensor]

    def residual_names(self, state: dict[str, Tensor]) -> list[str]:
        """Tensors that keep a residual (default: every floating tensor)."""
        return _float_names(state)

    def compress(self, raw: dict[str, Tensor], residual: dict[str, Tensor]
                 ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor], frozenset[str]]:
        """``(sent, masks, new_residual, ternary names)`` from the round's raw update and the residual."""
        raise NotImplementedError

    @override
    def setup_federation(self, loop: FederationView) -> None:
        init = loop.initial_state
        names = self.residual_names(init)
        self.add_client_state(loop, "residual", lambda k: {n: torch.zeros_like(init[n]) for n in names})

    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        # W^{r,0}, copied where the weights are (no copy across the link)
        self._start = {n: t.detach().clone() for n, t in module.state_dict().items() if t.is_floating_point()}

    #: ``on_client_fit_end`` works where the update is (the residual is moved there)
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        start, self._start = self._start, {}
        if update.kind != "train" or update.message is None:
            return
        residual = self.get_client_state(loop, update.client_idx, "residual")
        like = next(iter(update.state.values()), None)
        if like is not None:
            start, residual = to_where(start, like), to_where(residual, like)
        raw = {n: update.state[n] - start[n] for n in start}  # W^{r,T} − W^{r,0}
        sent, masks, new_res, ternary = self.compress(raw, residual)
        self.set_client_state(loop, update.client_idx, "residual", new_res)
        update.message = Message(sent, masks, ternary)
        update.extras[DELTA] = True


class TopKUpload(ResidualUpload):
    """UPS: upload the top-k of the round's update plus the error residual, keep the rest (Alg. 1 lines 9-11).

    Args:
        sparsity: ``p``, the share of entries *not* sent (paper: 0.9).
        scope: ``"layer"`` (top-k per tensor, the paper's example code) or ``"model"`` (one top-k over all tensors).
        quantize: ``"none"`` (FedPSE) or ``"ternary"``: the kept values become ``μ · sign`` per tensor and the
            quantisation error joins the residual (FedSTC's upload, Sattler et al. Alg. 1-2;
            :func:`~pl_fedsparse.functional.compression.ternarize`).
    """

    def __init__(self, *, sparsity: float = 0.9, scope: Literal["layer", "model"] = "layer",
                 quantize: Literal["none", "ternary"] = "none") -> None:
        _check_sparsity("TopKUpload", sparsity)
        check(scope in ("layer", "model"), "TopKUpload.scope", scope, "one of layer, model")
        check(quantize in ("none", "ternary"), "TopKUpload.quantize", quantize, "one of none, ternary")
        self.sparsity, self.scope, self.quantize = float(sparsity), scope, quantize
        self._start = {}

    @override
    def compress(self, raw: dict[str, Tensor], residual: dict[str, Tensor]
                 ) -> tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor], frozenset[str]]:
        if self.scope == "layer":
            pairs = {n: error_feedback_topk(raw[n], residual[n], self.sparsity) for n in raw}
            sent, new_res = {n: p[0] for n, p in pairs.items()}, {n: p[1] for n, p in pairs.items()}
        else:
            flat = torch.cat([raw[n].flatten() for n in raw])
            s, e = error_feedback_topk(flat, torch.cat([residual[n].flatten() for n in raw]), self.sparsity)
            sent, new_res, i = {}, {}, 0
            for n in raw:
                j = i + raw[n].numel()
                sent[n], new_res[n], i = s[i:j].view_as(raw[n]), e[i:j].view_as(raw[n]), j
        if self.quantize == "ternary":  # the quantisation error is fed back too (Sattler et al. Alg. 2)
            ternary = {n: ternarize(t) for n, t in sent.items()}
            new_res = {n: new_res[n] + sent[n] - ternary[n] for n in sent}
            sent = ternary
        return (sent, {n: t != 0 for n, t in sent.items()}, new_res,
                frozenset(sent) if self.quantize == "ternary" else frozenset())


class ElementwiseAggregation(FederatedCallback):
    """EWA: aggregate uploaded updates element-wise (Alg. 2); the server's model moves by ``ΔW_s``.

    Args:
        mode: ``"elementwise"`` (EWA) or ``"mean"`` (the sample-weighted mean of the sparse updates, zeros included:
            the paper's "without EWA").

    The weights ``nᵢ`` are the samples each client trained on this round (Alg. 1 line 7).
    """

    def __init__(self, *, mode: Literal["elementwise", "mean"] = "elementwise") -> None:
        check(mode in ("elementwise", "mean"), "ElementwiseAggregation.mode", mode, "one of elementwise, mean")
        self.mode = mode

    @override
    def on_federation_start(self, loop: FederationView) -> None:
        if loop.global_state is None:
            raise ConfigError("trainer.topology is invalid for ElementwiseAggregation: expected a server (Star)")

    #: ``aggregate`` runs on the fits' device where they run on one (Alg. 2's sums in float64 there too)
    device_aggregate = True

    @override
    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        glob = loop.global_state
        sent = [u for u in updates if u.message is not None]
        loop.set_server_update(None)
        if glob is None or not sent:
            return glob
        if not all(u.extras.get(DELTA) for u in sent):
            raise ConfigError("trainer.callbacks is invalid: ElementwiseAggregation aggregates updates; expected an "
                              "upload callback that sends them (e.g. pl_fedsparse.callbacks.TopKUpload)")
        weights = [float(u.metrics.get("samples_seen", u.n_samples)) for u in sent]
        uploads = [u.message.tensors for u in sent]  # type: ignore[union-attr]
        if self.mode == "elementwise":
            server_update = {n: elementwise_average([t[n] for t in uploads], weights) for n in uploads[0]}
        else:  # FedAvg's weighted mean, zeros included
            server_update = weighted_average(uploads, weights)
        loop.set_server_update(server_update)
        return {n: (t + server_update[n] if n in server_update else t) for n, t in glob.items()}


def _compose(start: dict[str, Tensor], pending: dict[str, Tensor]) -> dict[str, Tensor]:
    """``W^{r,0} = W^{r−1,0} + ΔŴ_{s,i}`` (Alg. 1 line 1) from the stored start and pending update."""
    return {n: (t + pending[n] if n in pending else t) for n, t in start.items()}


class PersonalizedDownstream(FederatedCallback):
    """DPS: every client's downstream update, personalised by the correlation of its upload with the server's
    (Alg. 3); owns ``client_message`` and ``personal_state``.

    Args:
        sparsity: ``p`` of the server's top-k ``ΔŴ_s`` (paper: 0.9, as upstream).
        personalized: ``false`` broadcasts ``ΔŴ_s`` to every client (the "without DPS" ablation).
        quantize: ``"ternary"`` makes the broadcast ``ΔŴ_s`` ternary (``μ · sign``, FedSTC's downstream); only
            with ``personalized: false``.
        error_feedback: keep the server's compression error ``R`` and add it to the next round's update before
            compressing (FedSTC, Sattler et al. Alg. 2: ``ΔW = R + mean; ΔŴ = STC(ΔW); R = ΔW − ΔŴ``); only with
            ``personalized: false``. ``R`` is saved in checkpoints.
    """

    def __init__(self, *, sparsity: float = 0.9, personalized: bool = True,
                 quantize: Literal["none", "ternary"] = "none", error_feedback: bool = False) -> None:
        owner = type(self).__name__
        _check_sparsity(owner, sparsity)
        check(quantize in ("none", "ternary"), f"{owner}.quantize", quantize, "one of none, ternary")
        if personalized and (quantize != "none" or error_feedback):
            raise ConfigError(f"{owner}.personalized is invalid with quantize={quantize!r}, "
                              f"error_feedback={error_feedback}: expected personalized: false (DPS personalises the "
                              "dense EWA values; ternary values and a server residual belong to a broadcast)")
        self.sparsity, self.personalized = float(sparsity), bool(personalized)
        self.quantize, self.error_feedback = quantize, bool(error_feedback)
        self._uploads: dict[int, dict[str, Tensor]] = {}
        self.server_residual: dict[str, Tensor] = {}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"server_residual": self.server_residual} if self.error_feedback else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.error_feedback and "server_residual" in state_dict:
            self.server_residual = {n: t.clone() for n, t in state_dict["server_residual"].items()}

    @override
    def setup_federation(self, loop: FederationView) -> None:
        init, names = loop.initial_state, _float_names(loop.initial_state)
        if self.error_feedback:
            self.server_residual = {n: torch.zeros_like(init[n]) for n in names}
        self.add_client_state(loop, "start", lambda k: dict(init))  # W_i^{r−1,0}: the start of its last round
        self.add_client_state(loop, "pending", lambda k: {n: torch.zeros_like(init[n]) for n in names})

    def _personalize_on(self, loop: FederationView, device: torch.device, dense: dict[str, Tensor],
                        uploads: dict[int, dict[str, Tensor]]) -> None:
        """:meth:`on_after_aggregate`'s DPS (Alg. 3 with Alg. 4 line 9) on the fits' device, with the host path's
        numbers: the server update and the uploads are read from the copies kept there, every participant's
        correlation and mask counts are read on the host at once (one wait), the random draws are made there from
        the same generators in the same order (:func:`dps_draws`) and applied on the device, and every client's new
        pending update comes back in one copy."""
        names = list(dense)
        part = [k for k in range(loop.num_clients) if k in uploads]
        missed = [k for k in range(loop.num_clients) if k not in uploads]
        pending = {k: self.get_client_state(loop, k, "pending") for k in missed}
        host = [dense[n] for n in names] + [uploads[k][n] for k in part for n in names] + \
            [pending[k][n] for k in missed for n in names]
        keep = [True] * (len(names) * (1 + len(part))) + [False] * (len(names) * len(missed))  # (decoded anew)
        there = iter(loop.client_store.on_device(host, device, keep))
        d_dense = {n: next(there) for n in names}
        d_up = {k: {n: next(there) for n in names} for k in part}
        d_pending = {k: {n: next(there) for n in names} for k in missed}
        sparse = {n: topk_sparsify(t, self.sparsity) for n, t in d_dense.items()}  # ΔŴ_s (Alg. 4 line 9)
        pools, stats, counts = [], [], []
        for k in part:
            for n in names:
                a64, b64 = sparse[n].detach().double().flatten(), d_up[k][n].detach().double().flatten()
                stats.append(torch.stack([a64.norm(), b64.norm(), a64 @ b64]))  # correlation_distance's terms
                s, c = (sparse[n] != 0).flatten(), (d_up[k][n] != 0).flatten()
                inter = s & c
                pools.append((inter, c & ~inter, s & ~inter))  # M_in, M_i − M_in, M_s − M_in
                counts.append(torch.stack([s.sum(), inter.sum(), pools[-1][1].sum(), pools[-1][2].sum()]))
        read = transfer.to_host({"stats": torch.stack(stats), "counts": torch.stack(counts)}) if part else {}
        stat_rows, count_rows = (read["stats"].tolist(), read["counts"].tolist()) if part else ([], [])
        draws, i = [], 0
        for k in part:  # Alg. 3 lines 6-14's draws, on the host: the host path's generator calls
            gen = loop.streams.generator("dps", loop.round_idx, k)
            for _ in names:
                (na, nb, dot), (ks, kin, pc, ps) = stat_rows[i], count_rows[i]
                draws.append(dps_draws(ks - kin, [pc, ps], distance_from(na, nb, dot), gen))
                i += 1
        drawn = [t for pair in draws for t in pair if t is not None]
        moved = iter(transfer.to_device({str(j): t for j, t in enumerate(drawn)}, device).values())
        new: dict[int, dict[str, Tensor]] = {}
        i = 0
        for k in part:
            new[k] = {}
            for n in names:
                inter, pool_c, pool_s = pools[i]
                out = inter.clone()
                for pool, pick, size in zip((pool_c, pool_s), draws[i], count_rows[i][2:]):
                    if pick is not None:  # (the pool's size is known: no wait for its positions)
                        out[torch.nonzero_static(pool, size=size).flatten()[next(moved)]] = True
                t = d_dense[n]
                new[k][n] = t * out.view(t.shape).to(t.dtype)
                i += 1
        for k in missed:  # missed the round: catch up when next sampled
            new[k] = {n: d_pending[k][n] + sparse[n] for n in names}
        order = [(k, n) for k in range(loop.num_clients) for n in names]
        hosted = iter(loop.client_store.to_host([new[k][n] for k, n in order]))
        for k in range(loop.num_clients):
            self.set_client_state(loop, k, "pending", {n: next(hosted) for n in names})

    def _next_start(self, loop: FederationView, client_idx: int, like: Tensor | None = None) -> dict[str, Tensor]:
        """``W^{r,0} = W^{r−1,0} + ΔŴ_{s,i}`` (Alg. 1 line 1), where ``like`` is (default: the host)."""
        start = self.get_client_state(loop, client_idx, "start")
        pending = self.get_client_state(loop, client_idx, "pending")
        if like is not None:
            start, pending = to_where(start, like), to_where(pending, like)
        return _compose(start, pending)

    @override
    def client_message(self, loop: FederationView, client_idx: int) -> Message | None:
        # Alg. 1 line 1: W^{r,0} = W^{r−1,0} + ΔŴ_{s,i}; only the pending update's non-zeros travel
        pending = self.get_client_state(loop, client_idx, "pending")
        device = message_device(loop)
        if device is not None and self.quantize == "none":  # made where the fits run, from the copies kept there
            start = self.get_client_state(loop, client_idx, "start")
            there = iter(loop.client_store.on_device([*start.values(), *pending.values()], device))
            start_d, pending_d = {n: next(there) for n in start}, {n: next(there) for n in pending}
            message = Message(_compose(start_d, pending_d), {n: t != 0 for n, t in pending_d.items()})
            for n, t in pending.items():  # the ledger's counts, from the host copy: no wait on the device
                message.know_count(n, message.masks[n], int(torch.count_nonzero(t)))
            return message
        # a pending update made of one ternary broadcast travels as one; sums of several (a client that missed
        # rounds) are sent as plain sparse values
        ternary = frozenset(n for n, t in pending.items() if self.quantize == "ternary" and _one_magnitude(t))
        return Message(self._next_start(loop, client_idx), {n: t != 0 for n, t in pending.items()}, ternary)

    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        return self._next_start(loop, client_idx)

    #: ``on_client_fit_end`` takes the update where the weights are: it reads only its client state
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        if update.kind != "train":
            return
        k = update.client_idx  # the pending update was applied at this fit's start
        like = next(iter(update.state.values()), None)  # (made where the update is: kept there for the next round)
        self.set_client_state(loop, k, "start", self._next_start(loop, k, like))
        where = None if like is None else like.device
        self.set_client_state(loop, k, "pending", {n: torch.zeros_like(t, device=where) for n, t in
                                                   self.get_client_state(loop, k, "pending").items()})

    @override
    def on_before_aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> None:
        self._uploads = {u.client_idx: u.message.tensors for u in updates
                         if u.message is not None and u.extras.get(DELTA)}

    @override
    def on_after_aggregate(self, loop: FederationView) -> None:
        dense = loop.server_update
        uploads, self._uploads = self._uploads, {}
        if dense is None:
            if uploads:
                raise ConfigError("trainer.callbacks is invalid: PersonalizedDownstream needs an aggregation that "
                                  "publishes its update (e.g. pl_fedsparse.callbacks.ElementwiseAggregation)")
            return
        device = fits_device(loop)
        if device is not None and self.personalized and self.quantize == "none" and not self.error_feedback:
            self._personalize_on(loop, device, dense, uploads)  # (the paper's DPS where the fits run)
            return
        if self.error_feedback:  # FedSTC: compress R + ΔW_s, keep what was not sent
            dense = {n: t + self.server_residual[n] for n, t in dense.items()}
        sparse = {n: topk_sparsify(t, self.sparsity) for n, t in dense.items()}  # ΔŴ_s (Alg. 4 line 9)
        if self.quantize == "ternary":
            sparse = {n: ternarize(t) for n, t in sparse.items()}
        if self.error_feedback:
            self.server_residual = {n: dense[n] - sparse[n] for n in dense}
        for k in range(loop.num_clients):
            pending = self.get_client_state(loop, k, "pending")
            if k in uploads and self.personalized:  # Alg. 3
                gen = loop.streams.generator("dps", loop.round_idx, k)
                new = {}
                for n, t in dense.items():
                    d = correlation_distance(sparse[n], uploads[k][n])
                    new[n] = t * personalized_mask(sparse[n] != 0, uploads[k][n] != 0, d, gen).to(t.dtype)
            elif k in uploads:
                new = dict(sparse)  # without DPS: the same ΔŴ_s for everyone
            else:
                new = {n: pending[n] + sparse[n] for n in sparse}  # missed the round: catch up when next sampled
            self.set_client_state(loop, k, "pending", new)
