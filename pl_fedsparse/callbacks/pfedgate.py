"""pFedGate in a federation: :class:`PFedGate` (Chen, Yao, Gao, Ding, Li, "Efficient Personalized Federated Learning
via Sparse Model-Adaptation", ICML 2023, arXiv 2305.02776; the authors' code ``yxdyc/pFedGate@b8cfa156``, "the
code" below).

Every client owns a private gating layer φ_i (:class:`~pl_fedsparse.models.gate.GatingLayer`). On every batch
(Alg. 1 lines 3-7) the gate maps the raw input to block importances ``G`` and gated weights ``M``; the knapsack turns
``G`` into the binary block index ``I*`` under the client's density budget ``s_i`` (Eq. 6), the straight-through
estimator gives ``M' = I_ST ⊙ M`` (App. A) and the batch runs through the sparse personalised model
``θ' = θ ⊙ expand(M')`` by a functional forward — the global weights are never written. One backward fills the
gradients of θ and φ; the gate steps with its own SGD, the model with the module's optimizer. The maths is
:mod:`pl_fedsparse.functional.gate`; this module wires it into the loop:

* **client state** (never uploaded, never aggregated, never counted as traffic; checkpointed and restored): the
  gate's parameters and BN/SN statistics (``gate``) and its SGD momentum (``gate_optimizer``, persistent across
  rounds as in the code, ``utils/optim.py`` objects kept per client).
* **the forward**: during a fit of kind ``"train"`` (and ``"finetune"``: gate-only adaptation, global model frozen —
  the paper's novel clients, App. I.1) the working module's ``forward`` is replaced by the gated one; during the
  evaluation of a client's ``"personal"`` model too (gate in eval mode, one mask per test batch as the code's
  evaluation, ``gate_aggregator.py``). The ``"global"`` kind is the dense θ. A training batch of one sample (the
  gate's BatchNorm1d needs two) runs with the gate in eval mode and steps nothing — the code skips it
  (``gated_learner.py:377``); its loss still enters ``train_loss``. Under ``16-mixed`` the gate's gradients, which
  Lightning's scaler does not unscale (they are not in the module's optimizer), are divided by the loss scale before
  the gate's clip and step, and the step is skipped when they are not finite; the gate's maths runs in float32.
* **aggregation** (one switch, ``aggregation``): ``"fedavg"`` — the code's dense sample-weighted FedAvg of the
  trained models (``gate_aggregator.py:78-189``; default, reproduces Table 1), ``"index"`` — the paper's index-wise
  average over the union of the blocks each client selected in the round (App. A), ``"ewa"`` — FedPSE's element-wise
  rule over the non-zero entries of each client's update
  (:func:`~pl_fedsparse.functional.elementwise_average`).
* **bytes**: ``"fedavg"`` uploads the dense model; ``"index"`` the values of the union's blocks plus an ``L``-bit
  block index (:func:`~pl_fedsparse.functional.gate_upload.pack_blocks`); ``"ewa"`` the update's non-zeros with
  their element indices (bitmap or int32 indices, whichever is smaller). The gate never travels.
* **metrics**: ``gate_density`` — the paper's achieved density ``s' = nnz(θ')/d`` (first blocks included, as its
  0.43 / 0.25), averaged over each client's evaluation batches (weighted by batch size) and then over clients (the
  code's ``sparse_ratio_selected``, which leaves the first blocks out, is not reported); ``gate_density_train`` —
  the same over the round's training batches of the participants; ``gate_upload_ratio`` — ``q``, the share of
  parameters in the union of the blocks a participant selected during the round (Table 5), mean over participants.
  Training FLOPs are charged at the achieved per-batch density: ``update.masks`` holds, per parameter, a mask whose
  density is the batch-averaged kept share of that tensor (what :class:`~pl_fedsparse.metrics.TrainFlops` prices;
  a layer's FLOPs are linear in its density, so the average is exact), and the gate's own forward/backward FLOPs
  are charged on top. The round's union of kept blocks is ``update.extras["pfedgate_union"]``.
* **many clients at once**: under :class:`~pl_fedsparse.executors.VectorizedExecutor` a round's fits run stacked —
  every client's gate, knapsack, ``θ'`` and step in one set of operations
  (:mod:`~pl_fedsparse.callbacks.pfedgate_stacked`; the in-process run's results to rounding, the ``joint`` schedule
  with the greedy knapsack).

Where the paper and the authors' code differ, each choice is an argument (the functional core documents the
block maths ones):

==========================  ==================================  ==================================================
argument                    default                             other value(s)
==========================  ==================================  ==================================================
``separate_paths``          ``true``: two FC+BN paths (paper)   ``false``: one shared path (code's default
                                                                ``seperate_trans=0``, its CIFAR-10 scripts)
``split``                   ``"equal"`` (code; ≡ paper at       ``"paper"``: first block ⌊s_min·d_l⌋ (§5.2.2)
                            s_min = 1/B)
``solver`` / ``budget``     ``"greedy"`` per group (code;       ``"exact"`` / ``"global"`` (Eq. 6)
                            reproduces s' = 0.43 / 0.25)
``straight_through``        ``"paper"`` (App. A)                ``"code"``: dropped blocks pass no gradient to G
``relu_logits``             ``false``                           ``true``: the code's ReLU on the logits
                                                                (``models/adapted_op.py:57,103,161``)
``schedule``                ``"joint"`` (Alg. 1; the code's     ``"bilevel"``: the CLI default ``--bi_level_opt 1``
                            released scripts)                   (even epochs train only φ, odd epochs only θ)
``aggregation``             ``"fedavg"`` (code)                 ``"index"`` (paper, App. A), ``"ewa"`` (FedPSE)
``fedavg_weights``          ``"participants"``                  ``"all"``: the code's ``--aggregate_sampled_clients
                                                                0`` — non-participants add the old global model
                                                                with their sample counts (partial participation)
``same_init``               ``true``: every gate starts equal   ``false``: one draw per client
                            (code: ``torch.manual_seed`` before
                            each learner)
==========================  ==================================  ==================================================

What the code does that lives outside this callback: SGD with momentum 0.9 and weight decay 5e-4 for θ
(``model.momentum``, ``model.weight_decay``), θ's momentum kept per client across rounds
(:class:`~pl_fedsparse.callbacks.KeepOptimizerState`) and θ's gradient clipped at norm 10
(``trainer.gradient_clip_val``: Lightning clips only the module optimizer's parameters, so the two clips stay per
module as in the code, ``gated_learner.py:282-362``). The code's ``multi_step`` scheduler (×0.1 at 3T/4 for both
learning rates) is ``lr_milestones: [0.75]``; its ``reduce_on_plateau`` is driven by test accuracy and is not
offered.

Example (``configs/synthetic_pfedgate.yaml``):
    .. code-block:: yaml

        model: {momentum: 0.9, weight_decay: 5.0e-4}
        trainer:
          gradient_clip_val: 10.0
          callbacks:
            - class_path: pl_fedsparse.callbacks.PFedGate
              init_args: {density: 0.5, gate_lr: 1.5, separate_paths: false}
            - class_path: pl_fedsparse.callbacks.KeepOptimizerState
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from typing_extensions import override

from pl_fedsparse.callbacks.base import (
    FederatedCallback,
    graph_outputs_reused,
    outside_graphs,
    replace_methods,
    restore_methods,
)
from pl_fedsparse.callbacks.fedpse import DELTA
from pl_fedsparse.client import ClientUpdate, Message, to_cpu_state
from pl_fedsparse.context import FitContext
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.metrics import PendingMetric
from pl_fedsparse.functional.aggregation import weighted_average
from pl_fedsparse.functional.gate import (
    BlockTable,
    adapt_gated_weights,
    block_span_tensors,
    block_table,
    code_s_min,
    personalized_params,
    select_blocks,
)
from pl_fedsparse.functional.gate_sliced import sliced_forward
from pl_fedsparse.functional.gate_upload import index_wise_average, pack_blocks, unpack_blocks
from pl_fedsparse.functional.pse import elementwise_average
from pl_fedsparse.functional.sparse import segment_layout
from pl_fedsparse.functional.transfer import clone_tensors, to_device, to_where
from pl_fedsparse.models.gate import GatingLayer, adapted_forward
from pl_fedsparse.streams import register_stream

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["BLOCKS", "UNION", "PFedGate"]

log = logging.getLogger(__name__)

#: name of the bare ``L``-bit block index in an ``aggregation: index`` upload
BLOCKS = "pfedgate.blocks"
#: ``update.extras[UNION]``: the bool ``[L]`` union of the blocks a client selected during its fit
UNION = "pfedgate_union"
register_stream("pfedgate.init")  # the gates' initial weights, keyed by client (0: shared by all)

Aggregation = Literal["fedavg", "index", "ewa"]


def _num(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class PFedGate(FederatedCallback):
    """pFedGate: private per-client gates that adapt the global model into a block-sparse personal one (see the
    module docstring for the wiring, the metrics and the paper-vs-code table).

    Owns the ``aggregate`` policy (``aggregation``) and the ``personal_state`` policy (the global model, evaluated
    through the client's gate).

    Args:
        density: every client's budget ``s`` in (0, 1] (paper: 1, 0.5, 0.3); at least ``1/num_splits`` with
            ``split: equal`` (the code's s < 1/B keeps every first block and would silently exceed the budget).
        client_densities: heterogeneous budgets, client ``i`` gets ``client_densities[i % len]`` (DisPFL-style
            mixed resources, e.g. ``[0.3, 0.5, 1.0]``); overrides ``density``.
        num_splits: the split factor ``B`` (5 in every experiment of the paper).
        split: ``"equal"`` (code) or ``"paper"`` (first block of ``⌊s_min·d_l⌋``).
        s_min: the paper split's first-block share (default ``1/B``); only with ``split: paper``.
        solver: ``"greedy"`` (code) or ``"exact"`` (Eq. 6).
        budget: ``"group"`` (code: linear / non-linear blocks separately), ``"global"`` (Eq. 6) or ``null`` (the
            solver's own: group for greedy, global for exact).
        straight_through: ``"paper"`` or ``"code"`` (App. A vs ``gated_learner.py:204-225``).
        separate_paths: two FC+BN gate paths (paper) or one shared path (the code's ``seperate_trans=0``).
        relu_logits: apply the code's ReLU to the personalised model's logits (default off).
        gate_lr: η, the gate's learning rate (paper Table 7; e.g. CIFAR-10 s = 0.5: 1.5).
        gate_momentum: the gate SGD's momentum (code: 0.9); its buffers persist across rounds per client.
        gate_weight_decay: the gate SGD's weight decay (code: 5e-4).
        gate_clip: clip the gate's gradient norm at this value before its step (code: 10); ``null``: no clipping.
        schedule: ``"joint"`` (one backward, both steps on every batch) or ``"bilevel"`` (the code's CLI default
            ``--bi_level_opt 1``: within a fit, even epochs train only the gate, odd epochs only the model, both
            through the gated forward; set ``trainer.local_epochs`` to twice the code's ``--local_steps``). Whether
            the code's model epochs keep the gate in training mode was not established; here they do, so its
            BN/SN running statistics move in both kinds of epoch.
        lr_milestones: fractions of ``trainer.num_rounds`` from which both learning rates (η and the module's η_g)
            are multiplied by another ``lr_gamma`` (the code's ``multi_step``: ``[0.75]``); ``null``: none.
        lr_gamma: the factor of each milestone (code: 0.1).
        aggregation: ``"fedavg"`` (code), ``"index"`` (paper) or ``"ewa"`` (element-wise).
        fedavg_weights: ``"participants"`` or ``"all"`` (with ``aggregation: fedavg``; see the module docstring).
        same_init: every client's gate starts from the same weights (code) instead of its own draw.
        compute: how the sparse personalised model runs: ``"masked"`` (default, the code: dense ops on
            ``θ' = θ ⊙ expand(M')``) or ``"sliced"`` (conv/linear layers computed on the output rows with a kept
            element only, :mod:`~pl_fedsparse.functional.gate_sliced`; the same logits and gradients to θ and the
            gate, to float tolerance — a speed-up only, see ``benchmarks/README.md``).
    """

    #: per-fit / per-evaluation state: the client's gate budget, its optimizer and pending momentum, the step
    #: schedule and statistics; the trained gate and momentum leave in client state, the statistics in the update;
    #: the gated forward installed in the module and what it shadows (a compiled ``forward``, put back after it)
    scratch_attributes = ("_ctx", "_client_density", "_clip_floor", "_reentrant", "_module", "_gate_opt",
                          "_pending_opt", "_pending_gate", "_captured", "_start", "_step_gate", "_step_model",
                          "_skip_step", "_stats", "_bound_forward", "_shadowed", "_stats_outside")

    def __init__(
        self, *, density: float = 0.5, client_densities: list[float] | None = None, num_splits: int = 5,
        split: Literal["equal", "paper"] = "equal", s_min: float | None = None,
        solver: Literal["greedy", "exact"] = "greedy", budget: Literal["group", "global"] | None = None,
        straight_through: Literal["paper", "code"] = "paper", separate_paths: bool = True, relu_logits: bool = False,
        gate_lr: float = 0.1, gate_momentum: float = 0.9, gate_weight_decay: float = 5.0e-4,
        gate_clip: float | None = 10.0, schedule: Literal["joint", "bilevel"] = "joint",
        lr_milestones: list[float] | None = None, lr_gamma: float = 0.1, aggregation: Aggregation = "fedavg",
        fedavg_weights: Literal["participants", "all"] = "participants", same_init: bool = True,
        compute: Literal["masked", "sliced"] = "masked",
    ) -> None:
        name = "PFedGate"
        check(isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits >= 2,
              f"{name}.num_splits", num_splits, "an int >= 2 (the split factor B)")
        check(split in ("equal", "paper"), f"{name}.split", split, "'equal' (the code) or 'paper' (§5.2.2)")
        check(s_min is None or (split == "paper" and _num(s_min) and 0 < s_min < 1), f"{name}.s_min", s_min,
              "null, or a number in (0, 1) with split: paper")
        floor = (1.0 / num_splits) if split == "equal" else (s_min if s_min is not None else 1.0 / num_splits)
        densities = [density] if client_densities is None else list(client_densities)
        check(client_densities is None or len(densities) > 0, f"{name}.client_densities", client_densities,
              "a non-empty list of densities or null")
        param = f"{name}.density" if client_densities is None else f"{name}.client_densities"
        for d in densities:
            check(_num(d) and 0 < d <= 1, param, d, "a density in (0, 1]")
            check(d >= floor - 1e-12, param, d,
                  f"a density >= {floor:g} with split={split!r} and num_splits={num_splits}: every tensor's first "
                  "block is always kept (the code's s < 1/B keeps it too and misses the budget); use split: paper "
                  "with s_min <= density, or a larger num_splits")
        check(solver in ("greedy", "exact"), f"{name}.solver", solver, "'greedy' (the code) or 'exact' (Eq. 6)")
        check(budget in (None, "group", "global"), f"{name}.budget", budget, "null, 'group' (the code) or 'global'")
        check(straight_through in ("paper", "code"), f"{name}.straight_through", straight_through,
              "'paper' (App. A) or 'code'")
        for flag, value in (("separate_paths", separate_paths), ("relu_logits", relu_logits),
                            ("same_init", same_init)):
            check(isinstance(value, bool), f"{name}.{flag}", value, "true or false")
        check(_num(gate_lr) and gate_lr > 0, f"{name}.gate_lr", gate_lr, "a number > 0")
        check(_num(gate_momentum) and 0 <= gate_momentum < 1, f"{name}.gate_momentum", gate_momentum,
              "a number in [0, 1)")
        check(_num(gate_weight_decay) and gate_weight_decay >= 0, f"{name}.gate_weight_decay", gate_weight_decay,
              "a number >= 0")
        check(gate_clip is None or (_num(gate_clip) and gate_clip > 0), f"{name}.gate_clip", gate_clip,
              "a number > 0 or null")
        check(schedule in ("joint", "bilevel"), f"{name}.schedule", schedule, "'joint' (Alg. 1) or 'bilevel'")
        check(lr_milestones is None or (isinstance(lr_milestones, (list, tuple))
                                        and all(_num(f) and 0 < f <= 1 for f in lr_milestones)),
              f"{name}.lr_milestones", lr_milestones, "null or a list of fractions of num_rounds in (0, 1]")
        check(_num(lr_gamma) and 0 < lr_gamma <= 1, f"{name}.lr_gamma", lr_gamma, "a number in (0, 1]")
        check(aggregation in ("fedavg", "index", "ewa"), f"{name}.aggregation", aggregation,
              "'fedavg' (the code), 'index' (the paper, App. A) or 'ewa' (element-wise)")
        check(fedavg_weights in ("participants", "all"), f"{name}.fedavg_weights", fedavg_weights,
              "'participants' or 'all' (the code's --aggregate_sampled_clients 0)")
        check(compute in ("masked", "sliced"), f"{name}.compute", compute,
              "'masked' (dense θ', the code) or 'sliced' (only the kept output rows)")
        self.density = float(density)
        self.client_densities = [float(d) for d in client_densities] if client_densities is not None else None
        self.num_splits, self.split, self.s_min = num_splits, split, s_min
        self.solver, self.budget, self.straight_through = solver, budget, straight_through
        self.separate_paths, self.relu_logits, self.same_init = separate_paths, relu_logits, same_init
        self.gate_lr, self.gate_momentum = float(gate_lr), float(gate_momentum)
        self.gate_weight_decay = float(gate_weight_decay)
        self.gate_clip = None if gate_clip is None else float(gate_clip)
        self.schedule = schedule
        self.lr_milestones = sorted(float(f) for f in lr_milestones) if lr_milestones else []
        self.lr_gamma = float(lr_gamma)
        self.aggregation, self.fedavg_weights = aggregation, fedavg_weights
        self.compute = compute
        # set up with the federation
        self.table: BlockTable | None = None
        self.gate: GatingLayer | None = None  #: the working gate: a client's state is loaded into it per fit / eval
        self.gate_flops: tuple[float, float] = (0.0, 0.0)  #: (forward, forward + backward) FLOPs per sample
        self._template: dict[str, Tensor] = {}
        self._num_rounds = 1
        # per fit / evaluation
        self._ctx: FitContext | None = None
        self._client_density = self.density
        self._clip_floor = 0.0
        self._reentrant = False
        self._module: nn.Module | None = None
        self._shadowed: dict[str, Any] = {}
        self._gate_opt: torch.optim.Optimizer | None = None
        self._pending_opt: dict[str, Tensor] = {}
        # a fit's gate, on the working gate's device, until the fit trains in process (on_train_start loads it into
        # the working gate) or is stacked (the vectorised form reads it: never loaded, copied or read back)
        self._pending_gate: dict[str, Tensor] | None = None
        self._captured: tuple[dict[str, Tensor], dict[str, Tensor]] | None = None
        self._start: dict[str, Tensor] = {}
        self._step_gate = self._step_model = True
        self._skip_step = False
        self._stats: dict[str, Any] = {}
        self._stats_outside = False
        self._eval_density: dict[int, float] = {}
        self._round_train: list[tuple[float, float]] = []

    # ---- budgets ----------------------------------------------------------------------------------------------
    def client_density(self, client_idx: int) -> float:
        """The budget ``s_i`` of ``client_idx``."""
        if self.client_densities:
            return self.client_densities[client_idx % len(self.client_densities)]
        return self.density

    def clip_floor(self, density: float) -> float:
        """``s_min``, the floor ``G`` is clipped at: the code's ``min(max(1/B, 0.1), s)`` (``gated_learner.py:49``)
        with the equal split, the first-block share with the paper split."""
        if self.split == "paper":
            return self.s_min if self.s_min is not None else 1.0 / self.num_splits
        return code_s_min(self.num_splits, density)

    def lr_factor(self, lr_round: int) -> float:
        """``lr_gamma ** (milestones passed)`` at round ``lr_round`` (a milestone ``f`` is round ``round(f·T)``)."""
        passed = sum(1 for f in self.lr_milestones if lr_round >= round(f * self._num_rounds))
        return self.lr_gamma ** passed

    # ---- set-up -----------------------------------------------------------------------------------------------
    def _new_gate(self, seed: int, in_shape: Sequence[int]) -> GatingLayer:
        assert self.table is not None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return GatingLayer(self.table.num_blocks, in_channels=int(in_shape[0]),
                               input_size=(int(in_shape[1]), int(in_shape[2])), separate_paths=self.separate_paths)

    @override
    def setup_federation(self, loop: FederationView) -> None:
        assert loop.model is not None
        x = loop.datamodule.example_input(2)
        if not (x.dim() == 4 and x.shape[2] * x.shape[3] >= 2):
            raise ConfigError(f"{loop.datamodule.source_label()} is invalid for PFedGate: expected image inputs "
                              f"[N, C, H, W] for its gating layer (got inputs of shape {tuple(x.shape[1:])})")
        self._num_rounds = loop.num_rounds
        self.table = block_table(loop.model, self.num_splits, split=self.split, s_min=self.s_min)
        for d in sorted(set(self.client_densities or [self.density])):  # refuse an impossible budget now
            try:
                select_blocks(torch.full((self.table.num_blocks,), 0.5), self.table, d, solver=self.solver,
                              budget=self.budget)
            except ConfigError as e:
                raise ConfigError(f"PFedGate.{'client_densities' if self.client_densities else 'density'}: {e}") \
                    from None
        in_shape = tuple(x.shape[1:])
        template = self._new_gate(loop.streams.seed("pfedgate.init", 0), in_shape)
        self.gate = template
        self._template = to_cpu_state(template.state_dict())
        self.gate_flops = _gate_flops(self._new_gate(0, in_shape), x)

        def init_gate(k: int) -> dict[str, Tensor]:
            if self.same_init:
                return self._template  # the same tensors for every client: no memory per client until it trains
            return to_cpu_state(self._new_gate(loop.streams.seed("pfedgate.init", k + 1), in_shape).state_dict())

        self.add_client_state(loop, "gate", init_gate)
        self.add_client_state(loop, "gate_optimizer", lambda k: {})

    @override
    def on_federation_start(self, loop: FederationView) -> None:
        if loop.global_state is None:
            raise ConfigError("trainer.topology is invalid for PFedGate: expected a server (Star); the gates adapt "
                              "a global model")

    # ---- policies ---------------------------------------------------------------------------------------------
    @override
    def personal_state(self, loop: FederationView, client_idx: int) -> dict[str, Tensor]:
        # the global θ, seen through the client's gate (a new dict, so that the evaluator never reuses these
        # logits for the "global" kind, which runs without the gate)
        if loop.global_state is None:
            raise ConfigError("trainer.topology is invalid for PFedGate: expected a server (Star)")
        return dict(loop.global_state)

    #: ``aggregate`` runs on the fits' device where they run on one (FedAvg, App. A's index-wise average and EWA are
    #: element-wise arithmetic on the uploads; the block masks are made where the uploads' block indices are)
    device_aggregate = True

    @override
    def aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        glob = loop.global_state
        sent = [u for u in updates if u.message is not None and u.kind == "train"]
        loop.set_server_update(None)
        if glob is None or not sent:
            return glob
        weights = [float(u.n_samples) for u in sent]
        if self.aggregation == "fedavg":  # the code: dense, sample-weighted (gate_aggregator.py:78-189)
            states: list[dict[str, Tensor]] = [u.message.tensors for u in sent]  # type: ignore[union-attr]
            if self.fedavg_weights == "all":  # non-participants keep the old global model with weight n_j
                rest = sum(float(loop.datamodule.num_samples(j, "train")) for j in range(loop.num_clients)) \
                    - sum(weights)
                if rest > 0:
                    states, weights = [*states, glob], [*weights, rest]
            return {**glob, **weighted_average(states, weights)}
        assert self.table is not None
        deltas = [self.decode_upload(u.message) for u in sent]  # type: ignore[arg-type]
        names = [n for n in deltas[0]]
        if self.aggregation == "index":  # App. A: every index over the clients that sent its block
            keeps = [u.message.masks[BLOCKS] for u in sent]  # type: ignore[union-attr]
            server = index_wise_average(deltas, keeps, weights, self.table)
            rest_names = [n for n in names if n not in server]  # buffers, sent dense
            if rest_names:
                server.update(weighted_average([{n: d[n] for n in rest_names} for d in deltas], weights))
        else:  # EWA: every element over the clients whose update is non-zero there
            server = {n: elementwise_average([d[n] for d in deltas], weights) for n in names}
        loop.set_server_update(server)
        return {n: (t + server[n].to(t.dtype) if n in server else t) for n, t in glob.items()}

    def decode_upload(self, message: Message) -> dict[str, Tensor]:
        """The dense update a server rebuilds from an ``"index"`` or ``"ewa"`` upload."""
        assert self.table is not None
        if BLOCKS not in message.masks:
            return dict(message.tensors)
        split = unpack_blocks({n: message.tensors[n] for n in self.table.names}, message.masks[BLOCKS], self.table)
        return {**{n: t for n, t in message.tensors.items() if n not in split}, **split}

    # ---- the gated forward ------------------------------------------------------------------------------------
    def _install(self, module: nn.Module) -> None:
        """The gated forward in ``module`` while the gate is active (an instance attribute shadowing the class's
        ``forward`` and a compiled one, which come back when it leaves)."""
        self._uninstall()  # (one installed already comes off first: what it shadowed is what the new one shadows)
        # the same bound method every fit: compiled graphs are guarded on it (replace_methods)
        gated = self.__dict__.setdefault("_bound_forward", self._gated_forward)
        self._shadowed = replace_methods(module, forward=functools.partial(gated, module))
        self._module = module
        # compiled to CUDA graphs, a step's outputs are overwritten by the next step's: the statistics are summed
        # outside the graphs (_record)
        self._stats_outside = graph_outputs_reused(module)

    def _uninstall(self) -> None:
        if self._module is not None:
            restore_methods(self._module, self._shadowed)
        self._module, self._shadowed = None, {}

    def _gated_forward(self, module: nn.Module, x: Tensor) -> Tensor:
        """Alg. 1 lines 3-4 for one batch: ``G, M = φ(x)``, ``I* = knapsack(G)``, ``M' = I_ST ⊙ M``,
        ``θ' = θ ⊙ expand(M')``, logits of ``θ'`` by ``torch.func.functional_call``."""
        if self._reentrant:  # functional_call runs the module again: its own forward, with θ' swapped in
            return type(module).forward(module, x)
        gate, table = self.gate, self.table
        assert gate is not None and table is not None
        single = gate.training and x.shape[0] < 2  # BatchNorm1d needs 2 samples: the code skips such batches
        if single:
            gate.eval()
        try:
            with torch.set_grad_enabled(torch.is_grad_enabled() and self._step_gate):
                importance, weights = gate(x, s_min=self._clip_floor)
        finally:
            if single:
                gate.train()
        m_sparse, keep = adapt_gated_weights(importance, weights, table, self._client_density, solver=self.solver,
                                             budget=self.budget, variant=self.straight_through)
        theta = personalized_params(dict(module.named_parameters()), m_sparse, table)
        self._reentrant = True
        try:
            if self.compute == "sliced":  # the same logits and gradients, dropped output rows skipped
                out = sliced_forward(module, theta, x, keep, table, dropped_grad=self.straight_through == "paper",
                                     relu_logits=self.relu_logits)
            else:
                out = adapted_forward(module, theta, x, relu_logits=self.relu_logits)
        finally:
            self._reentrant = False
        if self._stats_outside:
            outside_graphs(self._record, keep, int(x.shape[0]))
        else:
            self._record(keep, int(x.shape[0]))
        if single:
            self._skip_step = True
        return out

    def _record(self, keep: Tensor, n: int) -> None:
        """A batch's kept blocks into the fit's (or evaluation's) statistics: kept as they are and reduced once at
        the end (:class:`_KeptBlocks`; a copy where CUDA graphs overwrite them) — or, traced into a compiled step
        (not as CUDA graphs: those call this outside their graphs), added to running sums in the step's graph,
        where the compiler fuses them (masks kept in a list across steps would recompile the step every step)."""
        s, table = self._stats, self.table
        assert table is not None
        if not torch.compiler.is_compiling():
            tally = s.get("batches")
            if tally is None:
                s["batches"] = tally = _KeptBlocks(table, fit=bool(s.get("fit")), copy=self._stats_outside)
            tally.add(keep, n, self._step_gate)
            return
        owner, sizes = block_span_tensors(table, keep.device)
        kept = torch.zeros(len(table.spans), dtype=torch.int64, device=keep.device).index_add_(0, owner, sizes * keep)
        s["n"] = s.get("n", 0) + n
        density = (kept.sum() * n).double() / table.numel
        s["density"] = density if "density" not in s else s["density"] + density
        if s.get("fit"):
            s["gate_trained"] = s.get("gate_trained", 0) + (n if self._step_gate else 0)
            s["kept"] = kept * n if "kept" not in s else s["kept"] + kept * n
            s["union"] = keep.clone() if "union" not in s else s["union"] | keep

    # ---- a local fit ------------------------------------------------------------------------------------------
    def _load_gate(self, loop: FederationView, client_idx: int, optimizer: bool = True) -> None:
        assert self.gate is not None
        # the gate's weights (and, for a fit, its momentum) to where the gate is, in one copy
        gate = self.get_client_state(loop, client_idx, "gate")
        opt = self.get_client_state(loop, client_idx, "gate_optimizer") if optimizer else {}
        both = to_device({**{f"g/{n}": v for n, v in gate.items()}, **{f"o/{n}": v for n, v in opt.items()}},
                         next(self.gate.parameters()).device)
        if optimizer:  # a fit: loaded when it trains in process (on_train_start), read as it is when stacked
            self._pending_gate = {n: both[f"g/{n}"] for n in gate}
            self._pending_opt = {n: both[f"o/{n}"] for n in opt}
        else:
            self.gate.load_state_dict({n: both[f"g/{n}"] for n in gate})
        density = self.client_density(client_idx)
        self._client_density, self._clip_floor = density, self.clip_floor(density)

    @override
    def on_client_fit_start(self, loop: FederationView, module: pl.LightningModule, context: FitContext) -> None:
        self._uninstall()
        self._ctx = context if context.kind in ("train", "finetune") else None
        self._captured, self._stats, self._skip_step = None, {}, False
        if self._ctx is None:
            return
        self._load_gate(loop, context.client_idx)
        self._stats = {"fit": True}
        if context.kind == "train" and self.aggregation != "fedavg":  # θ^{t−1}, for the update Δ = θ^t − θ^{t−1}
            # (copied where the weights are: no copy across the link)
            self._start = {n: t.detach().clone() for n, t in module.state_dict().items() if t.is_floating_point()}

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        assert self.gate is not None
        if self._pending_gate is not None:  # the client's gate, from _load_gate
            self.gate.load_state_dict(self._pending_gate)
            self._pending_gate = None
        gate = self.gate.to(pl_module.device).train()
        factor = self.lr_factor(ctx.lr_round)
        self._gate_opt = torch.optim.SGD(gate.parameters(), lr=self.gate_lr * factor, momentum=self.gate_momentum,
                                         weight_decay=self.gate_weight_decay)
        if self._pending_opt:  # the gate's momentum, kept per client across rounds (the code keeps its optimizer)
            state: dict[int, dict[str, Tensor]] = {}
            moved = to_device(self._pending_opt, pl_module.device)  # (there already, unless the gate just moved)
            for key, value in moved.items():
                idx, name = key.split(".", 1)
                state.setdefault(int(idx), {})[name] = value
            self._gate_opt.load_state_dict({"state": state, "param_groups": self._gate_opt.state_dict()["param_groups"]})
        if factor != 1.0:  # the code's multi_step also decays η_g
            for group in trainer.optimizers[0].param_groups:
                group["lr"] = group["lr"] * factor
        self._install(pl_module)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        if ctx.kind == "finetune":  # novel clients adapt only their gate (App. I.1)
            self._step_gate, self._step_model = True, False
        elif self.schedule == "bilevel":  # --bi_level_opt 1: a gate epoch, then a model epoch
            gate_epoch = trainer.current_epoch % 2 == 0
            self._step_gate, self._step_model = gate_epoch, not gate_epoch
        else:
            self._step_gate = self._step_model = True

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self._ctx is None or self._gate_opt is None:
            return
        assert self.gate is not None
        skip, self._skip_step = self._skip_step, False
        if self._step_gate and not skip:
            grads = [p.grad for p in self.gate.parameters() if p.grad is not None]
            scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
            finite = True
            if scaler is not None and grads:  # 16-mixed: the module's gradients are unscaled here, the gate's not
                inv = 1.0 / float(scaler.get_scale())
                for g in grads:
                    g.mul_(inv)
                finite = all(bool(torch.isfinite(g).all()) for g in grads)
            if grads and finite:
                if self.gate_clip is not None:  # gated_learner.py: clip_grad_norm_(gate, 10), then its step
                    torch.nn.utils.clip_grad_norm_(self.gate.parameters(), self.gate_clip)
                self._gate_opt.step()
        self._gate_opt.zero_grad(set_to_none=True)
        if skip or not self._step_model:  # no gradient: SGD (and Adam) leave the parameter, momentum and decay alone
            for p in pl_module.parameters():
                p.grad = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._uninstall()
        if self._ctx is None or self._gate_opt is None or self.gate is None:
            return
        # no copy: the momentum is this fit's own (loaded from a private copy, ClientStateStore.get) and the gate's
        # optimizer is dropped below; the gate's weights are copied where they are. Stored from a device, both reach
        # the host with the fit's other entries in one copy when the fit ends (ClientStateStore.flush_writes)
        opt_state = {f"{i}.{name}": v.detach() for i, entries in
                     self._gate_opt.state_dict()["state"].items() for name, v in entries.items()
                     if isinstance(v, Tensor)}
        gate_state = self.gate.state_dict()
        self._captured = (dict(zip(gate_state, clone_tensors(list(gate_state.values())))), opt_state)
        self._gate_opt = None

    #: ``on_client_fit_end`` takes the update where the weights are: the fit's statistics stay where they were
    #: summed; the start copy is moved where the update is
    device_update = True

    @override
    def on_client_fit_end(self, loop: FederationView, module: pl.LightningModule, update: ClientUpdate) -> None:
        self._uninstall()
        ctx, self._ctx, self._gate_opt, self._pending_gate = self._ctx, None, None, None
        start, self._start = self._start, {}
        stats, self._stats = self._stats, {}
        if ctx is None:
            return
        k = update.client_idx
        if self._captured is not None:
            gate_state, opt_state = self._captured
            self.set_client_state(loop, k, "gate", gate_state)
            self.set_client_state(loop, k, "gate_optimizer", opt_state)
        self._captured = None
        table = self.table
        assert table is not None
        tally: _KeptBlocks | None = stats.get("batches")
        n = int(stats.get("n", 0)) + (tally.n if tally is not None else 0)
        if n == 0:
            return
        # the fit's statistics stay where they were summed: figures as 0-dim tensors, read on the host with the rest
        # of the update when the fit ends (update_to_host) — the same numbers as Python's: integer sums, float64
        # divisions, round half to even
        union, kept_elements = stats.get("union"), stats.get("kept")
        if tally is not None and tally.n:  # (and running sums too where dynamo left some steps eager: both added)
            kept_t, union_t = tally.totals()
            union = union_t if union is None else union | union_t
            kept_elements = kept_t if kept_elements is None else kept_elements + kept_t
            stats["gate_trained"] = stats.get("gate_trained", 0) + tally.gate_n
            _pending_density(update, tally, stats.get("density"), n)
        else:
            update.metrics["gate_density"] = stats["density"] / n
        assert union is not None and kept_elements is not None
        union = union.to(torch.bool)
        _, sizes = block_span_tensors(table, union.device)
        update.extras[UNION] = union
        update.metrics["gate_upload_ratio"] = (sizes * union).sum().double() / table.numel
        # FLOPs at the achieved per-batch density: per tensor, a mask of its batch-averaged kept share
        limits = torch.round(kept_elements.double() / n)
        numels = tuple(math.prod(shape) for shape in table.shapes)
        segment, rank = segment_layout(numels, union.device)  # (every tensor's mask at once: the first limits[i])
        kept = (rank < limits[segment]).split(numels)
        update.masks = {name: part.view(shape) for name, shape, part in zip(table.names, table.shapes, kept)}
        fwd, train = self.gate_flops  # the gate's own compute: a forward on every batch, a backward when it trains
        loop.accounting.charge_flops(k, n * fwd + stats.get("gate_trained", 0) * (train - fwd), update)
        if ctx.kind != "train" or update.message is None:
            return
        if start:
            start = to_where(start, next(iter(update.state.values())))
        if self.aggregation == "index":  # App. A: the union's blocks and their L-bit index; buffers dense
            delta = {name: update.state[name] - start[name] for name in start}
            packed = pack_blocks(delta, union, table)
            rest = {name: t for name, t in delta.items() if name not in packed}
            update.message = Message({**packed, **rest}, {BLOCKS: union})
            update.extras[DELTA] = True
        elif self.aggregation == "ewa":  # the update's non-zeros with their element indices
            delta = {name: update.state[name] - start[name] for name in start}
            update.message = Message(delta, {name: t != 0 for name, t in delta.items()})
            update.extras[DELTA] = True

    @override
    def vectorized_fit(self) -> Any:
        """The gated step for a stacked group of fits (:class:`~pl_fedsparse.callbacks.pfedgate_stacked.StackedPFedGate`;
        a one-line :class:`~pl_fedsparse.errors.ConfigError` for the settings it does not stack)."""
        from pl_fedsparse.callbacks.pfedgate_stacked import StackedPFedGate

        return StackedPFedGate(self)

    # ---- evaluation of the personal model ---------------------------------------------------------------------
    @override
    def evaluation_start_is_shared(self, loop: FederationView, kind: str) -> bool:
        return kind != "personal"  # the client's gate is installed on its personal model

    @override
    def evaluation_batch_matters(self, loop: FederationView) -> bool:
        return True  # one mask per test batch: the personal model's predictions depend on the batch

    @override
    def on_client_evaluate_start(self, loop: FederationView, module: pl.LightningModule, client_idx: int,
                                 kind: str) -> None:
        if kind != "personal":
            return
        assert self.gate is not None
        self._load_gate(loop, client_idx, optimizer=False)
        self.gate.to(loop.device).eval()
        self._step_gate = True  # (no gradient under the evaluator's inference mode anyway)
        self._stats = {}
        self._install(module)

    @override
    def on_client_evaluate_end(self, loop: FederationView, module: pl.LightningModule, client_idx: int, kind: str,
                               metrics: dict[str, float]) -> None:
        if kind != "personal":
            return
        self._uninstall()
        assert self.gate is not None
        self.gate.train()
        stats, self._stats = self._stats, {}
        tally: _KeptBlocks | None = stats.get("batches")
        n = int(stats.get("n", 0)) + (tally.n if tally is not None else 0)
        if not n:
            return
        density = float(stats["density"]) if "density" in stats else 0.0
        if tally is not None and tally.n:  # (one read of the batches' kept elements: one wait, as a float's)
            density += fold_density(tally.numels().tolist(), tally.counts, tally.table.numel)
        self._eval_density[client_idx] = density / n

    @override
    def on_evaluation_end(self, loop: FederationView, metrics: dict[str, Any]) -> None:
        values, self._eval_density = list(self._eval_density.values()), {}
        metrics["gate_density"] = sum(values) / len(values) if values else None

    # ---- round metrics ----------------------------------------------------------------------------------------
    @override
    def on_before_aggregate(self, loop: FederationView, updates: Sequence[ClientUpdate]) -> None:
        self._round_train = [(u.metrics["gate_density"], u.metrics["gate_upload_ratio"]) for u in updates
                             if u.kind == "train" and "gate_density" in u.metrics]

    @override
    def on_round_end(self, loop: FederationView, round_idx: int, metrics: dict[str, Any]) -> None:
        stats, self._round_train = self._round_train, []
        metrics["gate_density_train"] = sum(s for s, _ in stats) / len(stats) if stats else None
        metrics["gate_upload_ratio"] = sum(q for _, q in stats) / len(stats) if stats else None

    @override
    def report_rows(self, loop: FederationView) -> list[tuple[str, str]]:
        return [("gate density s'", "gate_density"), ("upload ratio q", "gate_upload_ratio")]



class _KeptBlocks:
    """A fit's (or a personal evaluation's) kept blocks ``I*`` batch by batch (Alg. 1 line 3), reduced once at its
    end: a training step adds no operator for them (each batch's mask is kept as it is, or one copy of it where CUDA
    graphs overwrite a step's outputs: :func:`~pl_fedsparse.executors.compiling.graph_outputs_reused`), so a
    launch-bound step on a GPU launches nothing for the statistics. The same numbers as a running sum: integer
    counts, and the achieved density's float64 terms ``|I*_b · W| · n_b / d`` added in batch order, on the host
    (:func:`fold_density`). Every :attr:`CHUNK` batches the masks kept so far are folded into the counts (a long fit
    keeps at most that many)."""

    #: batches whose masks are kept before they are folded into the counts
    CHUNK = 256

    def __init__(self, table: BlockTable, *, fit: bool, copy: bool) -> None:
        self.table, self.fit, self.copy = table, fit, copy
        self.n = self.gate_n = 0
        self.counts: list[int] = []  # every batch's samples, in order
        self._masks: list[Tensor] = []  # the batches not folded yet
        self._numels: list[Tensor] = []  # per folded chunk: its batches' kept elements |I*_b · W| [b] (int64)
        self._weighted: Tensor | None = None  # Σ_b n_b · I*_b per block [L] (int64; a fit's only)
        self._union: Tensor | None = None  # ∪_b I*_b [L] (a fit's only)

    def add(self, keep: Tensor, n: int, gate_trained: bool) -> None:
        """One batch of ``n`` samples whose kept blocks are ``keep`` (``[L]`` bool)."""
        self._masks.append(keep.clone() if self.copy else keep)
        self.counts.append(n)
        self.n += n
        self.gate_n += n if gate_trained else 0
        if len(self._masks) >= self.CHUNK:
            self._fold()

    def _fold(self) -> None:
        masks, self._masks = self._masks, []
        if not masks:
            return
        counts = self.counts[len(self.counts) - len(masks):]
        stacked = torch.stack(masks)  # [b, L]
        _, sizes = block_span_tensors(self.table, stacked.device)
        self._numels.append((stacked * sizes).sum(1))
        if not self.fit:
            return
        # the batches' sample counts where the masks are, with no copy: a fill for each run of equal counts (the
        # batches of an epoch but its last, shorter one: a few runs a fit)
        n = torch.empty(len(counts), dtype=torch.int64, device=stacked.device)
        start = 0
        for end in range(1, len(counts) + 1):
            if end == len(counts) or counts[end] != counts[start]:
                n[start:end].fill_(counts[start])
                start = end
        weighted = (stacked * n.unsqueeze(1)).sum(0)
        union = stacked.any(0)
        self._weighted = weighted if self._weighted is None else self._weighted + weighted
        self._union = union if self._union is None else self._union | union

    def numels(self) -> Tensor:
        """Every batch's kept elements ``|I*_b · W|`` in order (``[batches]`` int64, where the masks are)."""
        self._fold()
        return self._numels[0] if len(self._numels) == 1 else torch.cat(self._numels)

    def totals(self) -> tuple[Tensor, Tensor]:
        """A fit's ``(kept, union)``: per tensor of the table ``Σ_b n_b · (kept elements of I*_b in it)`` (int64
        ``[tensors]``) and the union of its batches' kept blocks (bool ``[L]``)."""
        self._fold()
        assert self._weighted is not None and self._union is not None, "a fit's statistics, after a batch"
        owner, sizes = block_span_tensors(self.table, self._weighted.device)
        kept = torch.zeros(len(self.table.spans), dtype=torch.int64, device=owner.device)
        return kept.index_add_(0, owner, sizes * self._weighted), self._union


def _pending_density(update: ClientUpdate, tally: _KeptBlocks, running: Tensor | None, n: int) -> None:
    """``update.metrics["gate_density"]`` (``Σ_b s'_b n_b / n``), read when the update crosses to the host
    (:meth:`~pl_fedsparse.client.ClientUpdate.on_host`), with the batches' kept elements: a
    :class:`~pl_fedsparse.metrics.PendingMetric` until then. ``running``: the float64 sum of batches whose steps
    were traced by a compiler (none unless dynamo ran some of a fit's steps eagerly), added first."""
    update.metrics["gate_density"] = PendingMetric("gate_density")  # type: ignore[assignment]
    counts, numel = list(tally.counts), tally.table.numel
    tensors = [tally.numels()] + ([] if running is None else [running])

    def fill(host: list[Tensor]) -> None:
        total = fold_density(host[0].tolist(), counts, numel)
        update.metrics["gate_density"] = ((float(host[1]) + total) if running is not None else total) / n

    update.on_host(tensors, fill)


def fold_density(numels: Sequence[int], counts: Sequence[int], numel: int) -> float:
    """``Σ_b |I*_b · W| · n_b / d`` over the batches in order, each term a float64 division (the paper's achieved
    density ``s'`` of each batch, weighted by its samples), as the running sum of float64 tensors made it.

    Example:
        >>> fold_density([3, 4], [2, 1], 10)
        1.0
    """
    total: float | None = None
    for k, n in zip(numels, counts, strict=True):
        term = float(k * n) / numel
        total = term if total is None else total + term
    return 0.0 if total is None else total


def _gate_flops(gate: GatingLayer, x: Tensor) -> tuple[float, float]:
    """Forward and forward + backward FLOPs per sample of a (throw-away) gate on the example batch ``x``."""
    batch = int(x.shape[0])
    with FlopCounterMode(display=False) as counter:
        gate(x)
    forward = counter.get_total_flops() / batch
    with FlopCounterMode(display=False) as counter:
        g, m = gate(x)
        (g.sum() + m.sum()).backward()
    return float(forward), float(counter.get_total_flops() / batch)

