"""RayExecutor (issue 13): the same federation on Ray actors as in process, worker deaths retried or skipped.

One local Ray instance (3 CPUs) serves the module. Fits run on one torch thread per worker, so the in-process
reference runs on one thread too (another intra-op thread count orders float reductions differently).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import METHODS, InFitProbe, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import FederatedCallback, FederatedModule
from pl_fedsparse.callbacks import Gossip, PFedGate, SparseMask
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.executors import FitWorker, RayExecutor, pack_tree, tune_malloc, unpack_tree, worker_spec
from pl_fedsparse.functional import floatcodec
from pl_fedsparse.models import MLP

ray = pytest.importorskip("ray")
cloudpickle = pytest.importorskip("ray.cloudpickle")
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

IGNORED = ("time_s", "time_cum_s", "time_train_s", "worker_retries")


@pytest.fixture(scope="module")
def ray_session() -> Iterator[None]:
    ray.init(address="local", num_cpus=3, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _history(tmp_path: Path, make: Any, executor: Any = None, topology: Any = None, **kw: Any) -> list[dict]:
    loop = tiny_loop(tmp_path, callbacks=make(), executor=executor, topology=topology, **kw)
    loop.fit(tiny_module(), tiny_datamodule())
    return _rows(loop)


def _rows(loop: Any) -> list[dict]:
    """The run's history without what may differ between executors (times, retries)."""
    return [{k: v for k, v in row.items() if k not in IGNORED} for row in loop.history]


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.slow
def test_ray_gives_the_in_process_metrics(tmp_path: Path, method: str, ray_session: None, one_thread: None) -> None:
    make, topo = METHODS[method]
    kw = {"num_rounds": 4 if method == "dmpfl" else 3}
    ref = _history(tmp_path / "ref", make, topology=topo() if topo else None, **kw)
    workers = {"fedspa": [1, 3]}.get(method, [2])
    for w in workers:
        got = _history(tmp_path / f"ray{w}", make, RayExecutor(num_workers=w), topo() if topo else None, **kw)
        assert got == ref, (method, w)


@pytest.mark.parametrize("method", ["fedavg_ft", "dispfl", "ditto_masked"])
@pytest.mark.slow
def test_vectorized_workers_give_the_in_process_metrics(tmp_path: Path, method: str, ray_session: None,
                                                        one_thread: None) -> None:
    from test_vectorized import assert_same_run

    make, topo = METHODS[method]
    ref = _history(tmp_path / "ref", make, topology=topo() if topo else None, num_rounds=3)
    got = _history(tmp_path / "ray", make, RayExecutor(num_workers=2, vectorize=True), topo() if topo else None,
                   num_rounds=3)
    assert_same_run(ref, got)


def test_vectorized_workers_refuse_what_they_cannot_vectorise_before_starting(tmp_path: Path,
                                                                              ray_session: None) -> None:
    loop = tiny_loop(tmp_path, callbacks=[InFitProbe()], executor=RayExecutor(num_workers=1, vectorize=True))
    with pytest.raises(ConfigError, match=r"InFitProbe has in-fit hooks"):
        loop.fit(tiny_module(), tiny_datamodule())


@pytest.mark.slow
def test_pfedgate_stacked_on_a_worker_gives_the_in_process_run(tmp_path: Path, ray_session: None,
                                                               one_thread: None) -> None:
    """pFedGate's stacked form on a Ray worker (``vectorize: true``): clients of different sizes, kept momenta."""
    from test_vectorized import assert_same_run

    rows = []
    for name, executor in [("ref", None), ("ray", RayExecutor(num_workers=1, vectorize=True))]:
        loop = tiny_loop(tmp_path / name, callbacks=METHODS["pfedgate"][0](), executor=executor, num_rounds=3)
        loop.fit(tiny_module(momentum=0.9), tiny_datamodule(alpha=0.1, quantity_skew=True, batch_size=7))
        rows.append(_rows(loop))
    assert_same_run(*rows)


@pytest.mark.slow
def test_lossless_client_state_travels_encoded_and_gives_the_same_run(tmp_path: Path, ray_session: None,
                                                                     one_thread: None) -> None:
    # a hidden layer of 64 x 256 weights (~8,000 kept at density 0.5): above floatcodec.MIN_NUMEL, so the driver
    # and the workers both encode
    make, topology = METHODS["dispfl"]
    histories, stores = [], []
    for name, codec, executor in [("ref", "none", None), ("ray", "lossless", RayExecutor(num_workers=2))]:
        torch.manual_seed(0)
        module = FederatedModule(MLP(num_classes=4, in_channels=1, input_size=8, hidden=[256]), lr=0.1)
        loop = tiny_loop(tmp_path / name, callbacks=make(), topology=topology(), executor=executor,
                         client_state_codec=codec)
        loop.fit(module, tiny_datamodule())
        histories.append(_rows(loop))
        stores.append(loop.client_store)
    assert histories[1] == histories[0]
    held = stores[1].export_client(0)["Gossip/weights"]["backbone.layers.0.weight"]
    assert floatcodec.is_encoded(held)
    assert stores[1].nbytes() < stores[0].nbytes()
    assert torch.equal(stores[1].get(0, "Gossip/weights")["backbone.layers.0.weight"],
                       stores[0].get(0, "Gossip/weights")["backbone.layers.0.weight"])


def test_what_workers_receive_carries_no_client_state(tmp_path: Path) -> None:
    # the initialisers' closures hold the loop, Gossip's round snapshot holds every client's model: sending either
    # would send every client's state to every worker (once per run, once per stage)
    from pl_fedsparse.executors import sync_state

    make, topology = METHODS["dispfl"]
    loop = tiny_loop(tmp_path, callbacks=make(), topology=topology())
    loop.setup(tiny_module(), tiny_datamodule(), stage="validate")
    gossip = next(cb for cb in loop.callbacks if isinstance(cb, Gossip))
    gossip.on_round_start(loop, 0)
    small = len(cloudpickle.dumps(worker_spec(loop))), len(cloudpickle.dumps(sync_state(loop)))
    big = {n: torch.randn(250_000) for n in ("a", "b", "c", "d")}  # 4 MB for each client
    for k in range(loop.num_clients):
        loop.client_store.set(k, "Gossip/weights", big)
    gossip.on_round_start(loop, 1)
    assert len(cloudpickle.dumps(worker_spec(loop))) == small[0] < 1_000_000
    assert len(cloudpickle.dumps(sync_state(loop))) == small[1] < 1_000_000
    assert len(cloudpickle.dumps(gossip)) > 4_000_000  # (what the sync used to carry)
    assert gossip._snapshot  # the driver's callback keeps its snapshot


class DieOnce(FederatedCallback):
    """Kills the worker process running ``client``'s fit in ``round`` (``times`` times, counted in ``marker``)."""

    def __init__(self, marker: str, client: int = 1, round: int = 1, times: int = 1) -> None:
        self.marker, self.client, self.round, self.times = marker, client, round, times

    def on_client_fit_start(self, loop: Any, module: Any, context: Any) -> None:
        if (context.client_idx, context.round_idx) != (self.client, self.round):
            return
        n = int(Path(self.marker).read_text()) if os.path.exists(self.marker) else 0
        if n < self.times:
            Path(self.marker).write_text(str(n + 1))
            os._exit(1)


@pytest.mark.slow
def test_a_dead_worker_is_retried_and_the_run_is_unchanged(tmp_path: Path, ray_session: None,
                                                           one_thread: None) -> None:
    make = METHODS["fedspa"][0]
    ref = _history(tmp_path / "ref", make)
    marker = str(tmp_path / "deaths")
    loop = tiny_loop(tmp_path / "ray", callbacks=[*make(), DieOnce(marker)], executor=RayExecutor(num_workers=2))
    loop.fit(tiny_module(), tiny_datamodule())
    assert Path(marker).read_text() == "1"
    assert [r.get("worker_retries", 0) for r in loop.history] == [0, 1]
    assert _rows(loop) == ref


@pytest.mark.slow
def test_a_client_whose_worker_keeps_dying_is_skipped(tmp_path: Path, ray_session: None) -> None:
    marker = str(tmp_path / "deaths")
    loop = tiny_loop(tmp_path, callbacks=[DieOnce(marker, times=10)],
                     executor=RayExecutor(num_workers=2, max_retries=1))
    loop.fit(tiny_module(), tiny_datamodule())
    row = loop.history[1]
    assert row["worker_retries"] == 2 and row["client_faults"] == 1
    assert row["client_fault_kinds"] == [{"client": 1, "kind": "worker_lost", "fit": "train"}]
    assert all(torch.isfinite(t).all() for t in loop.global_state.values())  # type: ignore[union-attr]


def test_fit_worker_runs_a_request_like_the_loop(tmp_path: Path, one_thread: None) -> None:
    """The worker body without Ray: a replica built from worker_spec gives the in-process update."""
    loop = tiny_loop(tmp_path, callbacks=[SparseMask(density=0.5)])
    loop.setup(tiny_module(), tiny_datamodule())
    worker = FitWorker(cloudpickle.loads(cloudpickle.dumps(worker_spec(loop))), threads=1)
    request = loop.fit_request(0, dict(loop.global_state))  # type: ignore[arg-type]
    from pl_fedsparse.executors.wire import _to_wire, _unpack_update
    from pl_fedsparse.executors.worker import sync_state

    remote = _unpack_update(worker.run(1, cloudpickle.loads(cloudpickle.dumps(sync_state(loop))),
                                       _to_wire(request, loop.global_state))[0])
    local = loop.executor.run([request])[0]
    assert remote.state.keys() == local.state.keys()
    assert all(torch.equal(remote.state[k], local.state[k]) for k in local.state)
    assert remote.flop_charges == local.flop_charges


def test_pack_tree_round_trip() -> None:
    m = torch.rand(3, 5, 7) > 0.5
    tree = {"a": {"m": m, "w": torch.ones(2)}, "b": [m[0], 3]}
    back = unpack_tree(pack_tree(tree))
    assert torch.equal(back["a"]["m"], m) and torch.equal(back["b"][0], m[0]) and back["b"][1] == 3
    assert pack_tree(m).bits.nbytes == (m.numel() + 7) // 8


@pytest.mark.parametrize(("kw", "match"), [
    ({"num_workers": 0}, "trainer.executor.num_workers=0 is invalid"),
    ({"num_cpus_per_worker": 0}, "trainer.executor.num_cpus_per_worker=0 is invalid"),
    ({"max_retries": -1}, "trainer.executor.max_retries=-1 is invalid"),
])
def test_bad_arguments(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RayExecutor(**kw)


def test_gpus_on_a_cpu_run_are_refused(tmp_path: Path, ray_session: None) -> None:
    loop = tiny_loop(tmp_path, executor=RayExecutor(num_workers=1, num_gpus_per_worker=0.5))
    with pytest.raises(ConfigError, match="num_gpus_per_worker=0.5 is invalid"):
        loop.fit(tiny_module(), tiny_datamodule())


def test_tune_malloc_respects_the_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_FEDSPARSE_MALLOC_TUNING", "0")
    assert tune_malloc() is False
    monkeypatch.setenv("PL_FEDSPARSE_MALLOC_TUNING", "1")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1")
    assert tune_malloc() is False


@pytest.mark.slow
def test_evaluation_runs_in_the_workers_unless_a_callback_keeps_evaluation_state(tmp_path: Path, ray_session: None,
                                                                                  one_thread: None) -> None:
    for j, (make, spread) in enumerate([(lambda: [SparseMask(density=0.5)], True),
                                        (lambda: [PFedGate(density=0.5)], False)]):
        ref = tiny_loop(tmp_path / f"ref{j}", callbacks=make())
        ref.setup(tiny_module(), tiny_datamodule())
        expected = ref.evaluate()
        ref.reporter.release()
        loop = tiny_loop(tmp_path / f"ray{j}", callbacks=make(), executor=RayExecutor(num_workers=2))
        loop.setup(tiny_module(), tiny_datamodule())
        try:
            views = loop.evaluator.views()
            assert (loop.executor.forward_clients([0, 1], "test", views, True) is not None) is spread
            assert loop.evaluate() == expected
        finally:
            loop.executor.teardown()
            loop.reporter.release()


class StoreWitness(FederatedCallback):
    """Appends, at each personal evaluation, ``pid client clients-in-the-store`` to ``path`` (evaluation stays
    spreadable: no ``on_client_evaluate_end`` override)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_client_evaluate_start(self, loop: Any, module: Any, client_idx: int, kind: str) -> None:
        if kind == "personal":
            held = ",".join(str(k) for k in sorted(loop.client_store._data))
            with open(self.path, "a") as fh:
                fh.write(f"{os.getpid()} {client_idx} {held}\n")


@pytest.mark.slow
def test_an_evaluation_chunk_carries_only_its_clients_state(tmp_path: Path, ray_session: None,
                                                           one_thread: None) -> None:
    # a worker evaluating clients [a, b] holds exactly their state, never the whole store (1,000 clients ≈ 25 GB)
    witness = str(tmp_path / "witness")
    make, topology = METHODS["dispfl"]
    ref = _history(tmp_path / "ref", make, topology=topology())
    loop = tiny_loop(tmp_path / "ray", callbacks=[*make(), StoreWitness(witness)], topology=topology(),
                     executor=RayExecutor(num_workers=2))
    loop.fit(tiny_module(), tiny_datamodule())
    assert _rows(loop) == ref
    lines = [line.split() for line in Path(witness).read_text().splitlines()]
    assert lines and all(int(pid) != os.getpid() for pid, _, _ in lines)  # evaluated in the workers
    n = loop.num_clients
    size = -(-n // 8)  # the executor's chunks: ~4 per worker
    for _, client, held in lines:
        clients = [int(k) for k in held.split(",")]
        assert int(client) in clients and len(clients) <= size < n, (client, clients)


def test_an_unreachable_cluster_is_one_line_at_once() -> None:
    from pl_fedsparse.executors.ray_local import _check_reachable

    with pytest.raises(ConfigError, match=r"trainer.executor.address='127.0.0.1:1' is invalid: expected a reachable"):
        _check_reachable("127.0.0.1:1")
    with pytest.raises(ConfigError, match="expected 'auto', 'host:port'"):
        _check_reachable("host:port")
    _check_reachable("auto")  # resolved by Ray itself


def test_packed_updates_round_trip_exactly() -> None:
    from pl_fedsparse.client import ClientUpdate, Message
    from pl_fedsparse.executors.wire import _pack_update, _SparseValues, _unpack_update

    m = torch.rand(4, 6) > 0.5
    sparse = torch.randn(4, 6) * m  # zero outside its mask: travels as values
    dense = torch.randn(4, 6)  # not zero outside its mask: travels dense
    msg = Message({"a": sparse.clone(), "b": dense.clone(), "c": torch.ones(3)}, {"a": m, "b": m})
    u = ClientUpdate(0, 0, 1, {"a": sparse}, message=msg, masks={"a": m}, client_state={"cb/mask": m})
    packed = cloudpickle.loads(cloudpickle.dumps(_pack_update(u)))
    assert isinstance(packed.message.tensors["a"], _SparseValues)
    assert not isinstance(packed.message.tensors["b"], _SparseValues)
    back = _unpack_update(packed)
    assert torch.equal(back.message.tensors["a"], sparse) and torch.equal(back.message.tensors["b"], dense)
    assert torch.equal(back.message.masks["a"], m) and torch.equal(back.masks["a"], m)
    assert torch.equal(back.client_state["cb/mask"], m) and torch.equal(back.message.tensors["c"], torch.ones(3))


def test_a_worker_flushes_subnormals_when_the_driver_does(tmp_path: Path, one_thread: None) -> None:
    """trainer.flush_denormal reaches out-of-process workers: a replica built from worker_spec sets it in its own
    process (Ray actors are other processes, where the driver's setting does not reach)."""
    loop = tiny_loop(tmp_path, flush_denormal=True)
    loop.setup(tiny_module(), tiny_datamodule())
    try:
        FitWorker(cloudpickle.loads(cloudpickle.dumps(worker_spec(loop))), threads=1)
        assert float(torch.tensor([1e-39], dtype=torch.float32).mul(1.0)) == 0.0
    finally:
        torch.set_flush_denormal(False)
    FitWorker(cloudpickle.loads(cloudpickle.dumps(worker_spec(tiny_loop(tmp_path / "off")))), threads=1)
    assert float(torch.tensor([1e-39], dtype=torch.float32).mul(1.0)) != 0.0


@pytest.mark.slow
def test_on_client_fault_raise_stops_with_the_worker_s_one_line_error(tmp_path: Path, ray_session: None) -> None:
    """A fit that fails on a worker under ``on_client_fault=raise``: the run stops with the error the in-process run
    raises (one line, the client and the cause named), not Ray's task error with two tracebacks in its message."""
    from ray.exceptions import RayTaskError

    from pl_fedsparse.executors import ClientFaultError
    from pl_fedsparse.testing import FaultInjection

    loop = tiny_loop(tmp_path, num_rounds=2, on_client_fault="raise", executor=RayExecutor(num_workers=1),
                     callbacks=[FaultInjection(client=1, rounds=[0], kind="exception")])
    with pytest.raises(ClientFaultError) as stopped:
        loop.fit(tiny_module(), tiny_datamodule())
    assert type(stopped.value) is ClientFaultError and "\n" not in str(stopped.value)
    assert "client 1's train fit failed" in str(stopped.value) and "injected fault in client 1" in str(stopped.value)
    assert isinstance(stopped.value.__cause__, RayTaskError)  # (PL_FED_DEBUG=1 prints it: both tracebacks)
