"""pFedGate's in-fit work over a stacked group of fits, for :class:`~pl_fedsparse.executors.VectorizedExecutor`:
what :class:`~pl_fedsparse.callbacks.PFedGate` does inside one client's fit (``on_train_start``, the gated forward,
``on_before_optimizer_step``, ``on_train_end``), done for a round's clients at once.

Every batch step (Alg. 1 lines 3-7), for the ``K`` clients of the step together: their gates' ``G, M``
(:func:`~pl_fedsparse.functional.gate_stacked.stacked_gate_forward`), every client's knapsack as rows of one, the
straight-through ``M'``, ``θ' = θ ⊙ expand(M')`` and the model's forward on ``θ'`` (``vmap`` over the clients), one
backward for ``θ`` and the gates; each gate's gradient clipped at ``gate_clip`` and stepped by its SGD (momentum kept
per client across rounds, as in process); the model's gradients go back to the executor, which clips and steps θ
as for any module (the learning rates scaled by the milestones' factor, as ``on_train_start`` scales them). A batch
of one sample runs the gate in eval mode and steps neither (the code skips such batches); its loss still counts.
Clients whose batches differ in size (a client's last, shorter batch) share one step too: their batches padded to the
longest, every batch statistic (the gates' norms, the sigmoid's batch mean, the loss's mean) taken over each client's
own samples — a written-out BatchNorm, the same as ``F.batch_norm`` to rounding.

The same statistics as in process (kept blocks, the union, the achieved density, the gate's trained samples) are
summed per client where the fits run and handed to each client's ``on_client_fit_end`` — so the update, its bytes,
its FLOPs and the metrics are computed by the callback's own code. The results are the in-process run's to
rounding (the gate's sigmoid rounds differently in a stacked layout on the CPU: a block whose ``round(10·G)`` sits on
a rounding boundary may be chosen differently; tested on whole runs).

Stacked: both schedules — ``joint`` (Alg. 1) and ``bilevel`` (the code's alternating epochs: each client's gate
in its even epochs, its model in its odd ones, chosen per client by the epoch of its own batch; the rows of the
part that does not train take no step, their gradients dropped as in process) — with either knapsack (``greedy``:
every client's as rows of one on the device; ``exact``, Eq. 6: a search on the host, each client's as in process,
the step's importances read in one copy for all of them — a wait per step, not per client and step), ``group`` or
``global`` budget, both straight-through variants, one or two gate paths, any aggregation; ``compute: sliced``
computes the masked ``θ'`` (the same logits to float tolerance; slicing is a one-client speed-up). Gate-only
fine-tuning fits (novel clients) run in process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pl_fedsparse.context import FitContext
from pl_fedsparse.executors.stacked import ElementwiseOptim, clip_per_client, sgd_step
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.gate import Budget, _device_groups, block_span_tensors, select_blocks
from pl_fedsparse.functional.gate_stacked import (
    stacked_capacities,
    stacked_gate_forward,
    stacked_personalized_params,
    stacked_select_blocks,
    stacked_straight_through,
)
from pl_fedsparse.protocol import training_loss

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from pl_fedsparse.callbacks.pfedgate import PFedGate

__all__ = ["StackedPFedGate"]


class StackedPFedGate:
    """:class:`~pl_fedsparse.callbacks.PFedGate`'s vectorised form (see the module docstring)."""

    def __init__(self, gate: PFedGate) -> None:
        self.cb = gate
        self.items: dict[int, dict[str, Any] | None] = {}
        self.active = False
        self.state: dict[str, Tensor] = {}  # the gates' state_dict entries, stacked [K, ...]
        self.params: list[str] = []  # the gates' parameters, in their optimizer's order
        self.opt_state: dict[str, dict[str, Tensor]] = {}
        self.gate_optim: ElementwiseOptim | None = None
        self.stats: dict[str, Any] = {}
        self.moved: set[int] = set()  # rows whose gate made an optimizer step
        self.module: pl.LightningModule | None = None
        self.rates: list[float] = []  # each client's gate learning rate
        self.densities: list[float] = []  # each client's budget s_i
        self.budget: Budget = "group"
        self.floors = self.dense = self.capacity = self.owner = self.sizes = torch.zeros(0)

    # ---- the group -----------------------------------------------------------------------------------------------
    def supports(self, context: FitContext) -> bool:
        return context.kind != "finetune"  # gate-only adaptation (novel clients): in process

    def capture(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        cb = self.cb
        self.module = module
        if cb._ctx is None or cb.gate is None:
            self.items[index] = None  # not a fit the gate takes part in (the plain model trains)
            return
        # the client's gate as on_client_fit_start brought it to the device (never loaded into the working gate: the
        # store's copies, read only — start() stacks them); the next client's replaces it
        assert cb._pending_gate is not None
        state, cb._pending_gate = dict(cb._pending_gate), None
        self.items[index] = {"state": state, "opt": dict(cb._pending_opt), "density": cb._client_density,
                             "floor": cb._clip_floor}

    def start(self, fit: Any) -> None:
        cb = self.cb
        K = len(fit.contexts)
        found = [self.items.get(i) for i in range(K)]
        self.active = all(it is not None for it in found) and fit.contexts[0].kind == "train"
        self.moved = set()
        if not self.active:
            return
        items = [it for it in found if it is not None]
        assert cb.gate is not None and cb.table is not None
        dev = fit.device
        self.params = [n for n, _ in cb.gate.named_parameters()]
        firsts = transfer.to_device({f"{i}/{n}": t for i, it in enumerate(items) for n, t in it["state"].items()}, dev)
        self.state = {n: torch.stack([firsts[f"{i}/{n}"] for i in range(K)]) for n in items[0]["state"]}
        # the gate's SGD: each client's learning rate by its round, its momentum kept across rounds (fresh rows take
        # the gradient at their first step, as torch.optim.SGD does)
        rates = [cb.gate_lr * cb.lr_factor(c.lr_round) for c in fit.contexts]
        hyper = (cb.gate_momentum, 0.0, False, cb.gate_weight_decay)
        self.gate_optim = ElementwiseOptim("sgd", {n: rates[0] for n in self.params},
                                           {n: hyper for n in self.params})
        self.rates = rates
        self.opt_state = {n: {} for n in self.params}
        if cb.gate_momentum != 0:
            kept = transfer.to_device({f"{i}/{k}": t for i, it in enumerate(items) for k, t in it["opt"].items()}, dev)
            for j, n in enumerate(self.params):
                have = [kept.get(f"{i}/{j}.momentum_buffer") for i in range(K)]
                p = self.state[n]
                self.opt_state[n]["momentum_buffer"] = torch.stack(
                    [p.new_zeros(p.shape[1:]) if t is None else t.to(p.dtype) for t in have])
                self.opt_state[n]["fresh"] = transfer.host_tensor([t is None for t in have], dev)
        table = cb.table
        self.densities = [it["density"] for it in items]
        self.floors = transfer.host_tensor([it["floor"] for it in items], dev, torch.float32)
        self.dense = transfer.host_tensor([d >= 1.0 for d in self.densities], dev)
        self.owner, self.sizes = block_span_tensors(table, dev)
        self.budget = cb.budget or ("group" if cb.solver == "greedy" else "global")  # (select_blocks' default)
        self.capacity = stacked_capacities(table, self.densities, self.budget, device=dev)
        # (constants made once per table on the fits' device: "there" in a device run simulated on the CPU too)
        transfer.mark_placed([self.owner, self.sizes, self.capacity, *_device_groups(table, self.budget, dev)[:3]],
                             dev)
        self.stats = {"n": [0] * K, "gate_n": [0] * K,
                      "density": torch.zeros(K, dtype=torch.float64, device=dev),
                      "kept": torch.zeros(K, len(table.spans), dtype=torch.int64, device=dev),
                      "union": torch.zeros(K, table.num_blocks, dtype=torch.bool, device=dev)}

    def learning_rates(self, fit: Any, lrs: dict[str, list[float]]) -> None:
        if not self.active:
            return
        for i, c in enumerate(fit.contexts):  # the code's multi_step also decays the model's rate (on_train_start)
            factor = self.cb.lr_factor(c.lr_round)
            if factor != 1.0:
                for rates in lrs.values():
                    rates[i] = rates[i] * factor

    # ---- a step ----------------------------------------------------------------------------------------------------
    @property
    def ragged(self) -> bool:
        """Whether the executor may stack batches of different sizes in one step (padded, each client's size given):
        while this group's fits are gated ones (read after :meth:`start`)."""
        return self.active

    def gradients(self, fit: Any, params: dict[str, Tensor], fixed: dict[str, Tensor], xs: Tensor, ys: Tensor,
                  rows: Sequence[int], sizes: Sequence[int] | None = None
                  ) -> tuple[dict[str, Tensor], Tensor, list[bool]] | None:
        """The gated step of clients ``rows`` (their batches ``xs``, ``ys``, padded to the longest when ``sizes``
        gives their own sizes; their stacked ``θ`` in ``params``): the model's gradients, the losses ``[k]`` and
        which rows make no optimizer step (batches of one)."""
        if not self.active:
            return None  # the group's plain fits: the executor's own step
        cb = self.cb
        table = cb.table
        assert table is not None and self.gate_optim is not None
        k, batch = len(rows), int(xs.shape[1])
        ragged = sizes is not None and len(set(sizes)) > 1
        counts = list(sizes) if sizes is not None else [batch] * k
        everyone = k == len(fit.contexts) and list(rows) == list(range(k))
        idx = None if everyone else transfer.host_tensor(list(rows), xs.device)
        lone = [c < 2 for c in counts]  # BatchNorm1d needs 2 samples: the gate runs in eval mode and nothing steps
        single = all(lone)
        gate_on, model_on = self._phases(fit, rows)
        steps_gate = [on and not one for on, one in zip(gate_on, lone, strict=True)]
        state = self.state if idx is None else {n: t.index_select(0, idx) for n, t in self.state.items()}
        leaves = {n: state[n].detach().requires_grad_(any(steps_gate)) for n in self.params}
        gate_state = {**state, **leaves}
        theta = {n: t.detach().requires_grad_() for n, t in params.items()}
        floors = self.floors if idx is None else self.floors.index_select(0, idx)
        densities = [self.densities[i] for i in rows]
        autocast = fit.precision == "bf16-mixed"
        with torch.enable_grad():
            importance, weights = stacked_gate_forward(gate_state, xs, floors, training=not single,
                                                       separate_paths=cb.separate_paths,
                                                       sizes=counts if ragged else None)
            if cb.solver == "exact":
                keep = self._exact_keep(importance, densities)
            else:
                capacity = self.capacity if idx is None else self.capacity.index_select(0, idx)
                keep = stacked_select_blocks(importance, table, densities, self.budget, capacity=capacity)
            dense = self.dense if idx is None else self.dense.index_select(0, idx)
            m_sparse = stacked_straight_through(keep, importance, weights, cb.straight_through, dense)
            theta_p = stacked_personalized_params(theta, m_sparse, table)
            module = self.module
            assert module is not None
            relu = cb.relu_logits

            def logits_of(p: dict[str, Tensor], f: dict[str, Tensor], x: Tensor) -> Tensor:
                out = torch.func.functional_call(module, {**p, **f}, (x,))
                return torch.nn.functional.relu(out) if relu else out

            def loss(p: dict[str, Tensor], f: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
                with torch.autocast(xs.device.type, dtype=torch.bfloat16, enabled=autocast):
                    return training_loss(module, logits_of(p, f, x), y)

            def padded_loss(p: dict[str, Tensor], f: dict[str, Tensor], x: Tensor, y: Tensor, m: Tensor,
                            n: Tensor) -> Tensor:
                # the loss of each sample (the module's loss of a batch of one: a batch mean's term), averaged over
                # the client's own samples
                with torch.autocast(xs.device.type, dtype=torch.bfloat16, enabled=autocast):
                    logits = logits_of(p, f, x)
                    each = torch.func.vmap(lambda o, t: training_loss(module, o.unsqueeze(0), t.unsqueeze(0)))(
                        logits, y)
                return (each.float() * m).sum() / n

            if ragged:
                own = transfer.host_tensor(counts, xs.device)
                mask = (torch.arange(batch, device=xs.device).view(1, -1) < own.view(-1, 1)).float()
                losses = torch.func.vmap(padded_loss)(theta_p, fixed, xs, ys, mask, own.float())
            else:
                losses = torch.func.vmap(loss)(theta_p, fixed, xs, ys)
            wrt = [*theta.values(), *(leaves.values() if any(steps_gate) else ())]
            grads = torch.autograd.grad(losses.sum(), wrt)
        model_grads = dict(zip(theta, grads[:len(theta)], strict=True))
        if idx is not None:  # the running statistics these rows' forward moved, back into the group's rows
            with torch.no_grad():
                for n, t in state.items():
                    if n not in leaves:
                        self.state[n].index_copy_(0, idx, t)
        self._record(keep, counts, rows, idx, gate_on)
        if any(steps_gate):
            gate_grads = dict(zip(self.params, grads[len(theta):], strict=True))
            if not all(steps_gate):  # the rows of one sample (and, bilevel, in a model epoch) step no gate
                steps = [q for q, on in enumerate(steps_gate) if on]
                at = transfer.host_tensor(steps, xs.device)
                gate_grads = {n: g.index_select(0, at) for n, g in gate_grads.items()}
                stepping = [rows[q] for q in steps]
                self._step_gates(gate_grads, stepping, transfer.host_tensor(stepping, xs.device))
            else:
                self._step_gates(gate_grads, rows, idx)
        return model_grads, losses.detach(), [one or not on for one, on in zip(lone, model_on, strict=True)]

    def _exact_keep(self, importance: Tensor, densities: Sequence[float]) -> Tensor:
        """Every row's ``I*`` by the exact knapsack (Eq. 6): :func:`~pl_fedsparse.functional.gate.select_blocks`
        per client on the host, as in process — the step's importances read in one copy for every client (one wait
        a step, where the fits one by one wait once a client and step), the indices sent back in one."""
        table = self.cb.table
        assert table is not None
        host = importance.detach().double().cpu()
        keep = torch.stack([select_blocks(host[i], table, d, solver="exact", budget=self.budget)
                            for i, d in enumerate(densities)])
        return transfer.send(keep, importance.device)

    def _phases(self, fit: Any, rows: Sequence[int]) -> tuple[list[bool], list[bool]]:
        """Per row, whether its gate and whether its model train at this step (``on_train_epoch_start``): both, in
        the ``joint`` schedule (Alg. 1); ``bilevel`` (the code's ``--bi_level_opt 1``): the gate in each client's
        even epochs, the model in its odd ones — by the epoch of its own batch (clients of different sizes are in
        different epochs at one step)."""
        if self.cb.schedule == "joint":
            return [True] * len(rows), [True] * len(rows)
        epoch = dict(zip(fit.clients, fit.epochs, strict=True))
        gate = [epoch[i] % 2 == 0 for i in rows]
        return gate, [not g for g in gate]

    def _record(self, keep: Tensor, counts: Sequence[int], rows: Sequence[int], idx: Tensor | None,
                gate_on: Sequence[bool]) -> None:
        """:meth:`PFedGate._record` for every row (the same integer sums and float64 terms, in batch order; the
        samples of the rows whose gate trains at this step counted as the gate's trained samples, as in process — a
        batch of one sample too)."""
        s = self.stats
        k = keep.shape[0]
        kept = torch.zeros(k, len(self.cb.table.spans), dtype=torch.int64,  # type: ignore[union-attr]
                           device=keep.device).index_add_(1, self.owner, self.sizes * keep)
        n: int | Tensor = counts[0]
        if any(c != counts[0] for c in counts):
            n = transfer.host_tensor(list(counts), keep.device, torch.int64).view(-1, 1)
        density = (kept.sum(1, keepdim=True) * n).double().view(-1) / self.cb.table.numel  # type: ignore[union-attr]
        for i, c, on in zip(rows, counts, gate_on, strict=True):
            s["n"][i] += c
            if on:
                s["gate_n"][i] += c
        if idx is None:
            s["density"] += density
            s["kept"] += kept * n
            s["union"] |= keep
        else:
            s["density"].index_add_(0, idx, density)
            s["kept"].index_add_(0, idx, kept * n)
            s["union"].index_copy_(0, idx, s["union"].index_select(0, idx) | keep)

    def _step_gates(self, grads: dict[str, Tensor], rows: Sequence[int], idx: Tensor | None) -> None:
        """Each gate's clip (``gate_clip``, over its own gradients) and SGD step, on rows ``rows``."""
        cb = self.cb
        assert self.gate_optim is not None
        if cb.gate_clip is not None:
            clip_per_client(grads, cb.gate_clip)
        P = {n: self.state[n] if idx is None else self.state[n].index_select(0, idx) for n in self.params}
        S = self.opt_state if idx is None else {n: {k: v.index_select(0, idx) for k, v in st.items()}
                                                for n, st in self.opt_state.items()}
        rates = [self.rates[i] for i in rows]
        sgd_step(P, grads, S, self.gate_optim, {n: rates for n in self.params}, torch.zeros(len(rows)))
        if idx is not None:  # (the momentum buffers exist from the start: a subset's step only writes rows back)
            with torch.no_grad():
                for n in self.params:
                    self.state[n].index_copy_(0, idx, P[n])
                    for key, v in S[n].items():
                        self.opt_state[n][key].index_copy_(0, idx, v)
        self.moved.update(rows)

    # ---- the end ---------------------------------------------------------------------------------------------------
    def finish(self, index: int, module: pl.LightningModule, context: FitContext) -> None:
        """Client ``index``'s trained gate, its gate momentum and its fit's statistics onto the callback, as its
        ``on_train_end`` and gated forwards would have left them for ``on_client_fit_end``."""
        item = self.items.pop(index, None)
        if not self.active or item is None:
            return
        cb = self.cb
        names = list(self.state)
        gate_state = dict(zip(names, transfer.clone_tensors([self.state[n][index] for n in names]), strict=True))
        if index in self.moved and self.opt_state and any(self.opt_state.values()):
            keys = [f"{j}.momentum_buffer" for j, n in enumerate(self.params)
                    if "momentum_buffer" in self.opt_state[n]]
            bufs = [self.opt_state[n]["momentum_buffer"][index] for n in self.params
                    if "momentum_buffer" in self.opt_state[n]]
            opt_state = dict(zip(keys, transfer.clone_tensors(bufs), strict=True))
        else:
            opt_state = item["opt"]  # no step: the loaded momentum, unchanged (as in process)
        cb._captured = (gate_state, opt_state)
        s = self.stats
        n = s["n"][index]
        if n:
            cb._stats = {"fit": True, "n": n, "density": s["density"][index], "gate_trained": s["gate_n"][index],
                         "kept": s["kept"][index], "union": s["union"][index]}
        else:
            cb._stats = {"fit": True}
        if not self.items:  # the group's last fit: its stacked gates and statistics are not kept past it
            self.state, self.opt_state, self.stats = {}, {}, {}

    def before_optimizer_step(self, fit: Any) -> None:
        pass

    def after_optimizer_step(self, fit: Any) -> None:
        pass
