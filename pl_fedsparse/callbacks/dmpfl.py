"""DM-PFL's dual-masked sparse training (Zhang, Zhou, Wang, Tong, "DM-PFL: Hitchhiking Generic Federated Learning for
Efficient Shift-Robust Personalization", KDD 2023): :class:`DualMask`, and FedDST as its synchronised-mask special
case (:class:`FedDST`).

Objects (§3.2, Eq. 4): the server keeps global weights ``w_g`` (dense) and a global mask ``m_g``; client ``c`` keeps
personal weights ``w_c`` (stored at its mask's positions only) and a personal mask ``m_c``, all at density ``1 − S``.
The global model is ``θ_g = w_g ⊙ m_g``, the personal model ``θ_c = w_g ⊙ (m_g ∩ m_c) + w_c ⊙ (m_c − m_g)``.

Schedule (§3.3.1, §4.3.2): ``T`` rounds are divided equally into ``2·iterations`` blocks alternating
Phase 1 / Phase 2 (``iterations = 0``: Phase 1 only):

* **Phase 1 — train dual masks (Alg. 1).** A sampled client receives ``m_g`` and ``m_g ⊙ w_g`` (line 4), overwrites
  ``w_c`` at ``m_g ∩ m_c`` with ``w_g`` (line 6), trains ``w_c ⊙ m_c`` for E epochs with the gradient masked by
  ``m_c`` (lines 7-9), readjusts ``m_c`` by prune-and-regrow (lines 10-12, :class:`GradientRegrow`'s rule and
  schedules) and uploads ``w_c ⊙ m_c`` and ``m_c`` (line 13). The server applies Eq. 5 (per position, sample-weighted
  over the clients holding it; positions nobody holds keep the old ``w_g``) and takes the new ``m_g`` as the top
  ``1 − S`` positions by ``|w_g|`` among positions held by more than ``coverage_threshold`` of the sampled clients.
* **Phase 2 — refine dual weights.** Global refinement (Alg. 2): FedAvg rounds under the fixed ``m_g`` (receive
  ``w_g ⊙ m_g``, train with the gradient masked by ``m_g``, upload, sample-weighted average). At the end of each
  Phase 2 block, personal refinement (Alg. 3): **every** client sets ``w_c`` at ``m_g ∩ m_c`` to ``w_g`` and trains
  only ``m_c − m_g`` for ``personal_epochs`` epochs, with the shared positions frozen bit-exactly; nothing is
  uploaded.

Composition: the personal masks are declared client state drawn like :class:`SparseMask`'s (shared ERK draw,
same random stream); training under a mask — with the shared part frozen during personal refinement — is the
reusable :class:`~pl_fedsparse.callbacks.masking.MaskedTraining`; readjustment is the prune/regrow rule of
:mod:`~pl_fedsparse.callbacks.prune_regrow` (schedule, |w| drop, |gradient| regrowth); personal refinement is a
fit requested after aggregation (kind ``"personal_refine"``), not run from inside a hook.

Choices the paper leaves open (each an argument; documented in ``docs/methods.md``): the initial masks (one ERK draw
shared by ``m_g`` and every ``m_c``), the readjustment rate and interval (``alpha0``, ``schedule``,
``every_n_rounds``), regrown positions starting at zero (RigL) and uploaded as such, whether the global mask's top-k
is taken per layer (at the ERK layer densities) or over the whole model (``global_mask_scope``), the number of
iterations, when personal refinement runs (once per Phase 2 block, all clients), and that 1-D tensors (biases) are
dense and shared (``dense_1d``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor
from typing_extensions import override

from pl_fedsparse.callbacks.masking import MaskedTraining, UsesMaskedTraining, random_top_masks
from pl_fedsparse.callbacks.prune_regrow import PruneRegrowSchedule, gradient_scores, prune_regrow
from pl_fedsparse.client import ClientUpdate, Message
from pl_fedsparse.context import FitContext, FitSpec, FitStage
from pl_fedsparse.errors import check
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.aggregation import masked_weighted_average
from pl_fedsparse.functional.dual import compose_personal, mask_coverage, select_global_mask
from pl_fedsparse.functional.masks import check_density, layer_densities
from pl_fedsparse.functional.sparse import expand_values, masked_values, pack_masks, packed_count, unpack_masks
from pl_fedsparse.functional.transfer import to_device, to_where

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["DualMask", "FedDST"]

Phase = Literal["mask", "global"]


class DualMask(UsesMaskedTraining):
    """DM-PFL: dual masks, two-phase training (Alg. 1-3). Owns ``client_message``, ``aggregate``,
    ``personal_state`` and ``client_masks``. Add :class:`~pl_fedsparse.callbacks.AdaptiveInference` for DM-PFL+
    (Alg. 4).

    Args:
        density: ``1 − S``, the density of ``m_g`` and every ``m_c`` (paper: S = 0.5).
        iterations: number of (Phase 1, Phase 2) repetitions over ``trainer.num_rounds`` (``0``: Phase 1 only).
            Each phase block needs at least one round, so ``trainer.num_rounds`` must be at least
            ``2 · iterations`` (a short trial of a 2-iteration config: ``--trainer.num_rounds 4`` or more, or
            ``--trainer.callbacks.DualMask.iterations 1``).
        coverage_threshold: positions held by no more than this fraction of the sampled clients are not eligible
            for the global mask (paper: 0.3).
        global_mask_scope: ``"layer"`` (top-k per tensor at its ERK density) or ``"model"`` (one magnitude
            threshold over all masked tensors).
        personal_epochs: local epochs of personal refinement (Alg. 3; default ``trainer.local_epochs``).
        alpha0: readjustment rate α_s (initial rate for the cosine schedule).
        schedule: ``"cosine"`` (FedSpa/DisPFL) or ``"constant"`` (FedDST-style: e.g. 0.01 every 10 rounds).
        every_n_rounds: readjust in Phase 1 rounds ``t`` with ``t % every_n_rounds == 0``.
        total_rounds: ``T`` of the phase schedule and of the cosine rate (default: ``trainer.num_rounds``).
        grow_batches: local batches whose |gradient| scores regrowth.
        distribution: layer densities of the initial masks, ``"erk"`` or ``"uniform"``.
        erk_power_scale: exponent of the ERK scores.
        same_mask: one initial draw for ``m_g`` and every ``m_c`` (else one per client; ``m_g`` is client 0's draw).
        mask_gradients: also mask gradients before each optimizer step (weights are re-masked after every step).
        dense_1d: leave 1-D tensors (biases) dense and shared.

    Example:
        .. code-block:: yaml

            trainer:
              callbacks:
                - class_path: pl_fedsparse.callbacks.DualMask
                  init_args: {density: 0.5, iterations: 2, coverage_threshold: 0.3}
                - class_path: pl_fedsparse.callbacks.AdaptiveInference   # DM-PFL+
    """

    def __init__(self, *, density: float = 0.5, iterations: int = 2, coverage_threshold: float = 0.3,
                 global_mask_scope: Literal["layer", "model"] = "layer", personal_epochs: int | None = None,
                 alpha0: float = 0.5, schedule: Literal["cosine", "constant"] = "cosine", every_n_rounds: int = 1,
                 total_rounds: int | None = None, grow_batches: int = 1,
                 distribution: Literal["erk", "uniform"] = "erk", erk_power_scale: float = 1.0,
                 same_mask: bool = True, mask_gradients: bool = True, dense_1d: bool = True) -> None:
        name = type(self).__name__
        check_density(density, f"{name}.density")
        check(distribution in ("erk", "uniform"), f"{name}.distribution", distribution, "one of erk, uniform")
        check(erk_power_scale >= 0, f"{name}.erk_power_scale", erk_power_scale, "a number >= 0")
        check(grow_batches >= 1, f"{name}.grow_batches", grow_batches, "an int >= 1")
        check(isinstance(iterations, int) and not isinstance(iterations, bool) and iterations >= 0,
              f"{name}.iterations", iterations, "an int >= 0")
        check(0 <= coverage_threshold < 1, f"{name}.coverage_threshold", coverage_threshold, "a number in [0, 1)")
        check(global_mask_scope in ("layer", "model"), f"{name}.global_mask_scope", global_mask_scope,
              "one of layer, model")
        check(personal_epochs is None or (isinstance(personal_epochs, int) and personal_epochs >= 1),
              f"{name}.personal_epochs", personal_epochs, "an int >= 1 or null")
        self.rule = PruneRegrowSchedule(alpha0=alpha0, schedule=schedule, every_n_rounds=every_n_rounds,
                                        total_rounds=total_rounds, owner=name)
        self.training = MaskedTraining(mask_gradients=mask_gradients)
        self.density, self.distribution, self.erk_power_scale = float(density), distribution, float(erk_power_scale)
        self.same_mask, self.dense_1d, self.grow_batches = same_mask, dense_1d, grow_batches
        self.total_rounds = total_rounds
        self.iterations = iterations
        self.coverage_threshold = float(coverage_threshold)
        self.global_mask_scope = global_mask_scope
        self.personal_epochs = personal_epochs
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.global_mask: dict[str, Tensor] = {}
        self._counts: dict[str, int] = {}
        self._message_cache: tuple[dict[str, Tensor], dict[str, Tensor], Message] | None = None
        self._global_on: tuple[dict[str, Tensor], str, dict[str, Tensor]] | None = None

    #: device copies of ``m_g``, made once per mask and device (``_global_where``)
    scratch_attributes = ("_global_on",)
    #: ``on_client_fit_end`` works where the update is (masks moved there; see :meth:`_global_where`)
    device_update = True

    @property
    def state_key(self) -> str:
        return self._generate_state_key(density=self.density, iterations=self.iterations)

    # ---- schedule ------------------------------------------------------------------------------------------------
    def _boundaries(self, loop: FederationView) -> list[int]:
        """First round of each block: ``round(i · T / (2 · iterations))`` (Python's round, half to even)."""
        blocks = 2 * self.iterations
        total = self.total_rounds or loop.num_rounds
        return [round(i * total / blocks) for i in range(blocks + 1)]

    def phase(self, loop: FederationView, round_idx: int) -> Phase:
        """``"mask"`` (Phase 1, Alg. 1) or ``"global"`` (Phase 2 global refinement, Alg. 2) for ``round_idx``."""
        if self.iterations == 0:
            return "mask"
        b = self._boundaries(loop)
        block = max(i for i in range(len(b) - 1) if b[i] <= round_idx) if round_idx < b[-1] else len(b) - 2
        return "mask" if block % 2 == 0 else "global"

    def refines_personal_after(self, loop: FederationView, round_idx: int) -> bool:
        """Whether round ``round_idx`` closes a Phase 2 block (personal refinement, Alg. 3, follows it)."""
        if self.iterations == 0:
            return False
        b = self._boundaries(loop)
        return any(round_idx + 1 == b[i] and b[i] > b[i - 1] for i in range(2, len(b), 2))

    # ---- state ---------------------------------------------------------------------------------------------------
    def _masked(self, name: str) -> bool:
        return name in self.global_mask

    def draw_mask(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """The initial ``m_c`` (client 0's draw is also ``m_g``): random scores from the ``mask`` stream, top-k at
        the ERK (or uniform) layer densities."""
        key = 0 if self.same_mask else client_idx + 1
        densities = layer_densities(self.shapes, self.density, self.distribution, self.erk_power_scale, self.dense_1d)
        return random_top_masks(loop, self.shapes, key, self.density, densities)

    def masks(self, loop: FederationView, client_idx: int, like: Tensor | None = None) -> dict[str, Tensor]:
        """``m_c`` (unpacked, bool) — where ``like`` is, unpacked there, when given (in a fit the packed mask crossed
        with the start weights, ``ClientStateStore.prefetch``: moving it copies nothing across the link)."""
        packed = self.get_client_state(loop, client_idx, "mask")
        return unpack_masks(packed if like is None else to_where(packed, like), self.shapes)

    def _global_where(self, like: Tensor | None) -> dict[str, Tensor]:
        """``m_g`` where ``like`` is: copied to a device once per global mask (it changes at aggregation only)."""
        if like is None or not transfer.on_a_device([like]):
            return self.global_mask
        cached = self._global_on
        if cached is None or cached[0] is not self.global_mask or cached[1] != str(like.device):
            cached = self._global_on = (self.global_mask, str(like.device), to_device(self.global_mask, like.device,
                                                                                    share=False))
        return cached[2]

    def set_masks(self, loop: FederationView, client_idx: int, masks: dict[str, Tensor]) -> None:
        self.set_client_state(loop, client_idx, "mask", pack_masks(masks))

    def personal_weights(self, loop: FederationView, client_idx: int, masks: dict[str, Tensor]) -> dict[str, Tensor]:
        """``w_c`` as dense tensors (zero outside ``m_c``) for the masked tensors, where ``masks`` are."""
        values = self.get_client_state(loop, client_idx, "weights")
        like = next(iter(masks.values()), None)
        if like is not None:
            values = to_where({n: values[n] for n in masks}, like)
        out = {}
        for name, m in masks.items():
            out[name] = expand_values(values[name], m)
        return out

    def _store_weights(self, loop: FederationView, client_idx: int, state: dict[str, Tensor],
                       masks: dict[str, Tensor], counts: dict[str, int] | None = None) -> None:
        """Keep ``w_c`` as its values at ``masks``' positions (``counts``: how many each holds, known on the host —
        on a device the values are then gathered without a wait, :func:`~pl_fedsparse.functional.sparse.masked_values`)."""
        names = list(masks)
        values = masked_values([state[n] for n in names], [masks[n] for n in names],
                               None if counts is None else [counts[n] for n in names])
        self.set_client_state(loop, client_idx, "weights", dict(zip(names, values)))

    def _mask_counts(self, loop: FederationView, client_idx: int, like: Tensor | None) -> dict[str, int] | None:
        """How many positions each of ``m_c``'s masks holds, read from its bytes on the host (a readjustment keeps
        them) — where the update is on a device; ``None`` on the host, where reading the masks waits for nothing."""
        if like is None or not transfer.on_a_device([like]):
            return None
        return {n: packed_count(p) for n, p in self.get_client_state(loop, client_idx, "mask").items()}

    @override
    def setup_federation(self, loop: FederationView) -> None:
        total = self.total_rounds or loop.num_rounds
        check(self.iterations == 0 or total >= 2 * self.iterations, f"{type(self).__name__}.iterations",
              self.iterations, f"at most {total // 2} for {total} rounds (each phase needs a round), or 0")
        self.shapes = {k: tuple(v.shape) for k, v in loop.initial_state.items() if v.is_floating_point()}
        init = loop.initial_state
        self.add_client_state(loop, "mask", lambda k: pack_masks(self.draw_mask(loop, k)))  # m_c
        self.add_client_state(loop, "weights", lambda k: {name: init[name][m].clone()
                                                           for name, m in self.masks(loop, k).items()})
        self.global_mask = {k: m.clone() for k, m in self.draw_mask(loop, 0).items()}  # m_g: the shared draw
        # m_g keeps as many positions per layer as the initial ERK draw (the personal masks' exact counts)
        self._counts = {k: int(m.sum()) for k, m in self.global_mask.items()}
        self._upload_zero_share: float | None = None
        self._zeros_cum = [0, 0]  # zeros and positions uploaded in every round so far (checkpointed)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"global_mask": pack_masks(self.global_mask), "upload_zeros": torch.tensor(self._zeros_cum)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "global_mask" in state_dict:
            self.global_mask = unpack_masks(state_dict["global_mask"], self.shapes)
        if "upload_zeros" in state_dict:
            self._zeros_cum = [int(x) for x in state_dict["upload_zeros"].tolist()]

    # ---- policies ------------------------------------------------------------------------------------------------
    def _global_message(self, loop: FederationView) -> Message:
        """``m_g`` and ``m_g ⊙ w_g``; the masked tensors are computed once per (w_g, m_g) pair and shared by every
        recipient (aggregation and resume replace both objects, which invalidates the cache); each call returns its
        own Message, so ``on_client_message`` hooks may replace entries."""
        glob = loop.global_state
        assert glob is not None
        cached = self._message_cache
        if cached is None or cached[0] is not glob or cached[1] is not self.global_mask:
            tensors = {k: (v * self.global_mask[k].to(v.dtype) if self._masked(k) else v) for k, v in glob.items()}
            cached = self._message_cache = (glob, self.global_mask, Message(tensors, dict(self.global_mask)))
        return Message(dict(cached[2].tensors), dict(cached[2].masks))

    @override
    def client_message(self, loop: FederationView, client_idx: int) -> Message | None:
        return self._global_message(loop)  # Alg. 1 line 4 / Alg. 2 line 4: m_g and m_g ⊙ w_g

    @override
    def client_masks(self, loop: FederationView, client_idx: int) -> dict[str, Tensor] | None:
        return self.masks(loop, client_idx)

    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        """Eq. 4: ``θ_c = w_g ⊙ (m_g ∩ m_c) + w_c ⊙ (m_c − m_g)`` (unmasked tensors: ``w_g``)."""
        assert loop.global_state is not None
        masks = self.masks(loop, client_idx)
        w_c = self.personal_weights(loop, client_idx, masks)
        state = dict(loop.global_state)
        for name, m_c in masks.items():
            state[name] = compose_personal(loop.global_state[name], self.global_mask[name], w_c[name], m_c)
        return state

    #: ``aggregate`` runs on the fits' device where they run on one (Eq. 5's masked average and the new ``m_g``,
    #: chosen there without a wait; ``m_g`` comes to the host in one copy, its device copy kept for the fits)
    device_aggregate = True

    @override
    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        glob = loop.global_state
        sent = [u for u in updates if u.message is not None]
        if glob is None or not sent:
            return glob
        weights = [float(u.n_samples) for u in sent]
        masks = [u.message.masks for u in sent]  # type: ignore[union-attr]
        new: dict[str, Tensor] = {}
        for name, w in glob.items():
            if not w.is_floating_point():
                new[name] = w
                continue
            vals = [u.message.tensors[name] for u in sent]  # type: ignore[union-attr]
            ms = [m.get(name) for m in masks]
            # Eq. 5 (Phase 1) / masked FedAvg (Phase 2, all masks = m_g): positions nobody holds keep w_g
            new[name] = masked_weighted_average(vals, weights, ms, fallback=w)
        if self.phase(loop, sent[0].round_idx) == "mask":
            coverage = {k: mask_coverage([m[k] for m in masks]) for k in self.global_mask}
            chosen = select_global_mask({k: new[k] for k in self.global_mask}, coverage, len(sent),
                                        self._counts, self.coverage_threshold, self.global_mask_scope)
            self.global_mask = transfer.to_host(chosen, share=False)  # (the server's copy: checkpoints, messages)
            if transfer.on_a_device(chosen.values()):  # chosen on the device:
                device = next(iter(chosen.values())).device  # the fits find it there (_global_where)
                self._global_on = (self.global_mask, str(device), chosen)
            self._place_global(loop)
        return new

    @override
    def on_federation_start(self, loop: FederationView) -> None:
        super().on_federation_start(loop)
        self._place_global(loop)  # (m_g drawn in setup_federation, or restored from a checkpoint)

    def _place_global(self, loop: FederationView) -> None:
        """The server's ``m_g`` to the device the clients train on, once each time it changes (here, not in the
        next fit: the fits then find it there, :meth:`_global_where`)."""
        model = getattr(loop, "model", None)  # (a view without a working module: nothing to place)
        self._global_where(next(iter(model.parameters()), None) if model is not None else None)

    # ---- client fits ---------------------------------------------------------------------------------------------
    def fit_mode(self, loop: FederationView, context: FitContext) -> str:
        """``"personal"`` (Alg. 3) for a personal-refinement fit, else the round's phase."""
        return "personal" if context.kind == "personal_refine" else self.phase(loop, context.round_idx)

    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        mode = self.fit_mode(loop, context)
        params: dict[str, Tensor] = dict(module.named_parameters())
        like = next(iter(params.values()), None)
        glob = self._global_where(like)
        if mode == "global":  # Alg. 2: train w_g ⊙ m_g
            self.training.begin(module, {k: m.clone() for k, m in glob.items()}, apply=False)
            return
        # composed where the weights are: the client's masks and personal weights crossed with the start weights
        # (ClientStateStore.prefetch), the global mask is there already (_global_where)
        m_c = self.masks(loop, context.client_idx, like)
        w_c = self.personal_weights(loop, context.client_idx, m_c)
        with torch.no_grad():
            for name in m_c:  # start: w_g at m_g ∩ m_c (Alg. 1 line 6, Alg. 3 line 3), w_c at m_c − m_g
                p = params[name]
                p.copy_(compose_personal(p.detach(), glob[name], w_c[name], m_c[name]).to(p.dtype))
        if mode == "mask":  # Alg. 1 lines 7-9: train under m_c
            self.training.begin(module, m_c, apply=False)
            return
        # Alg. 3 line 6: only m_c − m_g moves; the shared part (and every unmasked tensor) is frozen bit-exactly
        trainable = {k: m & ~glob[k] for k, m in m_c.items()}
        frozen = {k: params[k].detach() * (m_c[k] & glob[k]).to(params[k].dtype) for k in m_c}
        for name, p in params.items():
            if name not in m_c:
                trainable[name] = torch.zeros_like(p, dtype=torch.bool)
                frozen[name] = p.detach().clone()
        self.training.begin(module, trainable, frozen, apply=False)

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        assert update.context is not None
        mode = self.fit_mode(loop, update.context)
        self.training.end()
        k = update.client_idx
        like = next(iter(update.state.values()), None)
        glob = self._global_where(like)
        if mode == "global":  # Alg. 2 line 9: upload w ⊙ m_g
            update.masks = dict(self.global_mask)
            update.message = Message({n: (v * glob[n].to(v.dtype) if self._masked(n) else v)
                                      for n, v in update.state.items()}, dict(glob))
            return
        counts = self._mask_counts(loop, k, like)  # (before the readjusted mask is set)
        m_c = self.masks(loop, k, like)
        update.masks = m_c
        if mode == "personal":  # Alg. 3: keep w_c, upload nothing
            self._store_weights(loop, k, update.state, m_c, counts)
            update.message = None
            return
        new = m_c
        rate = self.rule.rate(loop, update.round_idx)
        if update.kind == "train" and rate > 0 and m_c:  # Alg. 1 lines 10-12: prune by |w|, regrow by |gradient|
            grow = gradient_scores(loop, update, list(m_c), self.grow_batches)
            new = prune_regrow(m_c, {n: update.state[n].abs() for n in m_c}, grow, rate)
            self.set_masks(loop, k, new)
            update.extras["next_mask"] = new
        self._store_weights(loop, k, update.state, new, counts)  # regrown positions start at zero (RigL)
        # Alg. 1 line 13: upload w_c ⊙ m_c and m_c (the readjusted mask)
        update.message = Message({n: (v * new[n].to(v.dtype) if n in new else v) for n, v in update.state.items()},
                                 dict(new))

    @override
    def fit_requests(self, loop: FederationView, stage: FitStage, updates: Sequence[ClientUpdate]) -> list[FitSpec]:
        if stage != "after_aggregate" or not self.refines_personal_after(loop, loop.round_idx):
            return []
        assert loop.global_state is not None
        message = self._global_message(loop)  # Alg. 3 line 2: every client receives m_g and m_g ⊙ w_g
        start = {**loop.global_state, **message.tensors}
        return [FitSpec(k, "personal_refine", start, epochs=self.personal_epochs or loop.local_epochs,
                        download=message) for k in range(loop.num_clients)]

    # ---- evaluation and reporting --------------------------------------------------------------------------------
    @override
    def evaluation_start_is_shared(self, loop: FederationView, kind: str) -> bool:
        return True  # the global kind gets the global mask m_g, the same for every client; nothing else changes

    @override
    def on_client_evaluate_start(self, loop: FederationView, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind == "global":  # θ_g = w_g ⊙ m_g
            with torch.no_grad():
                for name, p in module.named_parameters():
                    if self._masked(name):
                        p.mul_(self.global_mask[name].to(p.device, p.dtype))

    @override
    def on_before_aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> None:
        # the share of uploaded mask positions that carry an exact zero (regrown positions start at zero and go into
        # Eq. 5 as such): what the readjustment rate α_s costs the aggregation (the α_s study, papers/dmpfl/README.md)
        zeros = sent = 0
        for u in (u for u in updates if u.kind == "train"):
            if u.message is None:
                continue
            for name, m in u.message.masks.items():
                v = u.message.tensors.get(name)
                if v is None:
                    continue
                m = m.to(torch.bool)
                sent += int(m.sum())
                zeros += int((m & (v == 0)).sum())
        self._upload_zero_share = zeros / sent if sent else None
        self._zeros_cum = [self._zeros_cum[0] + zeros, self._zeros_cum[1] + sent]

    @override
    def on_round_end(self, loop: FederationView, round_idx: int, metrics: dict[str, Any]) -> None:
        share, self._upload_zero_share = self._upload_zero_share, None
        if share is not None:
            metrics["upload_zero_share"] = share  # this round's uploads
        if self._zeros_cum[1]:
            metrics["upload_zero_share_cum"] = self._zeros_cum[0] / self._zeros_cum[1]  # every upload so far
        metrics["dmpfl_phase"] = 1 if self.phase(loop, round_idx) == "mask" else 2
        total = sum(m.numel() for m in self.global_mask.values())
        metrics["global_mask_density"] = sum(int(m.sum()) for m in self.global_mask.values()) / max(total, 1)


class FedDST(DualMask):
    """FedDST (Bibikar et al., AAAI 2022) — generic sparse FL with server-synchronised masks, as DM-PFL's baseline.

    One global sparse model: every sampled client starts from ``m_g ⊙ w_g`` under ``m_c = m_g``, trains, readjusts
    its mask by prune-and-regrow, and uploads; the server averages per position over the clients holding it and
    keeps the top ``1 − S`` positions by magnitude (no coverage threshold). The personal model is the global one.

    Args:
        alpha0: readjustment rate (FedDST: 0.01, constant).
        every_n_rounds: readjustment interval (FedDST: 10 rounds).
        coverage_threshold: positions held by no more than this fraction of the sampled clients are ignored by the
            server's top-k (FedDST: none, 0).
        global_mask_scope, grow_batches, distribution, dense_1d: as in :class:`DualMask`.
    """

    def __init__(self, *, density: float = 0.5, alpha0: float = 0.01,
                 schedule: Literal["cosine", "constant"] = "constant", every_n_rounds: int = 10,
                 coverage_threshold: float = 0.0, global_mask_scope: Literal["layer", "model"] = "layer",
                 grow_batches: int = 1, distribution: Literal["erk", "uniform"] = "erk",
                 dense_1d: bool = True) -> None:
        super().__init__(density=density, iterations=0, coverage_threshold=coverage_threshold,
                         global_mask_scope=global_mask_scope, alpha0=alpha0, schedule=schedule,
                         every_n_rounds=every_n_rounds, grow_batches=grow_batches, distribution=distribution,
                         dense_1d=dense_1d)

    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        assert loop.global_state is not None
        self.set_masks(loop, context.client_idx, self.global_mask)  # masks are synchronised by the server
        self._store_weights(loop, context.client_idx, loop.global_state, self.global_mask)
        super().on_client_fit_start(loop, module, context)

    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        assert loop.global_state is not None
        return self._global_message(loop).tensors
