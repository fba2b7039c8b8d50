"""A fit worker, independent of the process it runs in (:class:`FitWorker`): a replica of the loop without its state
(:func:`worker_spec`, once per worker), what callbacks read from the driver during a stage's fits (:func:`sync_state`,
once per stage), and the fits themselves, run by the in-process (or vectorised) executor on the worker.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from pl_fedsparse.allocator import apply_flush_denormal, tune_malloc
from pl_fedsparse.client import ClientStateStore, ClientUpdate
from pl_fedsparse.contract import CallbackContractError
from pl_fedsparse.evaluation import Evaluator
from pl_fedsparse.executors.base import FitRequest
from pl_fedsparse.executors.compiling import uncompiled_copy
from pl_fedsparse.executors.in_process import InProcessExecutor
from pl_fedsparse.executors.vectorized import VectorizedExecutor
from pl_fedsparse.executors.wire import _pack_update, _WireRequest
from pl_fedsparse.functional import transfer

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView


__all__ = ["FitWorker", "sync_state", "worker_spec"]


#: loop attributes a worker never needs (state the driver keeps, or things that cannot travel)
_DRIVER_ONLY = ("executor", "reporter", "history", "last_client_acc", "client_store", "global_state",
                "server_update", "round_faults", "evaluator", "_owners", "callbacks", "config_text",
                "_compiled_model")


#: loop attributes shipped with every run (the driver changes them between fits)
_SYNCED = ("round_idx", "global_state", "server_update", "callbacks")


# ------------------------------------------------------------------------------------------------ what travels
def worker_spec(loop: FederationView) -> dict[str, Any]:
    """What a worker needs once: the loop's attributes minus the driver's state (:data:`_DRIVER_ONLY`), plus the
    names of the declared client-state entries — not their initialisers: a worker never creates client state, and
    an initialiser's closure usually holds the loop, whose pickle would carry every client's state (at 1,000
    ResNet18 clients resumed from a checkpoint, ~25 GB to every worker)."""
    spec = {k: v for k, v in vars(loop).items() if k not in _DRIVER_ONLY}
    # uncompiled (compiled methods do not pickle): a worker compiles its own (trainer.compile, when it sets up)
    spec["model"] = uncompiled_copy(spec.get("model"))
    spec["_state_keys"] = loop.client_store.keys
    spec["_loop_class"] = type(loop)  # the worker's replica is one (pickled by reference: nothing here imports it)
    # the driver evaluator's choice of evaluation batch size (what data.eval_batch_size: null is), on every worker
    spec["_eval_batch"] = (loop.evaluator.device_type, loop.evaluator.fixed_batch_size)
    spec["run_dir"] = None
    return spec


def sync_state(loop: FederationView) -> dict[str, Any]:
    """What a worker needs before a stage's fits: the attributes the driver changes between fits (:data:`_SYNCED`),
    in one object so that tensors shared between them stay shared; callbacks without their
    ``driver_only_attributes``."""
    state = {k: getattr(loop, k) for k in _SYNCED}
    state["callbacks"] = [_for_workers(cb) for cb in state["callbacks"]]
    return state


def _for_workers(callback: Any) -> Any:
    drop = [a for a in getattr(callback, "driver_only_attributes", ()) if a in vars(callback)]
    if not drop:
        return callback
    clone = copy.copy(callback)  # shallow: the other attributes are the same objects
    for a in drop:
        setattr(clone, a, None)
    return clone


# ------------------------------------------------------------------------------------------------ the worker
def _created_by_the_driver(client_idx: int) -> Any:
    raise AssertionError("a worker never creates client state: it arrives with the request")  # (the store is sealed)


class FitWorker:
    """Runs fits on a replica of the loop (see the module docstring); the body of every out-of-process worker.

    Args:
        spec: :func:`worker_spec` of the driver's loop.
        threads: torch intra-op threads (``None``: leave torch's default).
    """

    def __init__(self, spec: Mapping[str, Any], threads: int | None = None, vectorize: bool = False) -> None:
        tune_malloc()
        if threads is not None:
            torch.set_num_threads(max(1, int(threads)))
        spec = dict(spec)
        keys = spec.pop("_state_keys")
        loop_class, eval_batch = spec.pop("_loop_class"), spec.pop("_eval_batch")
        loop = loop_class.__new__(loop_class)
        vars(loop).update(spec)
        loop.callbacks, loop.global_state, loop.server_update, loop.round_faults = [], None, None, []
        loop.history, loop.last_client_acc, loop.config_text = [], [], None
        loop.client_store = ClientStateStore(getattr(loop, "client_state_codec", "none"))
        for key in keys:
            loop.client_store.declare(key, _created_by_the_driver)
        loop.client_store._sealed = True  # a worker never creates client state: it arrives with the request
        loop.evaluator = Evaluator(loop, *eval_batch)
        loop._owners = {}
        apply_flush_denormal(getattr(loop, "flush_denormal", False))  # (the driver's trainer.flush_denormal)
        transfer.PIN_MEMORY = bool(getattr(loop, "pin_memory", True))  # (the driver's trainer.pin_memory)
        loop.run_dir = None  # a fit writes nothing (no logger, no checkpoints)
        self.loop = loop
        self.executor: InProcessExecutor | VectorizedExecutor = VectorizedExecutor() if vectorize else InProcessExecutor()
        self.executor.setup(loop)
        self._synced: Any = None

    def sync(self, key: Any, state: Mapping[str, Any]) -> None:
        """Take the driver's state for the coming fits (once per ``key``)."""
        if self._synced == key:
            return
        loop = self.loop
        for k in _SYNCED:
            setattr(loop, k, state[k])
        # a worker holds no client's state between calls: fits bring their own, evaluations their chunk's
        loop.client_store._data = {}
        loop._resolve_policies()
        self._synced = key

    def forward(self, key: Any, state: Mapping[str, Any], clients: Sequence[int], split: str,
                views: Mapping[str, Any], has_global: bool,
                client_state: Mapping[int, Mapping[str, Any]] | None = None) -> list[Any]:
        """Evaluation's forward passes of ``clients`` (:meth:`pl_fedsparse.evaluation.Evaluator.forward`), with
        ``client_state`` the state of exactly those clients (personal models are policies that read it)."""
        self.sync(key, state)
        loop = self.loop
        loop.client_store._data = {int(k): dict(v) for k, v in (client_state or {}).items()}
        try:
            return [loop.evaluator.forward(k, split, dict(views), has_global) for k in clients]
        finally:
            loop.client_store._data = {}

    def run(self, key: Any, state: Mapping[str, Any], wire: _WireRequest
            ) -> tuple[ClientUpdate | CallbackContractError, float]:
        """Run one fit and return its update (boolean tensors bit-packed, only the client-state entries it
        changed) and the seconds it took here; or the callback-contract violation the fit raised."""
        updates, seconds = self.run_many(key, state, [wire])
        return (updates if isinstance(updates, CallbackContractError) else updates[0]), seconds

    def run_many(self, key: Any, state: Mapping[str, Any], wires: Sequence[_WireRequest]
                 ) -> tuple[list[ClientUpdate] | CallbackContractError, float]:
        """Run fits (of different clients) through this worker's executor — together, when it is a
        :class:`~pl_fedsparse.executors.VectorizedExecutor` — and return their updates as :meth:`run` does."""
        self.sync(key, state)
        loop = self.loop
        requests = []
        for wire in wires:
            request = wire.request
            if wire.from_global:
                assert loop.global_state is not None
                start = {**{n: loop.global_state[n] for n in wire.from_global}, **request.start}
                request = FitRequest(request.context, start, request.client_state)
            unknown = [name for name in request.client_state if name not in loop.client_store._inits]
            if unknown:
                raise KeyError(f"client state {unknown} was never declared")
            requests.append(request)
        t0 = time.perf_counter()
        # the requests' entries as they are (the store would copy them): what a fit leaves untouched is not sent back
        for request in requests:
            loop.client_store._data[request.context.client_idx] = dict(request.client_state)
        try:
            updates = self.executor.run(requests)
        except CallbackContractError as e:  # raised again by the driver: one line, not a worker's traceback
            return e, time.perf_counter() - t0
        finally:
            for request in requests:
                loop.client_store._data.pop(request.context.client_idx, None)
        for request, update in zip(requests, updates, strict=True):
            sent = request.client_state
            if update.client_state is not None and update.client_state is not sent:
                update.client_state = {name: v for name, v in update.client_state.items() if sent.get(name) is not v}
        return [_pack_update(u) for u in updates], time.perf_counter() - t0

    def ping(self) -> int:
        """The worker's process id (a cheap call to measure the round trip)."""
        return os.getpid()
