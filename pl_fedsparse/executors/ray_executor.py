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
import logging
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pl_fedsparse.allocator import tune_malloc
from pl_fedsparse.client import ClientUpdate
from pl_fedsparse.contract import CallbackContractError
from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.executors.base import ClientExecutor, FitRequest
from pl_fedsparse.executors.ray_local import (
    LOOPBACK,
    _check_reachable,
    _keep_signal_handlers,
    _loopback_node,
    _quiet_local_start,
    _start_sentinel,
)
from pl_fedsparse.executors.vectorized import VectorizedExecutor
from pl_fedsparse.executors.wire import _to_wire, _unpack_update, _WireRequest, pack_tree, unpack_tree
from pl_fedsparse.executors.worker import FitWorker, sync_state, worker_spec

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

log = logging.getLogger(__name__)

__all__ = ["FitWorker", "RayExecutor", "pack_tree", "sync_state", "tune_malloc", "unpack_tree", "worker_spec"]


class _RayFitWorker(FitWorker):
    """The Ray actor: a :class:`FitWorker` that caps its share of a GPU."""

    def __init__(self, spec: Mapping[str, Any], threads: int | None, gpu_fraction: float | None,
                 vectorize: bool = False) -> None:
        if gpu_fraction is not None and torch.cuda.is_available():
            torch.cuda.set_per_process_memory_fraction(min(1.0, float(gpu_fraction)))
        super().__init__(spec, threads, vectorize)


def _worker_error(error: Any) -> BaseException:
    """The exception a worker's task raised, out of Ray's :class:`~ray.exceptions.RayTaskError` (whose message holds
    the remote traceback); the Ray error itself when it carries none."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error


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
        if getattr(loop, "_compiled_model", None) is not None:  # (its compiled methods do not pickle)
            raise ConfigError("model=torch.compile(...) is invalid with trainer.executor=RayExecutor: expected the "
                              "module uncompiled and trainer.compile set (each worker compiles its own module)")
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
        if sentinel is not None and sentinel.stdin is not None:  # end of file: it stops what ray.shutdown left, if
            with contextlib.suppress(OSError):  # anything, and exits
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
        from ray.exceptions import RayActorError, RayTaskError, WorkerCrashedError

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
            except RayTaskError as e:
                # the worker raised (trainer.on_client_fault=raise, a contract error, a bug): the worker's exception
                # itself, as in process (its one-line message; Ray's, with both tracebacks, is its cause)
                raise _worker_error(e) from e
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
