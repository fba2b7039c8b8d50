"""Many clients per step: :class:`VectorizedExecutor` trains a round's clients together, one stacked step at a time.

Clients in federated simulation hold a few hundred samples, so one client's step is a handful of tiny kernels and
framework calls; run one client after the other and the per-fit and per-step costs dominate (an idle accelerator, a
CPU busy with bookkeeping). ``torch.func`` removes them: the fits of a stage that share a module and an optimizer
are stacked along a leading client dimension and trained as one — the module's own ``forward`` under
:func:`torch.func.functional_call` and :func:`torch.func.vmap`, gradients from :func:`torch.func.grad_and_value`, and
the optimizer's update (SGD with momentum, dampening, Nesterov and weight decay; Adam) applied element-wise to the
stacked tensors. Everything a fit is made of stays per client:

* **data**: each client iterates its own loader (``datamodule.train_loader(client, seed)``: its own batches,
  shuffling and augmentation). The torch RNG each client's data draws from is its own, seeded as
  :class:`~pl_fedsparse.executors.InProcessExecutor` seeds it and swapped in around every batch it takes. Clients
  whose batches differ in shape at a step (the last, smaller batch) are stepped in sub-groups; a client with fewer
  steps stops, and its weights and optimizer state are untouched from then on;
* **optimizer**: the one the module's ``configure_optimizers`` returns for that client (per-client learning rate by
  round: :func:`~pl_fedsparse.context.current_fit` is that client's context while it is called);
* **gradient clipping** (``trainer.gradient_clip_val``): each client's total gradient norm, as Lightning clips it;
* **mixed precision**: ``bf16-mixed`` autocasts the forward and the loss as Lightning's precision plugin does, and
  the stacked linear, convolution and GroupNorm layers cast their arguments as autocast casts one client's (see
  **gradients**); ``16-mixed`` (a loss scale per client) is refused;
* **callbacks**: every federation hook runs per client, in order, as in process (``on_client_fit_start`` of each
  client with its start weights loaded, ``on_client_fit_end`` with its trained weights loaded); what a callback does
  *inside* a fit (Lightning's ``on_before_optimizer_step``, ``on_train_batch_end``, …) it declares in a vectorised
  form, :meth:`VectorizedFitHooks` returned by ``vectorized_fit()`` — the library's masks
  (:class:`~pl_fedsparse.callbacks.masking.UsesMaskedTraining`), Ditto's proximal term, the FedProx example,
  :class:`~pl_fedsparse.callbacks.KeepOptimizerState` (each client's kept optimizer state continued in its rows),
  pFedGate, FedEM and FedRep's alternating epochs (each client's frozen part by the epoch of its batch) do.
  A callback with in-fit hooks and no vectorised form is refused when the federation starts, in one line naming it
  (or its clients are run in process, ``unsupported: sequential``);
* **gradients**: at its first stacked step the executor also computes each of (up to) four clients' gradients
  alone and refuses the model in one line when they differ from the stacked ones by more than rounding
  (:data:`~pl_fedsparse.executors.stacked.STACKED_GRADIENT_TOLERANCE`, both sides in IEEE float32, TF32 off:
  :func:`~pl_fedsparse.executors.stacked.full_fp32`): a ``torch.func``
  batching rule that disagrees with its layer would otherwise pass a fast wrong answer off as the in-process run.
  ``vmap``'s own GroupNorm backward rule does (torch 2.14.1: ResNet18-GN's gradients up to 3e-3 off), so linear,
  2-D convolution and GroupNorm layers give each client the bits of its own kernel
  (:func:`~pl_fedsparse.executors.stacked.exact_linear`: linear layers as one batched product, GroupNorm as one
  kernel with the clients folded into the channels, convolutions one client at a time — or, with
  ``convolutions="grouped"``, one grouped convolution, to rounding); under ``bf16-mixed`` with the arguments cast
  as autocast casts a client's own call (bfloat16 for linear layers and convolutions; GroupNorm as the device runs
  it: in float32 on CUDA, in its input's dtype on the CPU), where ``vmap``'s own rules compute in another precision.
  The papers' VGG11-GN, ResNet18-GN, LeNet-CIFAR, McMahan CNN and FEMNIST CNN then train stacked to rounding, at
  ``32-true`` and ``bf16-mixed`` (on the CPU at one thread, per-client convolutions, the in-process run's weights
  bit for bit: ``tests/test_vectorized.py``). The check itself runs in float32 whatever the precision (a batching
  rule is the same for every dtype, and bfloat16's rounding would hide a wrong one);
* **faults**: a client whose loss or weights become non-finite is rolled back and left out, the others of its group
  are unaffected (the maths of one client never reads another's); an exception inside a stacked step re-runs that
  group's clients one by one in process, so a failing client is contained as before.

What can be vectorised (checked when the federation starts, one-line :class:`~pl_fedsparse.errors.ConfigError`
otherwise): a module whose ``training_step`` is ``loss(forward(x), y)`` on ``(x, y)`` batches — the shipped
:class:`~pl_fedsparse.module.FederatedModule` (not overriding it), or any module that says so with the class
attribute ``vectorizable = True`` — with no batch-statistics buffers (BatchNorm; GroupNorm is fine: all the library's
backbones) and no dropout (its random mask could not follow each client's stream); an optimizer that is element-wise
(``torch.optim.SGD``, ``torch.optim.Adam`` without AMSGrad) and no learning-rate scheduler. The per-step training
loss (``train_loss``, ``samples_seen``) is measured by the executor as
:class:`~pl_fedsparse.executors.FitMeter` does. Results equal the in-process executor's up to float rounding
(batched matrix products round differently in the last bits); bytes and FLOPs are identical (tested for every
supported method's synthetic config).

Example::

    pl-fed fit --config configs/quickstart.yaml --trainer.executor pl_fedsparse.executors.VectorizedExecutor
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor

from pl_fedsparse.allocator import heap_only, tune_malloc
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.context import FitContext, fit_scope
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.executors.base import (
    ClientExecutor,
    FitRequest,
    begin_fit,
    end_fit,
    fault_to_raise,
    fit_update,
    load_state,
)
from pl_fedsparse.executors.compiling import running_uncompiled
from pl_fedsparse.executors.eligibility import check_module, elementwise_optimizer
from pl_fedsparse.executors.hooks import IN_FIT_HOOKS, StackedFit, VectorizedFitHooks, in_fit_hooks
from pl_fedsparse.executors.in_process import InProcessExecutor
from pl_fedsparse.executors.per_client import CallbackSnapshot, ClientStream
from pl_fedsparse.executors.stacked import (
    STACKED_GRADIENT_TOLERANCE,
    ElementwiseOptim,
    adam_step,
    clip_per_client,
    exact_linear,
    full_fp32,
    sgd_step,
    stacked_gradient_error,
)
from pl_fedsparse.functional import transfer
from pl_fedsparse.metrics import mean_loss
from pl_fedsparse.protocol import training_loss

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["IN_FIT_HOOKS", "StackedFit", "VectorizedExecutor", "VectorizedFitHooks", "in_fit_hooks"]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------ the executor
#: on the CPU, the default group holds at most this many bytes of stacked weights (its gradients, optimizer state and
#: step temporaries come on top: about 4x in all with momentum)
_CPU_GROUP_BYTES = 256 << 20


class VectorizedExecutor(ClientExecutor):
    """Train a stage's fits together, stacked along a client dimension (module docstring).

    Args:
        max_group_size: most clients stacked in one group (memory: each client adds its weights, gradients,
            optimizer state and one batch of activations); a larger stage runs as several groups of equal size.
            ``None``: on the CPU, as many as keep the group's stacked weights within 256 MiB (1 GiB or so with
            gradients, optimizer state and step temporaries; the stacked tensors are kept in the heap,
            :func:`~pl_fedsparse.allocator.heap_only`, instead of being mapped afresh at every step — measured, a
            quarter of a 100-client MLP round went to page faults); on a GPU, all of the stage's fits.
        unsupported: what to do with fits a callback cannot vectorise (it has in-fit hooks and no
            ``vectorized_fit``): ``"error"`` refuses the run when the federation starts, naming the callback;
            ``"sequential"`` runs those fits one by one in process (every fit, when such a callback is configured).
        convolutions: how a 2-D convolution runs over the stacked clients. ``"per_client"`` (default): each
            client's own convolution, forward and backward — every weight the bits of the in-process fit, at one
            kernel per client and layer. ``"grouped"``: one grouped convolution for all the clients (``vmap``'s own
            rule), one kernel per layer whatever the number of clients — for a GPU, where a round's launches are
            what it waits for; it rounds differently from a client's own convolution, so a run equals the
            in-process run to float tolerance only (and, where a top-k selection turns a last-bit difference into
            another mask, not even that); not measured on a GPU yet.

    Example (YAML)::

        trainer:
          executor: {class_path: pl_fedsparse.executors.VectorizedExecutor, init_args: {max_group_size: 100}}
    """

    def __init__(self, *, max_group_size: int | None = None,
                 unsupported: Literal["error", "sequential"] = "error",
                 convolutions: Literal["per_client", "grouped"] = "per_client") -> None:
        check(max_group_size is None or (isinstance(max_group_size, int) and not isinstance(max_group_size, bool)
                                         and max_group_size >= 1),
              "VectorizedExecutor.max_group_size", max_group_size, "an int >= 1 or null")
        check(unsupported in ("error", "sequential"), "VectorizedExecutor.unsupported", unsupported,
              "one of error, sequential")
        check(convolutions in ("per_client", "grouped"), "VectorizedExecutor.convolutions", convolutions,
              "one of per_client, grouped")
        self.max_group_size, self.unsupported, self.convolutions = max_group_size, unsupported, convolutions
        self.loop: FederationView | None = None
        self.sequential = InProcessExecutor()
        self.hooks: list[tuple[Any, VectorizedFitHooks]] = []
        self._all_sequential = False
        self._stats = {"vectorized_fits": 0, "sequential_fits": 0}
        self._optimizers: dict[tuple[Any, ...], ElementwiseOptim] = {}
        self._params: list[Tensor] = []  # the working module's parameters (the optimizer cache's key reads them)
        self._gradients_checked = False  # the first stacked step's gradients against each client's own

    def setup(self, loop: FederationView) -> None:
        self.loop = loop
        self.sequential.setup(loop)
        assert loop.model is not None
        tune_malloc()  # (as pl-fed does): freed step buffers stay in the heap instead of going back to the kernel
        if loop.precision == "16-mixed":
            raise ConfigError("trainer.precision='16-mixed' is invalid with trainer.executor=VectorizedExecutor: "
                              "expected 32-true or bf16-mixed (a loss scale per client is not implemented)")
        check_module(loop.model)
        # the optimizer a fit would get, checked now, before the run directory or a checkpoint is written (the
        # round-0 context; configure_optimizers is the user's code and runs again in every fit)
        names = {id(p): n for n, p in loop.model.named_parameters()}
        with fit_scope(FitContext(client_idx=0, round_idx=0, kind="train", stream="train", seed=0, lr_round=0)):
            kind = elementwise_optimizer(loop.model, names).kind
        # (the callback, what it lacks: in the error, in the warning; what the user can do)
        refused = [(cb, f"has in-fit hooks ({', '.join(hooks)}) and no vectorized_fit",
                    "has in-fit hooks and no vectorized_fit", "give it one, docs/extending.md")
                   for cb, hooks in self._collect_hooks()]
        for cb, form in self.hooks:
            takes = getattr(form, "optimizers", None)
            if takes is not None and kind not in takes:
                why = f"has a vectorised form for {' or '.join(takes)} only, the module's optimizer is {kind}"
                refused.append((cb, why, why, "run it in process: drop trainer.executor"))
        if refused:
            cb, why, short, hint = refused[0]
            if self.unsupported == "error":
                raise ConfigError(f"trainer.callbacks is invalid with trainer.executor=VectorizedExecutor: "
                                  f"{type(cb).__name__} {why} ({hint}, or set VectorizedExecutor.unsupported: "
                                  "sequential)")
            log.warning("VectorizedExecutor: %s %s; every fit runs in process", type(cb).__name__, short)
            self._all_sequential = True

    def _group_cap(self) -> int:
        """Most fits per group: ``max_group_size``, or its automatic value (see the class docstring)."""
        if self.max_group_size is not None:
            return self.max_group_size
        loop = self.loop
        assert loop is not None and loop.model is not None
        if loop.device.type != "cpu":
            return 1 << 30
        client = sum(t.numel() * t.element_size() for t in loop.model.state_dict().values())
        return max(1, _CPU_GROUP_BYTES // max(1, client))

    def _collect_hooks(self) -> list[tuple[Any, list[str]]]:
        """The callbacks' vectorised forms, in callback order, into :attr:`hooks`; returns the callbacks that have
        in-fit hooks and no such form (with those hooks). Done again at every :meth:`run`: an out-of-process worker
        receives the driver's callbacks anew for every stage."""
        assert self.loop is not None
        self.hooks, refused = [], []
        for cb in self.loop.callbacks:
            declare = getattr(cb, "vectorized_fit", None)
            declares = callable(declare)
            try:
                form = declare() if declares else None  # type: ignore[misc]
            except ConfigError:  # its settings have no vectorised form (the error says which)
                if self.unsupported == "error":
                    raise
                form = NotImplemented
            hooks = in_fit_hooks(cb)
            if form is NotImplemented or (form is None and hooks and not declares):
                refused.append((cb, hooks))
            elif form is not None:
                self.hooks.append((cb, form))
        providers = [type(cb).__name__ for cb, form in self.hooks if getattr(form, "gradients", None) is not None]
        if len(providers) > 1:
            raise ConfigError(f"trainer.callbacks is invalid with trainer.executor=VectorizedExecutor: "
                              f"{', '.join(providers)} each compute a stacked step's gradients themselves; expected "
                              "at most one such callback")
        return refused

    def _optimizer(self, module: pl.LightningModule, names: Mapping[int, str], ctx: FitContext) -> ElementwiseOptim:
        """The fit's optimizer (``configure_optimizers`` under its context). The shipped module's depends on the
        fit's ``lr_round`` and on which parameters train only, so it is built once per both."""
        from pl_fedsparse.module import FederatedModule

        kind = type(module)
        if (kind.configure_optimizers is not FederatedModule.configure_optimizers
                or getattr(kind, "current_lr", None) is not FederatedModule.current_lr):
            return elementwise_optimizer(module, names)
        key = (ctx.lr_round, tuple(p.requires_grad for p in self._params))
        if key not in self._optimizers:
            self._optimizers = {key: elementwise_optimizer(module, names)}  # one round's: no growth over a run
        return self._optimizers[key]

    def round_metrics(self) -> dict[str, Any]:
        out = {}
        if self._stats["sequential_fits"] and not self._all_sequential:
            out = {"sequential_fits": self._stats["sequential_fits"]}  # a group fell back: say so in the row
        self._stats = {"vectorized_fits": 0, "sequential_fits": 0}
        return out

    def run(self, requests: Sequence[FitRequest]) -> list[ClientUpdate]:
        if self._all_sequential:
            self._stats["sequential_fits"] += len(requests)
            return self.sequential.run(requests)
        if self._collect_hooks():  # (a worker's callbacks changed since setup: never silently drop an in-fit hook)
            raise ConfigError("trainer.callbacks is invalid with trainer.executor=VectorizedExecutor: a callback "
                              "with in-fit hooks and no vectorized_fit appeared after the federation started")
        out: list[ClientUpdate | None] = [None] * len(requests)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, r in enumerate(requests):  # one kind of fit per group: the callbacks' in-fit forms may rely on it
            c = r.context
            if not all(getattr(form, "supports", _any_fit)(c) for _, form in self.hooks):
                out[i] = self.sequential.run_one(r)  # a kind of fit a callback cannot stack (e.g. pFedGate's
                self._stats["sequential_fits"] += 1  # gate-only fine-tuning): in process, as the executor would
                continue
            groups.setdefault((c.kind, c.requester, c.epochs), []).append(i)
        cap = self._group_cap()
        # a group's stacked tensors exceed the mmap threshold: keep them in the heap (see there); the stacked layers
        # call the module's own forward under vmap, not a compiled one (trainer.compile: the one-by-one fits' own)
        assert self.loop is not None
        with heap_only(), running_uncompiled(self.loop.model):
            for members in groups.values():
                parts = -(-len(members) // cap)
                base, extra = divmod(len(members), parts)  # equal groups: 100 fits, at most 64 per group -> 50 + 50
                at = 0
                for part in range(parts):
                    size = base + (part < extra)
                    chunk, at = members[at:at + size], at + size
                    for i, u in zip(chunk, self._run_group([requests[i] for i in chunk]), strict=True):
                        out[i] = u
        return [u for u in out if u is not None]

    # ---------------------------------------------------------------------------------------- one group
    def _run_group(self, requests: list[FitRequest]) -> list[ClientUpdate]:
        loop = self.loop
        assert loop is not None and loop.model is not None
        module = loop.model
        callbacks = list(loop.callbacks)
        before = CallbackSnapshot(callbacks)
        names = {id(p): n for n, p in module.named_parameters()}
        self._params = list(module.parameters())
        full = list(module.state_dict())
        # the working module matters to a fit's start and end only where a callback reads or edits it there
        fed = loop.fed_callbacks
        at_start = bool(self.hooks) or any(_overrides(cb, "on_client_fit_start") for cb in fed)
        at_end = any(_overrides(cb, "on_client_fit_end") for cb in fed)
        started: list[dict[str, Any]] = []
        stacked: dict[str, Tensor] = {}
        pending: dict[str, list[tuple[int, Tensor]]] = {}  # name -> (row, start tensor) still to copy
        results: list[ClientUpdate | None] = [None] * len(requests)
        for i, request in enumerate(requests):
            ctx = request.context
            before.restore()  # each fit starts from the callbacks as they were before the stage, as in process
            direct = not at_start and list(request.start) == full  # the start weights go straight into the rows
            watch, n_samples = begin_fit(loop, request, load=not direct)
            item: dict[str, Any] = {"index": i, "request": request, "watch": watch, "n_samples": n_samples}
            try:
                with fit_scope(ctx):
                    loop.call("on_client_fit_start", module, ctx)
                    loader = loop.datamodule.train_loader(ctx.client_idx, seed=ctx.seed)
                    item["optim"] = self._optimizer(module, names, ctx)
                    for _, hooks in self.hooks:
                        hooks.capture(len(started), module, ctx)
            except ConfigError:
                raise
            except Exception as e:
                if loop.on_client_fault == "raise":
                    raise fault_to_raise(loop, ctx, e)  # noqa: B904 (its cause is e)
                results[i] = end_fit(loop, request, watch, n_samples, None, e)
                continue
            steps = loop.local_steps if ctx.epochs is None else None
            epochs = None if steps else (ctx.epochs or loop.local_epochs)
            item["stream"] = ClientStream(loader, epochs, steps)
            item["snapshot"] = CallbackSnapshot(callbacks)
            row_views: list[Tensor] = []
            sources: list[Tensor] = []
            with torch.no_grad():  # the start weights (after on_client_fit_start) into the stacked rows
                for name, t in (request.start if direct else module.state_dict()).items():
                    if name not in stacked:
                        stacked[name] = torch.empty((len(requests), *t.shape), dtype=t.dtype, device=loop.device)
                    if direct:  # the request's own tensors: copied below, one copy per run of rows sharing them
                        pending.setdefault(name, []).append((len(started), t))
                    else:  # the working module's: the next client's start overwrites them
                        row_views.append(stacked[name][len(started)])
                        sources.append(t)
            transfer.copy_into(row_views, sources)  # (one multi-tensor copy a client, not one a tensor)
            started.append(item)
        with torch.no_grad():
            for name, rows in pending.items():
                _copy_runs(stacked[name], rows)
        stacked = {n: t[:len(started)] for n, t in stacked.items()}
        transfer.mark_placed(stacked.values(), loop.device)  # (a device run simulated on the CPU: on "the device")
        # one optimizer configuration per stacked group (the same module and kind: in practice always one)
        by_signature: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for item in started:
            by_signature.setdefault(item["optim"].signature(), []).append(item)
        for items in by_signature.values():
            try:
                if len(by_signature) > 1:  # the hooks were captured for the whole group: it cannot be split
                    raise RuntimeError("clients of one group configured different optimizers")
                states, loss_sum, seen = self._train(items, stacked)
            except (ConfigError, KeyboardInterrupt):
                raise
            except Exception as e:  # contain it: this group's clients run one by one, as in process
                if loop.on_client_fault == "raise":
                    raise fault_to_raise(loop, items[0]["request"].context, e)  # noqa: B904 (its cause is e)
                log.warning("VectorizedExecutor: a stacked step failed (%s: %s); its %d fits run in process",
                            type(e).__name__, e, len(items))
                for item in items:
                    request = item["request"]
                    loop.client_store.restore_client(request.context.client_idx, request.client_state)
                    before.restore()
                    results[item["index"]] = self.sequential.run_one(request)
                    self._stats["sequential_fits"] += 1
                continue
            # every client's loss sum and whether its weights are finite (find_fault then skips them), read in one
            # go: one wait on a device for the group, not one per client or per question
            sums, finite = _read_group(loss_sum, _finite_rows(stacked))
            trained = [(state, {"train_loss": mean_loss(sums[i], n), "samples_seen": float(n)})
                       for i, (state, n) in enumerate(zip(states, seen))]
            # where the fits' weights are on a device, their updates reach the host as the in-process executor's
            # do: kept there through the callbacks' on_client_fit_end where all of them take it there, then in one
            # copy with the client's entries (end_fit) — and with no callback at a fit's end, every client's trained
            # weights in one copy for the whole group (one crossing and one wait, not one per client)
            on_device = self.sequential._device_update()  # (asked once a federation, as in process)
            host_rows = None
            if not at_end and transfer.on_a_device(stacked.values()):
                host_rows = dict(zip(stacked, transfer.copy_tensors(list(stacked.values()), "cpu", share=True)))
            for i, (item, (state, metrics)) in enumerate(zip(items, trained, strict=True)):
                request, ctx = item["request"], item["request"].context
                item["snapshot"].restore()
                update, error, known = None, None, []
                try:
                    with fit_scope(ctx):
                        for _, hooks in self.hooks:
                            finish = getattr(hooks, "finish", None)  # (optional, as ``end``)
                            if finish is not None:
                                finish(i, module, ctx)
                        if at_end:
                            load_state(module, state)
                        if host_rows is not None:  # (this client's row of the group's host copy)
                            state = {n: host_rows[n][i] for n in state}
                        update = fit_update(module, ctx, item["n_samples"], metrics, None if at_end else state,
                                            on_device=on_device)
                        if finite[i]:
                            known = [id(t) for t in update.state.values()]
                        loop.call("on_client_fit_end", module, update)
                except Exception as e:
                    if loop.on_client_fault == "raise":
                        raise fault_to_raise(loop, ctx, e)  # noqa: B904 (its cause is e)
                    error = e
                results[item["index"]] = end_fit(loop, request, item["watch"], item["n_samples"], update, error,
                                                 known)
                self._stats["vectorized_fits"] += 1
        return [u for u in results if u is not None]

    def _train(self, items: list[dict[str, Any]], stacked: dict[str, Tensor]
               ) -> tuple[list[dict[str, Tensor]], Tensor, list[int]]:
        """Train ``items`` (started fits, their start states the rows of ``stacked``) together; return each one's
        trained state and fit metrics."""
        loop = self.loop
        assert loop is not None and loop.model is not None
        module, device = loop.model, loop.device
        optims: list[ElementwiseOptim] = [it["optim"] for it in items]
        trainable = list(optims[0].lr)
        K = len(items)
        P = {n: t for n, t in stacked.items() if n in optims[0].lr}  # trained in place
        F = {n: t for n, t in stacked.items() if n not in optims[0].lr}  # buffers, frozen parameters
        opt_state: dict[str, dict[str, Tensor]] = {n: {} for n in trainable}
        steps_done = torch.zeros(K, dtype=torch.long)
        fit = StackedFit([it["request"].context for it in items], P, {}, device, optimizer_state=opt_state,
                         optimizer_index=dict(optims[0].index), steps=steps_done, precision=loop.precision,
                         optimizer=optims[0].kind)
        for _, hooks in self.hooks:
            hooks.start(fit)
        opt_state, steps_done = fit.optimizer_state, fit.steps  # (a hook may have continued an earlier fit's)
        lrs = {n: [o.lr[n] for o in optims] for n in trainable}
        provider: Any = None  # a hook that computes the step's gradients itself (at most one: checked at setup)
        for _, hooks in self.hooks:
            edit = getattr(hooks, "learning_rates", None)  # (optional: Lightning's on_train_start may scale them)
            if edit is not None:
                edit(fit, lrs)
            if getattr(hooks, "gradients", None) is not None:
                provider = hooks
        # clients' batches of different sizes in one step, padded (where the form computing the gradients says it
        # takes them, after its start: the module's own loss is a batch mean, which padding would change)
        ragged = provider is not None and bool(getattr(provider, "ragged", False))
        step_fn = sgd_step if optims[0].kind == "sgd" else adam_step
        loss_sum = torch.zeros(K, dtype=torch.float32, device=device)
        seen = [0] * K
        streams: list[ClientStream] = [it["stream"] for it in items]
        module.to(device).train()
        autocast = loop.precision == "bf16-mixed"
        grad_fn = torch.func.vmap(torch.func.grad_and_value(_loss_of(module, device.type, autocast)))
        clip = loop.gradient_clip_val
        first = streams[0].loader
        bulk = all(st.bulk and first.same_inputs(st.loader) for st in streams)  # all rows gathered at once
        grouped = self.convolutions == "grouped"
        while True:
            batches = [s.next() for s in streams]
            live = [i for i, b in enumerate(batches) if b is not None]
            if not live:
                break
            # the step runs on the rows of the clients that still have a batch (all of them, until the smaller
            # clients stop): compact copies of those rows, written back after the step — the others are untouched
            everyone = len(live) == K
            at = None if everyone else transfer.host_tensor(live, device)
            sP = P if at is None else {n: p.index_select(0, at) for n, p in P.items()}
            sF = F if at is None else {n: f.index_select(0, at) for n, f in F.items()}
            sS = opt_state if at is None else {n: {k: v.index_select(0, at) for k, v in st.items()}
                                               for n, st in opt_state.items()}
            fit.clients, fit.epochs = list(live), [streams[i].epoch for i in live]
            fit.batch_sizes = [len(batches[i]) if bulk else int(batches[i][1].shape[0]) for i in live]
            fit.no_grad = {}
            for _, hooks in self.hooks:
                frozen = getattr(hooks, "frozen_rows", None)  # (optional: tensors without a gradient at this step)
                if frozen is not None:
                    fit.no_grad.update(frozen(fit))
            # a tensor frozen in every row: not stepped, and (the module's own loss) not differentiated — as
            # autograd and torch.optim skip a parameter without a gradient
            idle = {n for n, rows in fit.no_grad.items() if rows and all(rows)}
            untouched = idle if provider is None else set()
            G: dict[str, Tensor] = {}
            skipped: set[int] = set()  # clients whose batch makes no optimizer step (the gradient hook says so)
            shapes: dict[tuple[Any, ...], list[int]] = {}  # batch shape -> positions in ``live``
            for pos, i in enumerate(live):
                if bulk:
                    key: tuple[Any, ...] = () if ragged else (len(batches[i]),)
                else:
                    x, y = batches[i]
                    key = (tuple(x.shape[1:]), tuple(y.shape[1:])) if ragged else (tuple(x.shape), tuple(y.shape))
                shapes.setdefault(key, []).append(pos)
            for positions in shapes.values():
                lengths = [fit.batch_sizes[q] for q in positions]
                per = max(lengths)
                sizes = lengths if any(n != per for n in lengths) else None  # padded to the longest (ragged forms)
                if bulk:  # (a shorter batch padded with its own first sample: real values, masked out)
                    rows_cat = torch.cat([_pad_rows(batches[live[q]], per) for q in positions])
                    xs = first.inputs(rows_cat)
                    xs = transfer.send(xs.view(len(positions), per, *xs.shape[1:]), device)
                    ys = transfer.send(first.labels.index_select(0, rows_cat).view(len(positions), per), device)
                else:  # (data on the host: the step's batches sent without a wait for the device, as pin_memory does)
                    xs = transfer.send(torch.stack([_pad_rows(batches[live[q]][0], per) for q in positions]), device)
                    ys = transfer.send(torch.stack([_pad_rows(batches[live[q]][1], per) for q in positions]), device)
                transfer.mark_placed((xs, ys), device)  # (a device run simulated on the CPU: on "the device")
                whole = len(positions) == len(live)
                idx = None if whole else transfer.host_tensor(positions, device)
                sub_p = sP if idx is None else {n: p.index_select(0, idx) for n, p in sP.items()}
                sub_f = sF if idx is None else {n: f.index_select(0, idx) for n, f in sF.items()}
                if untouched:
                    sub_f = {**sub_f, **{n: sub_p[n] for n in untouched}}
                    sub_p = {n: p for n, p in sub_p.items() if n not in untouched}
                rows = [live[q] for q in positions]
                if not self._gradients_checked:  # once: the first stacked step
                    # (the module's own batching rules, also where a callback computes the gradients itself; in
                    # float32 whatever the precision: a batching rule is the same for every dtype, and bfloat16's
                    # rounding would hide a wrong one)
                    with exact_linear(True, grouped_convolutions=grouped):
                        _check_gradients_of(module, device.type, sub_p, sub_f, xs, ys,
                                            grad_fn if not autocast else torch.func.vmap(torch.func.grad_and_value(
                                                _loss_of(module, device.type, False))))
                    _check_training_step(module, sub_p, sub_f, xs[0, :lengths[0]], ys[0, :lengths[0]])
                    self._gradients_checked = True
                with exact_linear(True, grouped_convolutions=grouped):
                    # the callback's own forward (e.g. pFedGate's gated model), or None: the module's own loss
                    own = None
                    if provider is not None:
                        own = (provider.gradients(fit, sub_p, sub_f, xs, ys, rows, sizes=sizes) if sizes is not None
                               else provider.gradients(fit, sub_p, sub_f, xs, ys, rows))
                    if own is None and sizes is not None:  # (the module's own loss is a batch mean: not padded)
                        raise RuntimeError(f"{type(provider).__name__} said it takes batches of different sizes "
                                           "(ragged) and returned no gradients for them")
                    if own is None:
                        grads, losses = grad_fn(sub_p, sub_f, xs, ys)
                    else:
                        grads, losses, skip = own
                        if skip is not None:
                            skipped.update(i for i, s in zip(rows, skip, strict=True) if s)
                for n, g in grads.items():
                    if idx is None:
                        G[n] = g
                    else:
                        G.setdefault(n, torch.empty_like(sP[n])).index_copy_(0, idx, g)
                weighted = losses.detach().float() * (per if sizes is None
                                                      else transfer.host_tensor(sizes, device, torch.float32))
                if everyone and idx is None:  # (every client's row, in order: no index to send)
                    loss_sum.add_(weighted)
                else:
                    loss_sum.index_add_(0, transfer.host_tensor(rows, device), weighted)
                for i, n_b in zip(rows, lengths, strict=True):
                    seen[i] += n_b
            if skipped:  # those clients' rows take no step: as if they had no batch (weights and state untouched)
                keep = [q for q, i in enumerate(live) if i not in skipped]
                if not keep:
                    continue
                stepping = transfer.host_tensor(keep, device)
                sP = {n: p.index_select(0, stepping) for n, p in sP.items()}
                G = {n: g.index_select(0, stepping) for n, g in G.items()}
                sS = {n: {k: v.index_select(0, stepping) for k, v in st.items()} for n, st in sS.items()}
                live = [live[q] for q in keep]
                at = transfer.host_tensor(live, device)
                fit.clients, fit.epochs, fit.batch_sizes = ([v[q] for q in keep]
                                                            for v in (fit.clients, fit.epochs, fit.batch_sizes))
                fit.no_grad = {n: [rows[q] for q in keep] for n, rows in fit.no_grad.items()}
                idle = {n for n, rows in fit.no_grad.items() if rows and all(rows)}
            fit.params, fit.grads, fit.rows, fit.step_state = sP, G, at, sS
            for _, hooks in self.hooks:
                hooks.before_optimizer_step(fit)
            if clip is not None:
                clip_per_client(G, float(clip), fit.no_grad)
            counts = _count_steps(fit, live, idle, trainable, steps_done)
            step_fn({n: p for n, p in sP.items() if n not in idle} if idle else sP, G, sS, optims[0],  # (idle: no
                    {n: [v[i] for i in live] for n, v in lrs.items() if n not in idle}, counts)  # state)
            for _, hooks in self.hooks:
                hooks.after_optimizer_step(fit)
            if at is not None:
                for n, p in P.items():
                    p.index_copy_(0, at, sP[n])
                    for k, v in sS[n].items():
                        if k not in opt_state[n]:  # created at this step: rows of clients that never stepped stay 0
                            opt_state[n][k] = torch.zeros((K, *v.shape[1:]), dtype=v.dtype, device=v.device)
                            if k == "momentum_buffer" and skipped and "fresh" not in sS[n]:
                                # a skipped client steps later: SGD's first step takes the gradient, not a decayed 0
                                fresh = torch.ones(K, dtype=torch.bool, device=v.device)
                                opt_state[n]["fresh"] = fresh.index_fill_(0, at, False)
                        opt_state[n][k].index_copy_(0, at, v)
            fit.params, fit.grads, fit.rows, fit.step_state = P, {}, None, {}
            fit.clients, fit.epochs, fit.batch_sizes, fit.no_grad = [], [], [], {}
        for _, hooks in self.hooks:
            end = getattr(hooks, "end", None)  # (optional: forms written before it existed have none)
            if end is not None:
                end(fit)
        return [{n: t[i] for n, t in stacked.items()} for i in range(K)], loss_sum, seen  # (views: loaded, copied)


def _count_steps(fit: StackedFit, live: list[int], idle: set[str], trainable: list[str], steps_done: Tensor
                 ) -> dict[str, Tensor] | Tensor:
    """Count the step about to be made; return Adam's step counts for it (each row's, including this step).

    ``steps_done`` counts each client's steps. Where a form freezes a tensor in some rows (``fit.no_grad``),
    ``torch.optim.Adam`` counts that tensor's own steps — a parameter without a gradient takes none — so from the
    first such step each tensor has its own counts (``fit.tensor_steps``; a form or hook may set them in ``start`` to
    continue an earlier fit's). A frozen row is given the count it would have if it stepped: the form puts its weights
    and moments back after the step."""
    apart = fit.optimizer == "adam" and (fit.tensor_steps is not None
                                         or any(any(rows) for rows in fit.no_grad.values()))
    if apart and fit.tensor_steps is None:  # every tensor has stepped with its client so far
        fit.tensor_steps = {n: steps_done.clone() for n in trainable}
    steps_done[live] += 1
    if not apart:
        return steps_done[live]
    assert fit.tensor_steps is not None
    out = {}
    for n in trainable:
        if n in idle:
            continue
        count = fit.tensor_steps[n]
        frozen = fit.no_grad.get(n)
        if frozen is None or not any(frozen):
            count[live] += 1
            out[n] = count[live]
        else:
            took = torch.tensor([not f for f in frozen], dtype=torch.long)
            count[live] += took
            out[n] = count[live] + (1 - took)
    return out


def _pad_rows(t: Tensor, length: int) -> Tensor:
    """``t`` with its first row repeated after its own rows up to ``length`` rows (real values, masked out)."""
    if len(t) == length:
        return t
    return torch.cat([t, t[:1].expand(length - len(t), *t.shape[1:])])


def _any_fit(context: FitContext) -> bool:
    """A vectorised form without ``supports``: it stacks every fit."""
    return True


def _copy_runs(out: Tensor, rows: list[tuple[int, Tensor]]) -> None:
    """``out[row] = tensor`` for every ``(row, tensor)``, consecutive rows holding the same tensor (FedAvg: every
    client starts from the global weights) in one broadcast copy."""
    at = 0
    while at < len(rows):
        first, t = rows[at]
        end = at + 1
        while end < len(rows) and rows[end][1] is t and rows[end][0] == first + (end - at):
            end += 1
        out[first:first + end - at].copy_(t.unsqueeze(0).expand(end - at, *t.shape))
        at = end


def _finite_rows(stacked: dict[str, Tensor]) -> Tensor | None:
    """Per row (client): whether all its floating-point tensors are certainly finite — their sum is (a NaN or an
    infinity makes it non-finite; a sum that overflows only sends that client to the one-by-one check); not read
    (``None`` without floating-point tensors)."""
    ok: Tensor | None = None
    for t in stacked.values():
        if t.is_floating_point():
            rows = torch.isfinite(t.reshape(t.shape[0], -1).sum(dim=1))
            ok = rows if ok is None else ok & rows
    return ok


def _read_group(loss_sum: Tensor, finite: Tensor | None) -> tuple[list[float], list[bool]]:
    """A group's loss sums (float32, one per client) and finite rows read in one copy: the float32 sums exactly
    (widened to float64), the flags as 0/1."""
    if finite is None:
        return loss_sum.tolist(), [True] * loss_sum.numel()
    both = torch.cat([loss_sum.double(), finite.double()]).tolist()  # (one device: the group's)
    k = loss_sum.numel()
    return both[:k], [bool(x) for x in both[k:]]


def _overrides(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s class overrides the federation hook ``hook`` of ``FederatedCallback``."""
    from pl_fedsparse.callbacks.base import FederatedCallback

    return getattr(type(callback), hook, None) is not getattr(FederatedCallback, hook)


def _check_gradients_of(module: pl.LightningModule, device_type: str, params: dict[str, Tensor],
                        fixed: dict[str, Tensor], xs: Tensor, ys: Tensor, grad_fn: Any) -> None:
    """Refuse (one line) a module whose stacked gradients are not its clients' own up to rounding
    (:func:`~pl_fedsparse.executors.stacked.stacked_gradient_error`): a fast wrong answer must not pass as the
    in-process executor's. Both sides are computed again in IEEE float32
    (:func:`~pl_fedsparse.executors.stacked.full_fp32`), so that TF32's rounding on a GPU is not taken for a wrong
    batching rule; training itself keeps the user's setting (the in-process run uses it too)."""
    with full_fp32():
        grads = grad_fn(params, fixed, xs, ys)[0]
        err, name = stacked_gradient_error(_loss_of(module, device_type, False), params, fixed, xs, ys, grads)
    if err > STACKED_GRADIENT_TOLERANCE:
        backbone = getattr(module, "backbone", None)
        what = type(module).__name__ + (f" (backbone {type(backbone).__name__})" if backbone is not None else "")
        raise ConfigError(f"trainer.executor=VectorizedExecutor cannot train model={what}: its "
                          f"stacked gradients differ from one client's own by {err:.1e} of the largest ({name}; "
                          f"rounding stays below {STACKED_GRADIENT_TOLERANCE:.0e}), a torch.func batching rule of one "
                          "of its layers disagrees with the layer; run it in process (drop trainer.executor)")


class _TrainingStep(torch.nn.Module):
    """``module.training_step((x, y), 0)`` as a forward, for ``functional_call`` with one client's weights."""

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        self.m = module

    def forward(self, x: Tensor, y: Tensor) -> Any:
        return self.m.training_step((x, y), 0)


def _check_training_step(module: pl.LightningModule, params: dict[str, Tensor], fixed: dict[str, Tensor], x: Tensor,
                         y: Tensor) -> None:
    """Refuse (one line) a module of its own ``training_step`` that says ``vectorizable = True`` when that step's
    loss is not ``loss(forward(x), y)`` on a batch of the first stacked step (one client's weights, float32): the
    stacked step trains the latter, so a penalty or an augmentation inside ``training_step`` would be trained away
    silently. A step that cannot run outside a fit (it reads its trainer) is not checked (one log line)."""
    from pl_fedsparse.module import FederatedModule

    if getattr(type(module), "training_step", None) is FederatedModule.training_step:
        return
    state = {n: t[0] for n, t in {**params, **fixed}.items()}
    try:
        with torch.no_grad(), full_fp32(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (self.log outside a fit: Lightning's warning)
            expected = training_loss(module, torch.func.functional_call(module, state, (x,)), y)
            out = torch.func.functional_call(_TrainingStep(module), {f"m.{n}": t for n, t in state.items()}, (x, y))
    except Exception as e:  # noqa: BLE001 - the user's step outside a fit: not checkable, not wrong
        log.info("VectorizedExecutor: %s.training_step could not run outside a fit to be compared with "
                 "loss(forward(x), y) (%s: %s); not checked", type(module).__name__, type(e).__name__, e)
        return
    loss = out.get("loss") if isinstance(out, dict) else out
    if not (isinstance(loss, Tensor) and loss.shape == expected.shape
            and torch.allclose(loss.float(), expected.float(), rtol=1e-5, atol=1e-7)):
        got = f"{float(loss):.6g}" if isinstance(loss, Tensor) and loss.numel() == 1 else type(loss).__name__
        raise ConfigError(f"trainer.executor=VectorizedExecutor cannot train model={type(module).__name__}: it sets "
                          f"vectorizable = True but its training_step's loss ({got}) is not loss(forward(x), y) "
                          f"({float(expected):.6g}) on a batch — the stacked step would train the latter; drop "
                          "vectorizable (its fits run in process) or make training_step loss(forward(x), y)")


def _loss_of(module: pl.LightningModule, device_type: str, autocast: bool) -> Any:
    """``(params, fixed, x, y) -> loss`` of one client, for ``grad_and_value`` (gradients w.r.t. ``params``). Under
    ``bf16-mixed`` the forward and the loss run under autocast, the backward outside it (as Lightning does); under
    :func:`~pl_fedsparse.executors.stacked.exact_linear` ``F.linear`` is :class:`_StackedLinear` (the same bits as
    one client's, under autocast too)."""

    def loss(params: dict[str, Tensor], fixed: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
            logits = torch.func.functional_call(module, {**params, **fixed}, (x,))
            return training_loss(module, logits, y)

    return loss
