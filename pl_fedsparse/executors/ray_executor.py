"""Executors that run a round's client fits in other processes: :class:`RayExecutor` (Ray actors, one machine or a
cluster) and the process-independent :class:`FitWorker` every such worker wraps.

The driver (the :class:`~pl_fedsparse.loop.FederatedLoop`) keeps every piece of state and every policy — selection,
messages, aggregation, gossip, the client store, accounting, checkpoints, metrics. Only the fits move:

* **Once per worker** (``RayExecutor.setup``): a replica of the loop without its state — the LightningModule, the
  datamodule, the callbacks, the accounting's FLOP model, the random streams, the declared client-state entries —
  put in Ray's object store once and unpickled by every worker (``worker_spec``).
* **Once per ``run``** (a stage's fits): what callbacks read during a fit from the driver — the callbacks as they are
  now (``DualMask.global_mask``, schedules), the global state, the server update, the round — put in the object
  store once and shared by all of that run's fits (``sync_state``). The start tensors of a request that *are* the
  global state's tensors are not sent again: the request names them and the worker takes them from the synced
  global state.
* **Per fit**: the :class:`~pl_fedsparse.executors.FitRequest` (context, start tensors not in the global state, the
  client's declared state); back comes the :class:`~pl_fedsparse.client.ClientUpdate` with the client's state
  entries that the fit changed. Boolean masks travel bit-packed (:func:`pack_tree`).

Results do not depend on the executor or the number of workers: every fit seeds itself from its
:class:`~pl_fedsparse.context.FitContext` (``InProcessExecutor.run_one`` runs it on the worker, fault handling
included), updates come back in the order of the requests, and the loop books them in that order. Workers run
torch with as many intra-op threads as CPUs they were given (``num_cpus_per_worker``); the in-process run with the
same thread count gives bit-identical metrics (tested; with another thread count, float reductions may be ordered
differently).

Contract for callbacks (``docs/extending.md``): during a fit, a callback writes only the update (message, metrics,
extras, FLOP charges) and its declared client state. Anything else it sets on ``self`` during a fit stays in the
worker; attributes the driver sets between fits (in ``on_round_start``, after aggregation, ...) are shipped.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from pl_fedsparse.allocator import apply_flush_denormal, tune_malloc
from pl_fedsparse.client import ClientStateStore, ClientUpdate
from pl_fedsparse.contract import CallbackContractError
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.evaluation import Evaluator
from pl_fedsparse.executors.base import ClientExecutor, FitRequest
from pl_fedsparse.executors.in_process import InProcessExecutor
from pl_fedsparse.executors.vectorized import VectorizedExecutor

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = ["FitWorker", "RayExecutor", "pack_tree", "sync_state", "tune_malloc", "unpack_tree",
           "worker_spec"]

log = logging.getLogger(__name__)

#: loop attributes a worker never needs (state the driver keeps, or things that cannot travel)
_DRIVER_ONLY = ("executor", "reporter", "history", "last_client_acc", "client_store", "global_state",
                "server_update", "round_faults", "evaluator", "_owners", "callbacks", "config_text")
#: loop attributes shipped with every run (the driver changes them between fits)
_SYNCED = ("round_idx", "global_state", "server_update", "callbacks")


# ------------------------------------------------------------------------------------------------ allocator
# ------------------------------------------------------------------------------------------------ compact tensors
@dataclass
class _Packed:
    """A boolean tensor as bits (``np.packbits``): 1/8 of its bytes on the wire."""

    bits: np.ndarray
    shape: tuple[int, ...]

    def unpack(self) -> Tensor:
        n = int(np.prod(self.shape)) if self.shape else 1
        return torch.from_numpy(np.unpackbits(self.bits, count=n).astype(bool)).reshape(self.shape)


def pack_tree(value: Any) -> Any:
    """``value`` with every boolean tensor (nested in dicts, lists, tuples) bit-packed; :func:`unpack_tree` undoes it.

    Example:
        >>> m = torch.tensor([[True, False, True], [False, False, True]])
        >>> packed = pack_tree({"mask": m, "w": torch.ones(2)})
        >>> bool((unpack_tree(packed)["mask"] == m).all())
        True
    """
    if isinstance(value, Tensor) and value.dtype == torch.bool and value.device.type == "cpu":
        return _Packed(np.packbits(value.contiguous().numpy().reshape(-1)), tuple(value.shape))
    if isinstance(value, dict):
        return {k: pack_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(pack_tree(v) for v in value)
    return value


def unpack_tree(value: Any) -> Any:
    """Inverse of :func:`pack_tree`."""
    if isinstance(value, _Packed):
        return value.unpack()
    if isinstance(value, dict):
        return {k: unpack_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(unpack_tree(v) for v in value)
    return value


@dataclass
class _SparseValues:
    """A message tensor that is zero outside its mask, as the values at the mask's positions."""

    values: Tensor
    shape: tuple[int, ...]


def _sparse_message_tensors(tensors: dict[str, Tensor], masks: Mapping[str, Tensor]) -> dict[str, Any]:
    """Message tensors that are exactly zero outside their (same-name) mask travel as their values at the mask."""
    out: dict[str, Any] = {}
    for name, t in tensors.items():
        m = masks.get(name)
        if (m is not None and m.dtype == torch.bool and m.shape == t.shape and t.device.type == "cpu"
                and not bool(t[~m].any())):  # (a -0.0 off the mask comes back as +0.0: equal as a value)
            out[name] = _SparseValues(t[m], tuple(t.shape))
        else:
            out[name] = t
    return out


def _dense_message_tensors(tensors: dict[str, Any], masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, t in tensors.items():
        if isinstance(t, _SparseValues):
            dense = torch.zeros(t.shape, dtype=t.values.dtype)
            dense[masks[name]] = t.values
            t = dense
        out[name] = t
    return out


def _pack_update(update: ClientUpdate) -> ClientUpdate:
    """Boolean tensors bit-packed; message tensors zero outside their mask as values only (undone exactly by
    :func:`_unpack_update`)."""
    if update.message is not None:
        update.message.tensors = _sparse_message_tensors(update.message.tensors, update.message.masks)
        update.message.masks = pack_tree(update.message.masks)
    update.masks = pack_tree(update.masks)
    update.client_state = pack_tree(update.client_state)
    update.extras = pack_tree(update.extras)
    return update


def _unpack_update(update: ClientUpdate) -> ClientUpdate:
    update.masks = unpack_tree(update.masks)
    update.client_state = unpack_tree(update.client_state)
    update.extras = unpack_tree(update.extras)
    if update.message is not None:
        update.message.masks = unpack_tree(update.message.masks)
        update.message.tensors = _dense_message_tensors(update.message.tensors, update.message.masks)
    return update


# ------------------------------------------------------------------------------------------------ what travels
def worker_spec(loop: FederationView) -> dict[str, Any]:
    """What a worker needs once: the loop's attributes minus the driver's state (:data:`_DRIVER_ONLY`), plus the
    names of the declared client-state entries — not their initialisers: a worker never creates client state, and
    an initialiser's closure usually holds the loop, whose pickle would carry every client's state (at 1,000
    ResNet18 clients resumed from a checkpoint, ~25 GB to every worker)."""
    spec = {k: v for k, v in vars(loop).items() if k not in _DRIVER_ONLY}
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


@dataclass
class _WireRequest:
    """A :class:`~pl_fedsparse.executors.FitRequest` whose start tensors that are the synced global state's tensors
    are sent by name only."""

    request: FitRequest
    from_global: list[str] = field(default_factory=list)


def _to_wire(request: FitRequest, global_state: Mapping[str, Tensor] | None) -> _WireRequest:
    if not global_state:
        return _WireRequest(request)
    shared = [n for n, t in request.start.items() if global_state.get(n) is t]
    if not shared:
        return _WireRequest(request)
    start = {n: t for n, t in request.start.items() if global_state.get(n) is not t}
    return _WireRequest(FitRequest(request.context, start, request.client_state), shared)


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


class _RayFitWorker(FitWorker):
    """The Ray actor: a :class:`FitWorker` that caps its share of a GPU."""

    def __init__(self, spec: Mapping[str, Any], threads: int | None, gpu_fraction: float | None,
                 vectorize: bool = False) -> None:
        if gpu_fraction is not None and torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(min(1.0, float(gpu_fraction)))
        super().__init__(spec, threads, vectorize)


# ------------------------------------------------------------------------------------------------ Ray
def _check_reachable(address: str | None, timeout: float = 5.0) -> None:
    """Refuse a ``host:port`` cluster address nobody listens on, at once (``ray.init`` would retry for minutes)."""
    if address is None or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"trainer.executor.address={address!r} is invalid: expected 'auto', 'host:port', "
                          "'ray://host:port' or null for a local instance")
    import socket

    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise ConfigError(f"trainer.executor.address={address!r} is invalid: expected a reachable Ray cluster "
                          f"(ray start --head on that node), or null for a local one ({e.strerror or e})") from None


#: the address a local Ray instance started by :class:`RayExecutor` binds to
LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Put this process's SIGTERM and SIGINT handlers back after the block: ``ray.init`` installs a native failure
    handler for SIGTERM that dumps a stack trace and aborts (exit -6), which would bypass ``pl-fed``'s clean stop
    (exit 143, the resume command, the workers stopped)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def _start_sentinel(ray: Any) -> subprocess.Popen[bytes] | None:
    """Start ``_ray_sentinel.py`` for the local Ray instance this process just started: when this process dies, even
    by SIGKILL, the pipe to the sentinel closes and it stops the instance's processes (Ray leaves its GCS, raylet and
    agents running otherwise). Linux only (it reads ``/proc``); ``None`` elsewhere or when the session directory is
    unknown."""
    if not os.path.isdir("/proc/self"):
        return None
    try:
        session_dir = ray._private.worker._global_node.get_session_dir_path()
    except AttributeError:
        return None
    from pl_fedsparse import _ray_sentinel  # (its file is run as a script; found by import, wherever it lives)

    script = os.path.abspath(_ray_sentinel.__file__)
    return subprocess.Popen([sys.executable, "-S", script, session_dir], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)


@contextlib.contextmanager
def _loopback_node(local: bool) -> Iterator[None]:
    """While ``ray.init`` starts a local instance: keep its node address on the loopback interface.

    ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough on Linux: Ray replaces a loopback node address
    by the machine's network address (``services.resolve_ip_for_localhost``) unless its single-machine mode is on
    (``ray_constants.ENABLE_RAY_CLUSTER`` false, what ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` sets at import).
    With the node address ``127.0.0.1``, the GCS, the raylet, the workers and the driver bind their servers to
    ``127.0.0.1`` instead of every interface. The flag is read only while the node starts (processes started
    later get the node address from the raylet), so it is switched for the ``ray.init`` call and restored.
    """
    if not local:
        yield
        return
    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray layout: the node address alone
        yield
        return
    missing = object()
    before = getattr(ray_constants, "ENABLE_RAY_CLUSTER", missing)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if before is missing:
            del ray_constants.ENABLE_RAY_CLUSTER
        else:
            ray_constants.ENABLE_RAY_CLUSTER = before


#: Ray's notice, at every ``ray.init`` that starts a local instance, that token authentication is on (its default for
#: local instances since Ray 2.59) and how to turn it off
_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"


class _DropTokenNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_TOKEN_NOTICE)


@contextlib.contextmanager
def _quiet_local_start(local: bool) -> Iterator[None]:
    """While ``ray.init`` starts a local instance: leave out Ray's notice that token authentication is on.

    The notice is about the protection this instance has anyway (on, with a token Ray generates, and the instance
    bound to 127.0.0.1 besides: ``_loopback_node``), and tells the user how to turn it off. Ray prints it only when
    ``RAY_AUTH_MODE`` is unset (its documented switch), but that variable cannot be set here: Ray reads its
    configuration when imported, and a driver that sets ``RAY_AUTH_MODE=token`` afterwards starts an instance that
    rejects the driver itself. So only that one record of Ray's logger is dropped, for the ``ray.init`` call:
    every other warning, and the notice that authentication is *off* (``RAY_AUTH_MODE=disabled``), still shows.
    A cluster given by ``address`` is left as it is.
    """
    if not local:
        yield
        return
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    quiet = _DropTokenNotice()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class RayExecutor(ClientExecutor):
    """Run a stage's fits in parallel on long-lived Ray actors; the driver keeps every piece of state.

    Each actor holds a replica of the module, the callbacks and the datamodule (built once); fits are handed to
    idle actors as they free up (``ray.wait``), the updates are put back in the order of the requests. Results are
    those of the in-process run (see the module docstring for the conditions).

    Args:
        num_workers: Ray actors (processes) running fits.
        num_cpus_per_worker: CPUs Ray reserves per actor; also its torch intra-op threads.
        num_gpus_per_worker: GPUs per actor (fractions share one GPU: several workers per GPU for small,
            launch-bound models); the actor's CUDA memory is capped at this fraction of the device
            (``torch.cuda.set_per_process_memory_fraction``) — Ray's fractional GPUs are only a scheduling label.
        address: a running Ray cluster (``"auto"``, ``"ray://host:10001"``, ``"host:6379"``); ``None`` starts a
            local Ray instance for the run (and stops it at the end), bound to the loopback interface only: its
            GCS, raylet, object manager, workers and the driver listen on ``127.0.0.1``, never on ``0.0.0.0``/``::``,
            so nothing on the network can reach its control plane, and no dashboard is started. Workers on other
            machines need an explicit ``address`` of a cluster started with ``ray start`` and secured with Ray's
            own settings (token authentication, ``RAY_USE_TLS``, a firewall): that cluster is used as it is, this
            executor changes none of its network settings.
        max_retries: a fit whose worker process died is retried on another worker this many times; after that
            the client is reported as faulty (``trainer.on_client_fault``) and the run goes on.
        object_store_memory: bytes for the object store of a local instance (``None``: Ray's default).
        vectorize: each worker trains its share of a stage's fits together
            (:class:`~pl_fedsparse.executors.VectorizedExecutor`): the fits are dealt out as one contiguous chunk per
            worker instead of one at a time; a worker that dies loses (and retries) its whole chunk.

    Example:
        .. code-block:: bash

            pl-fed fit --config quickstart.yaml --trainer.executor pl_fedsparse.executors.RayExecutor \\
                --trainer.executor.num_workers 2
    """

    def __init__(self, num_workers: int = 2, num_cpus_per_worker: float = 1.0, num_gpus_per_worker: float = 0.0,
                 address: str | None = None, max_retries: int = 2, object_store_memory: int | None = None,
                 vectorize: bool = False) -> None:
        check(isinstance(num_workers, int) and num_workers >= 1, "trainer.executor.num_workers", num_workers,
              "an int >= 1")
        check(num_cpus_per_worker > 0, "trainer.executor.num_cpus_per_worker", num_cpus_per_worker, "a number > 0")
        check(0 <= num_gpus_per_worker, "trainer.executor.num_gpus_per_worker", num_gpus_per_worker,
              "a number >= 0 (fractions share a GPU)")
        check(isinstance(max_retries, int) and max_retries >= 0, "trainer.executor.max_retries", max_retries,
              "an int >= 0")
        self.num_workers, self.num_cpus_per_worker = num_workers, float(num_cpus_per_worker)
        self.num_gpus_per_worker, self.address, self.max_retries = float(num_gpus_per_worker), address, max_retries
        self.object_store_memory = object_store_memory
        check(isinstance(vectorize, bool), "trainer.executor.vectorize", vectorize, "true or false")
        self.vectorize = vectorize
        #: how long a restarting worker may take to answer again before the run stops
        self.restart_timeout_s = 600.0
        self.loop: FederationView | None = None
        self.actors: list[Any] = []
        self._started_ray = False
        self._sentinel: subprocess.Popen[bytes] | None = None  # stops our local Ray instance if this process dies
        self._spec_ref: Any = None
        self._sync_key = 0
        self._round_retries = 0
        #: seconds spent starting Ray and the actors (``setup``), for ``benchmarks/ray_speedup.py``
        self.startup_s = 0.0
        #: fits run, seconds the workers spent in them (from request received to update packed), wall seconds of
        #: ``run`` and the sum over fits of (driver-side latency − worker-side seconds): scheduling + transfers
        self.stats: dict[str, float] = {"fits": 0, "worker_fit_s": 0.0, "run_wall_s": 0.0, "fit_overhead_s": 0.0}

    # ---------------------------------------------------------------- life cycle
    def setup(self, loop: FederationView) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError("trainer.executor=RayExecutor is invalid here: expected the ray package "
                              "(pip install 'pl_fedsparse[ray]')") from None
        if self.actors:
            self.teardown()
        t0 = time.perf_counter()
        self.loop = loop
        if self.vectorize:  # what a worker could not vectorise is refused here, once, in one line
            VectorizedExecutor().setup(loop)
        if self.num_gpus_per_worker > 0 and loop.device.type != "cuda":
            raise ConfigError(f"trainer.executor.num_gpus_per_worker={self.num_gpus_per_worker} is invalid: expected "
                              f"0 when trainer.accelerator={loop.accelerator!r} runs on {loop.device.type}")
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                                      "log_to_driver": True, "configure_logging": True}
            if self.address is None:
                if self.object_store_memory is not None:
                    kwargs["object_store_memory"] = int(self.object_store_memory)
                kwargs["num_cpus"] = max(int(np.ceil(self.num_workers * self.num_cpus_per_worker)), 1)
                # loopback only (see `address`); the dashboard stays off, and on loopback if Ray starts it anyway
                kwargs["_node_ip_address"] = LOOPBACK
                kwargs["dashboard_host"] = LOOPBACK
            _check_reachable(self.address)
            try:
                # "local": a fresh instance even if this machine runs a cluster (ray start) the user did not name
                with _loopback_node(self.address is None), _quiet_local_start(self.address is None), \
                        _keep_signal_handlers():
                    ray.init(address=self.address or "local", **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"trainer.executor.address={self.address!r} is invalid: expected a reachable Ray "
                                  f"cluster or null for a local one ({' '.join(str(e).split())[:200]})") from None
            self._started_ray = True
            self._sentinel = _start_sentinel(ray) if self.address is None else None
        threads = max(1, int(self.num_cpus_per_worker))
        gpu_fraction = self.num_gpus_per_worker if 0 < self.num_gpus_per_worker < 1 else None
        actor_cls = ray.remote(num_cpus=self.num_cpus_per_worker, num_gpus=self.num_gpus_per_worker,
                               max_restarts=-1, max_task_retries=0)(_RayFitWorker)
        # kept referenced for the run: a restarted actor is rebuilt from it
        self._spec_ref = spec_ref = ray.put(worker_spec(loop))
        self.actors = [actor_cls.remote(spec_ref, threads, gpu_fraction, self.vectorize)
                       for _ in range(self.num_workers)]
        ray.get([a.ping.remote() for a in self.actors])  # replicas built (errors surface here, once)
        self.startup_s = time.perf_counter() - t0

    def teardown(self) -> None:
        if not self.actors and not self._started_ray:
            return
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors, self._spec_ref = [], None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._started_ray = False
        sentinel, self._sentinel = self._sentinel, None
        if sentinel is not None:  # end of file: it stops what ray.shutdown left, if anything, and exits
            with contextlib.suppress(OSError):
                sentinel.stdin.close()

    def __del__(self) -> None:  # a run that stopped with an error still frees its workers
        try:
            self.teardown()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing left to report to
            pass

    # ---------------------------------------------------------------- fits
    def round_metrics(self) -> dict[str, Any]:
        out = {"worker_retries": self._round_retries}
        self._round_retries = 0
        return out

    def run(self, requests: Sequence[FitRequest]) -> list[ClientUpdate]:
        import ray

        loop = self.loop
        assert loop is not None and self.actors, "RayExecutor.run before setup"
        if not requests:
            return []
        self._sync_key += 1
        key = (id(self), self._sync_key)
        synced = sync_state(loop)
        state_ref = ray.put(synced)
        wires = [_to_wire(r, synced["global_state"]) for r in requests]
        results: list[ClientUpdate | None] = [None] * len(requests)
        retries = [0] * len(requests)

        def failed(i: int, e: Exception) -> bool:
            retries[i] += 1
            self._round_retries += 1
            ctx = requests[i].context
            if retries[i] <= self.max_retries:
                log.warning("round %d: the worker running client %d's %s fit died (%s); retrying (%d/%d)",
                            ctx.round_idx, ctx.client_idx, ctx.kind, type(e).__name__, retries[i], self.max_retries)
                return True
            results[i] = self._lost(requests[i], f"worker died {retries[i]} times ({type(e).__name__})")
            return False

        def done(i: int, value: Any) -> None:
            update, seconds = value
            if isinstance(update, CallbackContractError):  # (trainer.callback_contract: error)
                raise update
            results[i] = _unpack_update(update)
            self.stats["worker_fit_s"] += seconds
            self.stats["fits"] += 1

        t0 = time.perf_counter()
        if self.vectorize:
            self._run_chunks(key, state_ref, wires, results, done, failed)
        else:
            self._dispatch(len(requests), lambda actor, i: actor.run.remote(key, state_ref, wires[i]), done, failed)
        self.stats["run_wall_s"] += time.perf_counter() - t0
        for r, u in zip(requests, results):
            assert u is not None
            if u.client_state is not None and not u.fault:
                u.client_state = {**r.client_state, **u.client_state}
            elif u.fault:
                u.client_state = r.client_state
        return results  # type: ignore[return-value]

    def _run_chunks(self, key: Any, state_ref: Any, wires: list[_WireRequest], results: list[ClientUpdate | None],
                    done: Any, failed: Any) -> None:
        """``vectorize``: one contiguous chunk of the requests per worker, each trained together there; a chunk
        whose worker died is retried whole (its requests' retry counts all go up), its fits lost together."""
        n = len(wires)
        size = -(-n // len(self.actors))
        chunks = [list(range(i, min(n, i + size))) for i in range(0, n, size)]

        def chunk_done(c: int, value: Any) -> None:
            updates, seconds = value
            if isinstance(updates, CallbackContractError):
                raise updates
            for i, update in zip(chunks[c], updates, strict=True):
                done(i, (update, seconds / len(chunks[c])))

        def chunk_failed(c: int, e: Exception) -> bool:
            again = [failed(i, e) for i in chunks[c]]
            return all(again)

        self._dispatch(len(chunks),
                       lambda actor, c: actor.run_many.remote(key, state_ref, [wires[i] for i in chunks[c]]),
                       chunk_done, chunk_failed)

    def forward_clients(self, clients: Sequence[int], split: str, views: Mapping[str, Any], has_global: bool
                        ) -> list[Any] | None:
        """Evaluation's forward passes spread over the workers (contiguous chunks of clients, dealt to idle
        workers), unless a callback keeps state in its evaluation hooks
        (:meth:`~pl_fedsparse.callbacks.base.FederatedCallback.workers_may_evaluate`)."""
        import ray

        loop = self.loop
        if loop is None or not self.actors or not clients:
            return None
        if not all(type(cb).workers_may_evaluate() for cb in loop.fed_callbacks):
            return None
        self._sync_key += 1
        key = (id(self), self._sync_key)
        state_ref = ray.put(sync_state(loop))
        size = max(1, -(-len(clients) // (4 * len(self.actors))))  # ~4 chunks per worker: balance and few calls
        chunks = [list(clients[i:i + size]) for i in range(0, len(clients), size)]
        # each chunk carries only its own clients' state: a worker never holds the whole store (1,000 DisPFL
        # ResNet18 clients are ~25 GB; every worker would deserialise all of it for every evaluation)
        store = loop.client_store.state_dict()
        chunk_refs = [ray.put({k: store.get(k, {}) for k in chunk}) for chunk in chunks]
        results: list[list[Any] | None] = [None] * len(chunks)

        def done(i: int, value: Any) -> None:
            results[i] = value

        self._dispatch(len(chunks), lambda actor, i: actor.forward.remote(key, state_ref, chunks[i], split,
                                                                          dict(views), has_global, chunk_refs[i]),
                       done, lambda i, e: True)  # evaluation has no side effects: run it again (not counted)
        return [out for chunk in results for out in (chunk or [])]

    def _dispatch(self, n: int, submit: Any, done: Any, failed: Any) -> None:
        """Run tasks ``0..n-1``: ``submit(actor, i)`` on idle actors, ``done(i, value)`` with each result. When a
        worker dies, ``failed(i, error)`` says whether to run task ``i`` again (on whichever actor is idle first);
        the dead actor (restarted by Ray) gets work again only once it answers a ping."""
        import ray
        from ray.exceptions import RayActorError, WorkerCrashedError

        queue, idle = list(range(n)), list(self.actors)
        running: dict[Any, tuple[Any, int | None]] = {}  # task index None: a ping of a restarting actor
        pings: dict[int, float] = {}  # when each restarting actor first failed a ping
        submitted: dict[Any, float] = {}
        while queue or any(i is not None for _, i in running.values()):
            while queue and idle:
                task, free = queue.pop(0), idle.pop(0)
                ref = submit(free, task)
                running[ref], submitted[ref] = (free, task), time.perf_counter()
            ready, _ = ray.wait(list(running), num_returns=1)
            actor, i = running.pop(ready[0])
            latency = time.perf_counter() - submitted.pop(ready[0], time.perf_counter())
            try:
                value = ray.get(ready[0])
            except (RayActorError, WorkerCrashedError) as e:
                if i is not None:
                    if failed(i, e):
                        queue.append(i)
                else:  # still restarting: importing torch and rebuilding the replica can take a while on a busy host
                    since = pings.setdefault(id(actor), time.monotonic())
                    if time.monotonic() - since > self.restart_timeout_s:
                        raise RuntimeError(f"a Ray worker did not come back within {self.restart_timeout_s:.0f} s "
                                           f"({type(e).__name__}: {e})") from None
                time.sleep(0.5)
                running[actor.ping.remote()] = (actor, None)  # back to work once restarted
                continue
            pings.pop(id(actor), None)
            idle.append(actor)
            if i is not None:
                if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], float):
                    self.stats["fit_overhead_s"] += latency - value[1]
                done(i, value)

    def _lost(self, request: FitRequest, detail: str) -> ClientUpdate:
        loop = self.loop
        assert loop is not None
        ctx = request.context
        if loop.on_client_fault == "raise":
            from pl_fedsparse.executors.base import ClientFaultError

            raise ClientFaultError(f"round {ctx.round_idx}: client {ctx.client_idx}'s {ctx.kind} fit failed "
                                   f"(worker_lost: {detail}); trainer.on_client_fault=raise")
        return ClientUpdate(client_idx=ctx.client_idx, round_idx=ctx.round_idx,
                            n_samples=int(loop.datamodule.num_samples(ctx.client_idx, "train")), state={},
                            message=None, kind=ctx.kind, context=ctx, client_state=request.client_state,
                            fault="worker_lost", fault_detail=detail)
