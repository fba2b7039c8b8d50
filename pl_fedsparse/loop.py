"""The :class:`FederatedLoop`: the orchestration of a federation, and nothing else.

One round (0-based ``round_idx``)::

    on_round_start
    participants = select_clients(...)                      # policy; default: uniform, seeded by (seed, round)
    for each participant: message = client_message(k)       # policy, then on_client_message may edit it
                          request = (context, start, the client's declared state)
    updates = executor.run(requests)                        # on_client_fit_start → Lightning fit → on_client_fit_end
    on_before_aggregate → requested fits ("before_aggregate")
    global = aggregate(updates) → on_after_aggregate → requested fits ("after_aggregate")
    every eval_every rounds: evaluate (evaluation.Evaluator) → on_round_end → report → checkpoint (atomic)

Its parts live in modules named for their jobs: client execution (:mod:`pl_fedsparse.executors`), the fit context
(:mod:`pl_fedsparse.context`), evaluation (:mod:`pl_fedsparse.evaluation`), reporting (:mod:`pl_fedsparse.run.writer`),
checkpoint state (:mod:`pl_fedsparse.run.checkpoint`), random streams (:mod:`pl_fedsparse.streams`) and accounting
(:class:`pl_fedsparse.metrics.Accounting`). Nothing here is specific to a method: masks, personal weights, residuals
and gates are client state declared by callbacks; messages, aggregation and personal models are policies.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import torch
from torch import Tensor

from pl_fedsparse import policies
from pl_fedsparse.allocator import apply_flush_denormal
from pl_fedsparse.callbacks.base import FederatedCallback, declares, message_device
from pl_fedsparse.client import ClientStateStore, ClientUpdate, Message, to_cpu_state
from pl_fedsparse.context import FitContext, FitKind, FitStage
from pl_fedsparse.contract import CallbackContract
from pl_fedsparse.errors import ConfigError, RunStoppedError, UserCodeError, check, user_code
from pl_fedsparse.evaluation import Evaluator
from pl_fedsparse.executors.base import (
    LOGGED,
    ClientExecutor,
    ClientFaultError,
    FitRequest,
    check_environment,
    load_state,
    local_gradients,
    quiet_lightning,
)
from pl_fedsparse.executors.compiling import check_compile, check_compile_callbacks, unwrap_compiled
from pl_fedsparse.executors.in_process import InProcessExecutor
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.resident import device_budget
from pl_fedsparse.loop_checks import check_arguments, check_client_data, resolve_device
from pl_fedsparse.metrics import SERVER, Accounting, TrainFlops
from pl_fedsparse.protocol import check_datamodule
from pl_fedsparse.run.checkpoint import federation_state, load_checkpoint, restore_federation
from pl_fedsparse.run.writer import RunReporter, results_table
from pl_fedsparse.streams import Streams, stream_seed
from pl_fedsparse.topology import Star, Topology

__all__ = ["FederatedLoop", "stream_seed"]

log = logging.getLogger(__name__)



class FederatedLoop:
    """Runs a federation of per-client Lightning fits.

    Args:
        num_rounds: number of communication rounds.
        join_ratio: fraction of clients sampled per round, in (0, 1].
        clients_per_round: number of clients per round (overrides ``join_ratio`` when set).
        local_epochs: epochs of local training per client and round (Lightning's ``max_epochs`` of each fit).
        local_steps: if set, optimizer steps per fit instead of epochs.
        eval_every: evaluate every this many rounds (and always after the last round).
        eval_split: client split used for evaluation during ``fit``.
        eval_global: also evaluate the global model (when there is one) on every client's data.
        eval_metrics: per-client metrics besides accuracy and loss, from
            :data:`~pl_fedsparse.metrics.EVAL_METRICS` (``f1_macro``, ``ece``; see :mod:`pl_fedsparse.evaluation`).
        accelerator: Lightning accelerator (``"cpu"``, ``"gpu"``, ``"auto"``).
        devices: devices per client fit (one client fit runs on one device).
        precision: ``"32-true"``, ``"16-mixed"`` or ``"bf16-mixed"`` (Lightning's names).
        gradient_clip_val: clip the gradient norm at this value in every local step (DisPFL's code: 10).
        default_root_dir: the run directory (``metrics.jsonl``, ``summary.json``, ``config.yaml``,
            ``tensorboard/``, ``checkpoints/``); default ``runs/run-<timestamp>``.
        overwrite: allow writing into a directory that holds another run.
        checkpoint_every: write ``checkpoints/last.ckpt`` every this many rounds (0: only at the end).
        logger: write TensorBoard event files.
        enable_progress_bar: progress bar over rounds (default ``null``: a bar on a terminal; elsewhere — a log file,
            ``nohup``, SLURM — a line per round on stdout, with its seconds, accuracy when evaluated and ETA, and a
            line every 30 s of a long evaluation); ``false``: neither.
        topology: communication graph (default :class:`~pl_fedsparse.topology.Star`).
        callbacks: the method, as a list of (federated) callbacks.
        executor: runs the client fits (default :class:`~pl_fedsparse.executors.InProcessExecutor`).
        on_client_fault: what becomes of a fit that raises or yields a non-finite loss, gradient, weight or upload:
            left out of its round (``"skip"``), left out even where no fit of the round is left (``"continue"``), or
            the end of the run (``"raise"``). Left out, it is not aggregated or gossiped, the client keeps its
            previous state and the fault is reported. With ``"skip"`` a round in which every participant's training
            fit failed stops the run with one line (exit 1; the last checkpoint is intact), since nothing of it could
            be used; with ``"continue"`` such a round leaves the global state unchanged; ``"raise"`` stops the run at
            the first fault.
        keep_checkpoints: keep the last this many round checkpoints (``checkpoints/round-<r>.ckpt``, besides
            ``last.ckpt``) so a run can be restarted from before a problem.
        seed: federation seed (``pl-fed`` sets it from ``--seed_everything``).
        client_state_codec: ``"none"`` (default) or ``"lossless"``: client state compressed between fits. Every
            client's large float32 state (personal models, residuals, ...) then takes 3.4-3.5 bytes per value instead
            of 4, decoded bit for bit when read — the same results, ~12-15 % less memory for the client state, a few ms per
            million values per read and write. For federations whose client state is what fills the memory (e.g.
            1,000 DisPFL ResNet18 clients: ``benchmarks/client_memory.py``).
        callback_contract: ``"error"`` (default) or ``"warn"`` when a callback breaks the callback contract. With
            ``"error"`` the run stops with one line when a callback breaks a checked rule of the contract
            (``docs/extending.md``, "The rules the loop checks": an attribute set during a fit, which an
            out-of-process executor would lose; state a checkpoint does not save); ``"warn"`` logs one warning per
            callback attribute and goes on. Changes no number.
        flush_denormal: treat subnormal floats (magnitudes below 1.2e-38) as zero on the CPU during ``fit``
            (``torch.set_flush_denormal``, here and in out-of-process workers). A CPU computes with subnormals many
            times slower, and they appear once models converge (tiny gradients and Adam moments): a FedPSE round on
            label-sorted Fashion-MNIST ran 1.74x faster with it after 40 rounds, with the same losses, accuracy and
            bytes (``benchmarks/flush_denormal.sh``). Off by default so that results stay bit
            for bit those of earlier runs; numbers move at most in their last bits when it is on, so a resume may
            change it. No effect on GPUs' own arithmetic.
        fit_runner: what drives each local fit: ``"auto"`` the runner where it applies, ``"fast"`` the runner or an
            error, ``"trainer"`` a ``Trainer`` per fit. In detail, for the in-process executor (and Ray workers):
            ``"auto"`` (default) one persistent :class:`~pl_fedsparse.executors.runner.FitRunner` wherever it
            applies (modules with automatic optimisation that keep Lightning's optimiser, backward and batch-transfer
            hooks; one optimizer), else a ``Trainer`` per fit; ``"fast"`` the runner or a one-line error;
            ``"trainer"`` a fresh ``lightning.Trainer`` per fit, the reference. The same numbers either way (bit for
            bit on the CPU); the runner saves the Trainer's milliseconds per fit.
        device_state_budget: GPU memory for copies kept there between fits (auto, a size, or 0). What crossed to
            the GPU is kept so that later fits find it (:mod:`~pl_fedsparse.functional.resident`; the same
            numbers): ``"auto"`` (default) half the free GPU memory when the federation starts (none off CUDA); a
            size (``"2GiB"``, ``"512MB"``, bytes as an int); ``0`` turns it off.
        pin_memory: copies between the host and a CUDA device through pinned host memory, none waiting for the device.
            A fit's inputs cross without holding the host up and its results come back without a staging copy in the
            driver (:mod:`~pl_fedsparse.functional.transfer`). The same numbers either way. The staging buffers
            (about one fit's state) stay locked in host memory, cached by torch for reuse; ``false`` keeps that memory
            pageable. Where pinning fails the engine falls back to pageable memory with one warning. No effect
            without a CUDA device.
        compile: ``torch.compile`` the fits' module: false, true or its arguments. With true its defaults; a
            mapping gives its ``mode``, ``fullgraph``, ``dynamic``, ``backend`` or ``options`` (CUDA-graph modes are
            refused). Compiled once per process, as ``Trainer.fit(torch.compile(model))`` compiles
            (:mod:`~pl_fedsparse.executors.compiling`); each Ray worker compiles its own. Numbers may move in their
            last bits (fused kernels round differently). Passing ``torch.compile(model)`` to :meth:`fit` does the
            same in this process.

    Example:
        .. code-block:: yaml

            trainer:
              num_rounds: 100
              join_ratio: 0.1
              local_epochs: 5
              precision: bf16-mixed
              callbacks:
                - class_path: pl_fedsparse.callbacks.SparseMask
                  init_args: {density: 0.5}
    """

    def __init__(
        self, *, num_rounds: int = 10, join_ratio: float = 1.0, clients_per_round: int | None = None,
        local_epochs: int = 1, local_steps: int | None = None, eval_every: int = 1,
        eval_split: Literal["test", "val"] = "test", eval_global: bool = True,
        eval_metrics: list[Literal["f1_macro", "ece"]] | None = None, accelerator: str = "auto",
        devices: int | str = 1, precision: str = "32-true", gradient_clip_val: float | None = None,
        default_root_dir: str | None = None, overwrite: bool = False, checkpoint_every: int = 1, logger: bool = True,
        enable_progress_bar: bool | None = None, topology: Topology | None = None,
        callbacks: list[pl.Callback] | None = None, executor: ClientExecutor | None = None,
        on_client_fault: Literal["skip", "continue", "raise"] = "skip", keep_checkpoints: int = 2, seed: int = 0,
        client_state_codec: Literal["none", "lossless"] = "none",
        callback_contract: Literal["error", "warn"] = "error", flush_denormal: bool = False,
        fit_runner: Literal["auto", "fast", "trainer"] = "auto", device_state_budget: int | str = "auto",
        pin_memory: bool = True, compile: bool | dict[str, Any] = False,
    ) -> None:
        check_arguments(num_rounds=num_rounds, join_ratio=join_ratio, clients_per_round=clients_per_round,
                        local_epochs=local_epochs, local_steps=local_steps, eval_every=eval_every,
                        eval_split=eval_split, eval_metrics=eval_metrics, precision=precision, devices=devices,
                        accelerator=accelerator, gradient_clip_val=gradient_clip_val,
                        checkpoint_every=checkpoint_every, on_client_fault=on_client_fault,
                        keep_checkpoints=keep_checkpoints, callback_contract=callback_contract, fit_runner=fit_runner,
                        device_state_budget=device_state_budget)
        self.num_rounds, self.join_ratio, self.clients_per_round = num_rounds, join_ratio, clients_per_round
        self.fit_runner = fit_runner
        self.device_state_budget = device_state_budget
        self.local_epochs, self.local_steps = local_epochs, local_steps
        self.eval_every, self.eval_split, self.eval_global = eval_every, eval_split, eval_global
        self.eval_metrics: list[str] = list(dict.fromkeys(eval_metrics or []))
        self.accelerator, self.precision, self.gradient_clip_val = accelerator, precision, gradient_clip_val
        # (an empty path is an unset shell variable, "$RUN": not "no directory given", which starts a new run elsewhere)
        check(default_root_dir is None or str(default_root_dir).strip() != "", "trainer.default_root_dir",
              default_root_dir, "a directory path, or null for a new runs/run-<time> directory")
        self.default_root_dir, self.overwrite, self.checkpoint_every = default_root_dir, overwrite, checkpoint_every
        self.logger, self.enable_progress_bar = logger, enable_progress_bar
        self.on_client_fault, self.keep_checkpoints = on_client_fault, keep_checkpoints
        self.topology = topology if topology is not None else Star()
        self.callbacks: list[pl.Callback] = list(callbacks or [])
        self.executor: ClientExecutor = executor if executor is not None else InProcessExecutor()
        self.seed = int(seed)
        #: YAML text of the full configuration; ``pl-fed`` sets it and the loop writes it as ``config.yaml``
        self.config_text: str | None = None
        self.streams = Streams(self.seed)
        #: how the client-state store keeps tensors (:class:`~pl_fedsparse.client.ClientStateStore`'s ``codec``)
        self.client_state_codec = client_state_codec
        self.client_store = ClientStateStore(client_state_codec)  # (checks the value)
        #: ``"error"`` or ``"warn"`` when a callback breaks the checked rules of the callback contract
        #: (:mod:`pl_fedsparse.contract`: attributes changed during a fit; state a save → load round trip loses)
        self.callback_contract = callback_contract
        self.contract = CallbackContract(callback_contract)
        check(isinstance(flush_denormal, bool), "trainer.flush_denormal", flush_denormal, "true or false")
        self.flush_denormal = flush_denormal
        check(isinstance(pin_memory, bool), "trainer.pin_memory", pin_memory, "true or false")
        self.pin_memory = pin_memory
        check_compile(compile)  # (a one-line error now; the executor compiles: compiling.compile_module)
        #: ``trainer.compile`` as given
        self.compile = compile
        #: the ``torch.compile`` wrapper :meth:`fit` was given, if any (its module is :attr:`model`)
        self._compiled_model: Any = None
        self.accounting = Accounting()
        self.evaluator = Evaluator(self)
        self.reporter = RunReporter(self)
        self.global_state: dict[str, Tensor] | None = None
        self.initial_state: dict[str, Tensor] = {}
        self.round_idx = 0
        self.history: list[dict[str, Any]] = []
        self.last_client_acc: list[float] = []
        #: the aggregated update of the current round, for aggregation policies that compute one (``ΔW_s``; the
        #: downstream policy may use it), else ``None``
        self.server_update: dict[str, Tensor] | None = None
        #: while the round's own fits run, their fault warnings wait here (see :meth:`run_fits`)
        self._held_fault_warnings: list[tuple[Any, ...]] | None = None
        #: the current round's failed fits: ``{"client", "kind", "fit"}`` each
        self.round_faults: list[dict[str, Any]] = []
        self._first_fault_detail = ""
        self.time_cum = 0.0
        self.model: pl.LightningModule | None = None
        self.datamodule: Any = None
        self.run_dir: Path | None = None
        self._owners: dict[str, FederatedCallback] = {}

    # ------------------------------------------------------------------------------------------------ basics
    @property
    def fed_callbacks(self) -> list[FederatedCallback]:
        """The callbacks that receive federation hooks."""
        return [c for c in self.callbacks if isinstance(c, FederatedCallback)]

    @property
    def num_clients(self) -> int:
        return int(self.datamodule.num_clients)

    @property
    def device(self) -> torch.device:
        """Device of local fits and evaluation (a one-line ConfigError when the accelerator asked for is not there)."""
        return resolve_device(self.accelerator)

    def _check_client_data(self, datamodule: Any) -> None:
        """Before anything is written: every client should have training and evaluation data
        (:func:`~pl_fedsparse.loop_checks.check_client_data`)."""
        check_client_data(datamodule, self.num_clients, self.eval_split)

    def call(self, hook: str, *args: Any) -> None:
        """Call a broadcast hook on every federated callback, in list order (what one raises is one line naming
        its class, the hook and the round)."""
        for cb in self.fed_callbacks:
            with user_code(cb, hook, f"round {self.round_idx}"):
                getattr(cb, hook)(self, *args)

    def _resolve_policies(self) -> None:
        self._owners = {}
        keys = [cb.state_key for cb in self.fed_callbacks]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ConfigError(f"trainer.callbacks={dup} is invalid: expected each callback at most once "
                              "(give repeated callbacks distinct arguments or subclass them)")
        for cb in self.fed_callbacks:
            for p in type(cb).owned_policies():
                if p in self._owners:
                    raise ConfigError(
                        f"trainer.callbacks is invalid: policy {p!r} is claimed by both "
                        f"{type(self._owners[p]).__name__} and {type(cb).__name__}; expected one owner per policy")
                self._owners[p] = cb

    # ------------------------------------------------------------------------------------------------ policies
    def policy(self, name: str, *args: Any) -> Any:
        """Call policy ``name`` on its owner, or the loop's default (:mod:`pl_fedsparse.policies`)."""
        owner = self._owners.get(name)
        if owner is None:
            return getattr(policies, name)(self, *args)
        with user_code(owner, name, f"round {self.round_idx}"):
            return getattr(owner, name)(self, *args)

    def policy_owner(self, name: str) -> FederatedCallback | None:
        """The callback that owns policy ``name``, or ``None`` where the loop's default applies."""
        return self._owners.get(name)

    def select_clients(self, round_idx: int) -> list[int]:
        """Participants of ``round_idx`` (sorted)."""
        chosen = self.policy("select_clients", round_idx, list(range(self.num_clients)))
        owner = self.policy_owner("select_clients")
        if owner is not None:  # the user's policy: what it returns is checked here, and named
            ok = isinstance(chosen, (list, tuple)) and all(
                isinstance(k, int) and not isinstance(k, bool) and 0 <= k < self.num_clients for k in chosen)
            if not ok:
                raise UserCodeError(f"{type(owner).__name__}.select_clients returned {chosen!r:.80}: expected a list "
                                    f"of client ids in [0, {self.num_clients}) (round {round_idx})")
        return sorted(chosen)

    def client_message(self, client_idx: int) -> Message | None:
        """What the server sends ``client_idx``, after every callback's ``on_client_message`` edited it."""
        message = self.policy("client_message", client_idx)
        if message is not None:
            self.call("on_client_message", client_idx, message)
        return message

    def aggregate(self, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        """The new global state from the round's updates — computed on the fits' device where the policy works
        there (:meth:`aggregation_device`), handed back on the host."""
        device = self.aggregation_device()
        state = self.policy("aggregate", updates) if device is None else self._aggregate_on(device, updates)
        if state is not None and not (isinstance(state, Mapping) and all(isinstance(v, Tensor)
                                                                         for v in state.values())):
            raise UserCodeError(f"{type(self.policy_owner('aggregate')).__name__}.aggregate returned "
                                f"{type(state).__name__}: expected a dict of tensors (the new global state) or None "
                                f"(round {self.round_idx})")
        return state  # type: ignore[return-value]  # (any mapping of tensors, as checked)

    def aggregation_device(self) -> torch.device | None:
        """Where the ``aggregate`` policy runs: the device the fits run on in this process
        (:func:`~pl_fedsparse.callbacks.base.message_device`), when there is a global model and the policy works
        there — the default (FedAvg) does, a callback's own when its class says ``device_aggregate = True``
        (:attr:`~pl_fedsparse.callbacks.FederatedCallback.device_aggregate`); ``None`` (the host) otherwise."""
        if self.global_state is None:
            return None
        device = message_device(self)
        owner = self.policy_owner("aggregate")
        if device is None or (owner is not None and not declares(owner, "aggregate", "device_aggregate")):
            return None
        return device

    def _aggregate_on(self, device: torch.device, updates: Sequence[ClientUpdate]) -> dict[str, Tensor] | None:
        """The ``aggregate`` policy given the round's updates and the global state on ``device``: every tensor of
        them read from the copy kept there (what the fits moved out of it stays there:
        ``trainer.device_state_budget``) or moved there in one copy. The new state — and the round's server update,
        where the policy sets one (:meth:`set_server_update`) — comes back to the host in one copy, device copies kept
        for the next round's fits; what the policy hands back unchanged is the host tensor it stands for. The updates
        the callbacks see stay the host's."""
        assert self.global_state is not None
        hosts: dict[int, Tensor] = {}

        def note(tree: Mapping[str, Tensor] | None) -> None:
            for t in (tree or {}).values():
                if isinstance(t, Tensor):
                    hosts.setdefault(id(t), t)

        note(self.global_state)
        for u in updates:
            note(u.state)
            note(u.masks)
            if u.message is not None:
                note(u.message.tensors)
                note(u.message.masks)
        found = dict(zip(hosts, self.client_store.on_device(list(hosts.values()), device)))

        def there(tree: Mapping[str, Tensor] | None) -> Any:
            return None if tree is None else {n: found.get(id(t), t) for n, t in tree.items()}

        moved = [dataclasses.replace(u, state=there(u.state), masks=there(u.masks), message=None if u.message is None
                                     else dataclasses.replace(u.message, tensors=there(u.message.tensors),
                                                              masks=there(u.message.masks) or {}))
                 for u in updates]
        saved, self.global_state = self.global_state, there(self.global_state)
        try:
            state = self.policy("aggregate", moved)
        finally:
            self.global_state = saved
        # the new state and the round's server update (set_server_update, made there too) to the host in one copy
        server = self.server_update if isinstance(self.server_update, Mapping) else None
        if not isinstance(state, Mapping) and server is None:
            return state
        back = {id(c): hosts[k] for k, c in found.items()}
        trees = [dict(state) if isinstance(state, Mapping) else {}, dict(server or {})]
        slots = [(tree, n) for tree in trees for n, t in tree.items() if isinstance(t, Tensor)]
        hosted = self.client_store.to_host([back.get(id(tree[n]), tree[n]) for tree, n in slots])
        for (tree, n), t in zip(slots, hosted):
            tree[n] = t
        if server is not None:
            self.server_update = trees[1]
        return trees[0] if isinstance(state, Mapping) else state

    def personal_state(self, client_idx: int) -> dict[str, Tensor]:
        """State of the client's personal model (what is evaluated as ``"personal"``); a callback's is checked: every
        entry of the module's state, each of its shape (a partial state would leave the rest of the working module
        as the last client had it)."""
        state = self.policy("personal_state", client_idx)
        owner = self.policy_owner("personal_state")
        if owner is not None:
            problem = _state_mismatch(state, self.initial_state)
            if problem:
                raise UserCodeError(f"{type(owner).__name__}.personal_state returned {problem} (client {client_idx}, "
                                    f"round {self.round_idx}): expected the whole model's state, every entry of "
                                    "module.state_dict() with its shape")
        return state

    def client_masks(self, client_idx: int) -> dict[str, Tensor] | None:
        """The client's current masks (``None``: dense)."""
        return self.policy("client_masks", client_idx)

    def set_server_update(self, update: dict[str, Tensor] | None) -> None:
        """Record the round's aggregated update (:attr:`server_update`; an ``aggregate`` policy that computes one)."""
        self.server_update = update

    def drop_global_model(self) -> None:
        """Declare that the federation has no global model (a callback's ``setup_federation``: local training)."""
        self.global_state = None

    # ------------------------------------------------------------------------------------------------ client work
    def load_state(self, state: Mapping[str, Tensor]) -> None:
        """Load a (full or partial) state dict into the working module, in place."""
        assert self.model is not None
        load_state(self.model, state)

    def fit_request(self, client_idx: int, start: Mapping[str, Tensor], kind: FitKind = "train", *,
                    epochs: int | None = None, lr_round: int | None = None, stream: str | None = None,
                    requester: str | None = None) -> FitRequest:
        """A :class:`~pl_fedsparse.executors.FitRequest` for the current round (seeded by its stream)."""
        r, stream = self.round_idx, stream or kind
        ctx = FitContext(client_idx, r, kind, stream, self.streams.fit_seed(stream, r, client_idx),
                         r if lr_round is None else lr_round, epochs, requester)
        return FitRequest(ctx, start, self.client_store.export_client(client_idx))

    def run_fits(self, requests: Sequence[FitRequest]) -> list[ClientUpdate]:
        """Run fits through the executor, take the clients' state back into the store, book their compute, and
        return the healthy updates (faulty ones are recorded in ``round_faults`` and left out, each with a warning;
        the round's own fits hold their warnings until the round knows it goes on: when every one failed, the run
        stops with one line that counts them)."""
        healthy, warnings = [], []
        for u in self.executor.run(requests):
            u.resolve_pending()  # (an executor that ends its fits without end_fit: the reads put off, made now)
            if u.client_state is not None:
                self.client_store.import_client(u.client_idx, u.client_state)
            self.accounting.book(u)
            if u.fault is None:
                healthy.append(u)
                continue
            if not self.round_faults:
                self._first_fault_detail = f"client {u.client_idx}: {u.fault}: {u.fault_detail}"
            self.round_faults.append({"client": u.client_idx, "kind": u.fault, "fit": u.kind})
            if self.on_client_fault == "raise":
                raise ClientFaultError(f"round {u.round_idx}: client {u.client_idx}'s {u.kind} fit failed "
                                       f"({u.fault}: {u.fault_detail}); trainer.on_client_fault=raise")
            warnings.append((u.round_idx, u.client_idx, u.kind, u.fault, u.fault_detail))
        if self._held_fault_warnings is not None:
            self._held_fault_warnings.extend(warnings)
        else:
            self._warn_faults(warnings)
        return healthy

    @staticmethod
    def _warn_faults(warnings: Sequence[tuple[Any, ...]]) -> None:
        for w in warnings:
            log.warning("round %d: client %d's %s fit failed (%s: %s); it is left out and keeps its previous state",
                        *w)

    def _requested_fits(self, stage: FitStage, updates: Sequence[ClientUpdate]) -> None:
        for cb in self.fed_callbacks:
            with user_code(cb, "fit_requests", f"round {self.round_idx}"):
                specs = cb.fit_requests(self, stage, updates)
            if not specs:
                continue
            requests = []
            for s in specs:
                if s.download is not None:
                    self.accounting.send(SERVER, s.client_idx, s.download)
                requests.append(self.fit_request(s.client_idx, s.start, s.kind, epochs=s.epochs, lr_round=s.lr_round,
                                                 stream=s.stream, requester=cb.state_key))
            done = self.run_fits(requests)
            with user_code(cb, "on_requested_fits_end", f"round {self.round_idx}"):
                cb.on_requested_fits_end(self, stage, done)

    def local_gradients(self, client_idx: int, names: Iterable[str], *, keys: Sequence[int], batches: int = 1,
                        stream: str = "grow", update: ClientUpdate | None = None) -> dict[str, Tensor]:
        """Summed dense gradients of ``names`` at the working module's current weights over ``batches`` shuffled
        batches of the client's training data (shuffled by stream ``stream`` at ``keys``); one dense
        forward+backward per sample is charged to the client (and to ``update``)."""
        assert self.model is not None
        loader = self.datamodule.train_loader(client_idx, seed=self.streams.seed(stream, *keys))
        grads, seen = local_gradients(self.model, loader, names, self.device, batches)
        self.accounting.charge_flops(client_idx, seen * self.accounting.flops_per_sample(), update)
        return grads

    # ------------------------------------------------------------------------------------------------ evaluation
    def predict(self, client_idx: int, split: str = "test", shift: float = 0.0, corruption: str | None = None,
                severity: int = 0) -> tuple[Tensor, Tensor]:
        """CPU logits and labels of the working module on one client's ``split`` data (optionally shifted/corrupted)."""
        return self.evaluator.logits(self.evaluator.loader(client_idx, split, shift, corruption, severity))

    def evaluate(self, split: str | None = None) -> dict[str, Any]:
        """Every client's personal (and the global) model on every view (:class:`~pl_fedsparse.evaluation.Evaluator`)."""
        return self.evaluator.evaluate(split or self.eval_split)

    # ------------------------------------------------------------------------------------------------ a round
    def run_round(self, round_idx: int) -> dict[str, Any]:
        """Run one round and return its metrics row."""
        t0 = time.perf_counter()
        self.round_idx = round_idx
        self.round_faults, self.server_update = [], None
        self.accounting.start_round()
        self.call("on_round_start", round_idx)
        participants = self.select_clients(round_idx)
        requests = []
        for k in participants:
            message = self.client_message(k)
            if message is not None and self.topology.has_server:  # peer methods charge each link themselves
                self.accounting.send(SERVER, k, message)
            if message is not None:
                start = {**self.global_state, **message.tensors} if self.global_state else message.tensors
            else:
                start = self.personal_state(k)
            requests.append(self.fit_request(k, start))
        self._held_fault_warnings = []
        try:
            updates = self.run_fits(requests)
        finally:
            held, self._held_fault_warnings = self._held_fault_warnings, None
        if participants and not updates and self.on_client_fault == "skip":
            kinds: dict[str, int] = {}
            for f in self.round_faults:
                kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
            seen = ", ".join(f"{kind} x{n}" for kind, n in kinds.items())
            raise RunStoppedError(f"round {round_idx}: every participant's fit failed ({seen}; the first: "
                                  f"{self._first_fault_detail}); the run stops with its last checkpoint intact "
                                  "(trainer.on_client_fault: continue goes on without them)")
        self._warn_faults(held)  # the round goes on: each left-out client is named
        for u in updates:
            if u.message is not None and self.topology.has_server:
                self.accounting.send(u.client_idx, SERVER, u.message)
        self.call("on_before_aggregate", updates)
        self._requested_fits("before_aggregate", updates)
        if updates or not participants:
            self.global_state = self.aggregate(updates)
        else:
            log.warning("round %d: every participant's fit failed; the global state is unchanged", round_idx)
        self.call("on_after_aggregate")
        self._requested_fits("after_aggregate", updates)
        t_train = time.perf_counter() - t0
        row: dict[str, Any] = {"round": round_idx}
        evaluated = (round_idx + 1) % self.eval_every == 0 or round_idx == self.num_rounds - 1
        if evaluated:
            ev = self.evaluate()
            self.last_client_acc = ev.pop("client_acc")
            row.update(ev)
        row.update(self.accounting.end_round(len(participants)))
        losses = [u.metrics["train_loss"] for u in updates if u.metrics.get("samples_seen", 1) > 0
                  and "train_loss" in u.metrics]
        row["train_loss"] = float(np.mean(losses)) if losses else None
        logged: dict[str, list[float]] = {}  # what the fits' self.log recorded: each name's mean over the fits
        for u in updates:
            for key, value in u.metrics.items():
                if key.startswith(LOGGED):
                    logged.setdefault(key, []).append(float(value))
        row.update({key: float(np.mean(values)) for key, values in logged.items()})
        row["num_participants"] = len(participants)
        row["client_faults"] = len(self.round_faults)
        if self.round_faults:
            row["client_fault_kinds"] = list(self.round_faults)
        row.update({k: v for k, v in self.executor.round_metrics().items() if v})  # e.g. worker_retries when > 0
        self.call("on_round_end", round_idx, row)
        row["time_train_s"] = t_train
        row["time_s"] = time.perf_counter() - t0
        self.time_cum += row["time_s"]
        row["time_cum_s"] = self.time_cum
        row["evaluated"] = evaluated
        return row

    # ------------------------------------------------------------------------------------------------ entry points
    def fit(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Run the federation (resuming from ``ckpt_path`` when given) and return the final summary."""
        with transfer.host_staging(self.pin_memory):
            return self._fit(model, datamodule, ckpt_path)

    def _fit(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None) -> dict[str, Any]:
        flushing = apply_flush_denormal(self.flush_denormal)
        try:
            self.setup(model, datamodule, ckpt_path, stage="fit")
            self.call("on_federation_start")
            if self.round_idx == 0 and self.checkpoint_every:
                self.save_checkpoint()  # "no round completed yet": a kill from here on is resumable
            rounds = self.reporter.progress(range(self.round_idx, self.num_rounds), "rounds", leave=True)
            for r in rounds:
                started = time.perf_counter()
                row = self.run_round(r)
                self.history.append(row)
                self.reporter.log_row(row)
                self.reporter.round_line(row, time.perf_counter() - started)
                if hasattr(rounds, "set_postfix") and row.get("acc_mean") is not None:
                    rounds.set_postfix(acc=f"{row['acc_mean']:.3f}")
                self.round_idx = r + 1
                if self.checkpoint_every and ((r + 1) % self.checkpoint_every == 0 or r + 1 == self.num_rounds):
                    self.save_checkpoint()
            self.call("on_federation_end")
            if self.checkpoint_every == 0:
                self.save_checkpoint()
            self.executor.teardown()
            return self.reporter.finish()
        finally:
            self.executor.teardown()  # also after an error: out-of-process workers are stopped
            self.reporter.release()
            if flushing:
                torch.set_flush_denormal(False)  # (process-wide: the next fit in this process starts as torch does)

    def validate(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Evaluate every client's personal (and the global) model on its validation split."""
        return self._evaluate_only(model, datamodule, ckpt_path, "val")

    def test(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None) -> dict[str, Any]:
        """Evaluate every client's personal (and the global) model on its test split."""
        return self._evaluate_only(model, datamodule, ckpt_path, "test")

    def _evaluate_only(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None,
                       split: str) -> dict[str, Any]:
        with transfer.host_staging(self.pin_memory):
            return self._evaluate_split(model, datamodule, ckpt_path, split)

    def _evaluate_split(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None,
                        split: str) -> dict[str, Any]:
        if ckpt_path is None:
            log.warning("no --ckpt_path given: evaluating the freshly initialised model")
        try:
            self.setup(model, datamodule, ckpt_path, stage=split)
        finally:
            self.executor.teardown()  # evaluation runs here; no worker is needed
        if split == "val" and sum(datamodule.num_samples(k, "val") for k in range(self.num_clients)) == 0:
            raise ConfigError("data.split_ratios is invalid for validate: expected a non-zero validation share "
                              "(e.g. [0.6, 0.2, 0.2]); use `pl-fed test` to evaluate on the test split")
        ev = self.evaluate(split)
        ev.pop("client_acc")
        out = {"split": split, "round": self.round_idx, "rounds_trained": self.round_idx, **ev}
        print(results_table(out, self.reporter.extra_rows(), title=f"{split} results"))
        return out

    def save_checkpoint(self, path: str | Path | None = None) -> Path:
        """Write everything needed to continue the federation, atomically (by default ``checkpoints/last.ckpt``
        and the round's copy, of which the last ``keep_checkpoints`` are kept)."""
        state = federation_state(self)
        self.contract.check_checkpoint(self, state["callbacks"])  # before writing: what a resume would lose
        return self.reporter.save_checkpoint(state, path)

    # ------------------------------------------------------------------------------------------------ setup
    def setup(self, model: pl.LightningModule, datamodule: Any, ckpt_path: str | None = None, stage: str = "fit") -> None:
        """Set the federation up (data, policies, accounting, client state, checkpoint restore, run directory)
        without running a round; `fit`, `validate` and `test` call it."""
        check(ckpt_path is None or str(ckpt_path).strip() != "", "ckpt_path", ckpt_path,
              "a checkpoint file, or null to start a new run")
        check_datamodule(datamodule)
        model, self._compiled_model = unwrap_compiled(model)  # (compiled when the executor sets up: compiling)
        self.model, self.datamodule = model, datamodule
        datamodule.setup("fit")
        device = self.device  # (first: a one-line error when the accelerator asked for is not there)
        check_environment(self)
        check_compile_callbacks(self.callbacks, self.compile, self._compiled_model)
        self._check_client_data(datamodule)
        self._resolve_policies()
        self.streams = Streams(self.seed)
        self.client_store = ClientStateStore(self.client_state_codec, device_budget(self.device_state_budget, device))
        self.history, self.last_client_acc, self.round_idx, self.time_cum = [], [], 0, 0.0
        with user_code(model, "state_dict", "setting up the federation"):
            self.initial_state = to_cpu_state(model.state_dict())
        self.global_state = dict(self.initial_state) if self.topology.has_server else None
        with quiet_lightning(), user_code(model, "forward", "counting the FLOPs of a training step on a batch of 2, "
                                                            "train mode"):
            self.accounting = Accounting(TrainFlops(model, datamodule.example_input(2)))
        for cb in self.fed_callbacks:
            with user_code(cb, "setup_federation", "setting up the federation"):
                cb.setup_federation(self)
        self.topology.validate(self.num_clients, self.seed)  # before the run directory exists
        self.contract = CallbackContract(self.callback_contract)
        if stage == "fit":
            self.contract.resume.snapshot(self)  # the callbacks as a resume rebuilds them before load_state_dict
        ckpt = load_checkpoint(ckpt_path) if ckpt_path else None
        if ckpt is not None:  # validated before anything is written
            progress = restore_federation(self, ckpt, str(ckpt_path))
            self.round_idx, self.global_state = progress["round_idx"], progress["global_state"]
            self.time_cum, self.history = progress["time_cum"], progress["history"]
            self.last_client_acc = progress["last_client_acc"]
        # every client's declared state exists from here on, created from the initial weights (never lazily)
        self.load_state(self.initial_state)
        self.client_store.materialize(range(self.num_clients))
        self.evaluator.choose_batch_size(device.type)  # what data.eval_batch_size: null is (the evaluator's choice)
        # after every callback declared its state: an out-of-process executor replicates the loop from here
        self.executor.setup(self)
        place = getattr(datamodule, "place_data", None)  # optional: the data where the fits run (data.device: auto);
        fits_here = self.executor.message_device  # only where they run in this process (not Ray's workers)
        if callable(place) and fits_here is not None:
            with user_code(datamodule, "place_data", "placing the data where the fits run"):
                place(fits_here)
        if stage == "fit":
            self.run_dir = self.reporter.open(resuming=ckpt is not None, history=self.history, checkpoint=ckpt,
                                              ckpt_path=ckpt_path)


def _state_mismatch(state: Any, expected: Mapping[str, Tensor]) -> str:
    """What differs between ``state`` and a full state of the model (``""`` when nothing does): not a mapping of
    tensors, entries missing or unknown, a shape.

    Example:
        >>> _state_mismatch({"w": torch.ones(2)}, {"w": torch.ones(2), "b": torch.ones(1)})
        'a state without b'
        >>> _state_mismatch({"w": torch.ones(3), "b": torch.ones(1)}, {"w": torch.ones(2), "b": torch.ones(1)})
        'w of shape (3,) instead of (2,)'
    """
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        return f"a {type(state).__name__} that is not a dict of tensors"
    missing = [k for k in expected if k not in state]
    if missing:
        return f"a state without {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"
    unknown = [k for k in state if k not in expected]
    if unknown:
        return f"entries the model does not have: {', '.join(unknown[:3])}{' ...' if len(unknown) > 3 else ''}"
    for k, t in expected.items():
        if state[k].shape != t.shape:
            return f"{k} of shape {tuple(state[k].shape)} instead of {tuple(t.shape)}"
    return ""
