"""D-PSGD's two readings in one run: each client's own model (``acc_mean``) and, with
``Gossip(consensus_eval=True)``, the consensus — the uniform average of all clients' models, what the DisPFL code
reports for D-PSGD (``dpsgd_api.py:85,159-167``) — as ``consensus_acc`` on every evaluated round. The view is
evaluation only (the same training, bytes and FLOPs), survives a resume, runs where an executor's workers run the
forward passes, and equals ``papers/dispfl/consensus_eval.py`` and a by-hand average."""

from __future__ import annotations

import importlib.util
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import TINY_CLI, fit_until_interrupted, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FullyConnected, RandomPeers, Ring
from pl_fedsparse.callbacks import FineTune, Gossip, RandomRegrow
from pl_fedsparse.callbacks.gossip import consensus_state
from pl_fedsparse.errors import UserCodeError
from pl_fedsparse.evaluation import CLEAN, shared_models
from pl_fedsparse.executors import FitWorker, InProcessExecutor, sync_state, worker_spec
from pl_fedsparse.functional import pack_masks, weighted_average
from pl_fedsparse.run.config_diff import config_changes

REPO = Path(__file__).resolve().parents[1]
TIMES = ("time_s", "time_cum_s", "time_train_s")
CONSENSUS = ("consensus_acc", "consensus_acc_weighted", "consensus_f1_macro")


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _without(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in keys} for r in rows]


def _dispfl(consensus_eval: bool) -> list[Any]:
    """DisPFL-like: per-client random masks at density 0.5, regrown every round, sparse gossip."""
    return [RandomRegrow(density=0.5, same_mask=False, mask_personal_eval=False),
            Gossip(consensus_eval=consensus_eval)]


def _dpsgd_ft(consensus_eval: bool) -> list[Any]:
    """D-PSGD-FT: dense gossip, fine-tuning from the consensus every 2 rounds."""
    return [Gossip(consensus_eval=consensus_eval), FineTune(epochs=1, every=2, start="consensus")]


def _by_hand_consensus_acc(loop: Any) -> float:
    """The consensus accuracy computed outside the evaluator: the average with FineTune's kernel
    (``weighted_average``, unit weights), loaded into the module, argmax accuracy per client, unweighted client
    mean over the clients with test data (as ``papers/dispfl/consensus_eval.py`` computed it before the view existed)."""
    states = [loop.personal_state(k) for k in range(loop.num_clients)]
    loop.load_state(weighted_average(states, [1.0] * len(states)))
    accs = []
    for k in range(loop.num_clients):
        logits, labels = loop.predict(k, "test")
        if len(labels):
            accs.append(float((logits.argmax(1) == labels).sum()) / len(labels))
    return sum(accs) / len(accs)


@pytest.mark.parametrize("method", [_dispfl, _dpsgd_ft], ids=["dispfl_masked", "dpsgd_ft"])
def test_the_view_changes_no_training_number_and_is_reported_on_every_evaluated_round(tmp_path: Path,
                                                                                        method: Any) -> None:
    def run(d: str, on: bool) -> Any:
        loop = tiny_loop(tmp_path / d, num_rounds=4, eval_every=2, topology=RandomPeers(k=2),
                         callbacks=method(on), eval_metrics=["f1_macro"])
        loop.fit(tiny_module(), tiny_datamodule())
        return loop

    off, on = run("off", False), run("on", True)
    rows_off, rows_on = _rows(tmp_path / "off"), _rows(tmp_path / "on")
    # accuracies of the personal models, losses, bytes (every link), FLOPs, participants: all identical
    assert _without(rows_on, TIMES + CONSENSUS) == _without(rows_off, TIMES)
    assert [r["evaluated"] for r in rows_on] == [False, True, False, True]
    for r_on, r_off in zip(rows_on, rows_off):
        assert not any(k.startswith("consensus") for k in r_off)
        if r_on["evaluated"]:
            assert all(isinstance(r_on[k], float) and 0.0 <= r_on[k] <= 1.0 for k in CONSENSUS), r_on
        else:
            assert not any(k.startswith("consensus") for k in r_on)
    assert rows_on[-1]["comm_cum_bytes_total"] > 0 and rows_on[-1]["flops_train_cum"] > 0
    for k in range(on.num_clients):  # every client's model and state, bit for bit
        a, b = on.personal_state(k), off.personal_state(k)
        assert all(torch.equal(a[n], b[n]) for n in a)
    assert [g._consensus for g in on.callbacks if isinstance(g, Gossip)] == [None]  # not kept after the evaluation


def test_in_run_consensus_is_the_average_of_the_clients_models(tmp_path: Path) -> None:
    """At every evaluated round the reported consensus accuracy is the by-hand one (of that round's models)."""
    loop = tiny_loop(tmp_path, num_rounds=3, topology=Ring(), callbacks=_dispfl(True))
    seen: list[tuple[float, float]] = []
    real_evaluate = loop.evaluate

    def evaluate(split: str | None = None) -> dict[str, Any]:
        out = real_evaluate(split)
        seen.append((out["consensus_acc"], _by_hand_consensus_acc(loop)))
        return out

    loop.evaluate = evaluate  # type: ignore[method-assign]
    loop.fit(tiny_module(), tiny_datamodule())
    assert len(seen) == 3
    for reported, by_hand in seen:
        assert reported == pytest.approx(by_hand, abs=1e-12)
    # the consensus differs from the personal reading (else this test could not tell them apart)
    assert any(r["consensus_acc"] != r["acc_mean"] for r in loop.history)


def test_consensus_state_is_the_plain_uniform_average_of_the_stored_sparse_models(tmp_path: Path) -> None:
    """Masked clients: each client's stored weights (zero off its mask) averaged over all clients, not normalised per
    coordinate by the masks (that is gossip's rule, DisPFL Alg. 1 line 7) — the DisPFL code's average of models."""
    gossip = Gossip(consensus_eval=True)
    loop = tiny_loop(tmp_path, num_rounds=1, topology=FullyConnected(), callbacks=[gossip])
    loop.setup(tiny_module(), tiny_datamodule(num_clients=3))
    name = next(k for k, v in loop.initial_state.items() if v.ndim == 2)
    shape = loop.initial_state[name].shape
    masks = [torch.zeros(shape, dtype=torch.bool) for _ in range(3)]
    masks[0][0, 0] = masks[1][0, 0] = masks[2][0, 0] = True
    masks[0][0, 1] = masks[1][0, 1] = True
    for j, value in enumerate((1.0, 3.0, 8.0)):
        state = dict(loop.initial_state)
        state[name] = torch.full(shape, value)[masks[j]]  # stored sparse: the values at the mask's positions
        gossip.set_client_state(loop, j, "weights", state)
        gossip.set_client_state(loop, j, "mask", pack_masks({name: masks[j]}))
    c = consensus_state(loop)
    assert c[name][0, 0] == pytest.approx(12 / 3) and c[name][0, 1] == pytest.approx(4 / 3)  # not (1 + 3) / 2
    assert c[name][0, 2] == 0.0 and c[name].shape == shape
    # bit for bit FineTune(start="consensus")'s start (weighted_average with unit weights), without stacking them
    states = [loop.personal_state(k) for k in range(3)]
    ref = weighted_average(states, [1.0, 1.0, 1.0])
    assert c.keys() == ref.keys() and all(torch.equal(c[n], ref[n]) and c[n].dtype == ref[n].dtype for n in ref)
    # the client store is left as it was
    assert torch.equal(gossip.get_client_state(loop, 0, "weights")[name], torch.full(shape, 1.0)[masks[0]])
    assert shared_models(loop)["consensus"] is shared_models(loop)["consensus"]  # one consensus per evaluation
    gossip.on_evaluation_end(loop, {})
    assert gossip._consensus is None


def test_a_resumed_run_reports_the_view_as_an_uninterrupted_one(tmp_path: Path) -> None:
    full = tiny_loop(tmp_path / "full", num_rounds=4, topology=Ring(), callbacks=_dispfl(True))
    full.fit(tiny_module(), tiny_datamodule())
    cut = tiny_loop(tmp_path / "cut", num_rounds=4, topology=Ring(), callbacks=_dispfl(True))
    fit_until_interrupted(cut, 2, tiny_module(), tiny_datamodule())
    resumed = tiny_loop(tmp_path / "cut", num_rounds=4, topology=Ring(), callbacks=_dispfl(True))
    resumed.fit(tiny_module(seed=123), tiny_datamodule(), ckpt_path=str(tmp_path / "cut/checkpoints/last.ckpt"))
    rows = _rows(tmp_path / "cut")
    assert len(rows) == 4 and all("consensus_acc" in r for r in rows)
    assert _without(rows, TIMES) == _without(_rows(tmp_path / "full"), TIMES)


def test_the_view_can_be_switched_on_when_resuming(tmp_path: Path) -> None:
    """A run made without the view, resumed with it: the same training numbers, the view from the resume on."""
    plain = tiny_loop(tmp_path / "plain", num_rounds=4, topology=Ring(), callbacks=_dispfl(False))
    plain.fit(tiny_module(), tiny_datamodule())
    cut = tiny_loop(tmp_path / "cut", num_rounds=4, topology=Ring(), callbacks=_dispfl(False))
    fit_until_interrupted(cut, 2, tiny_module(), tiny_datamodule())
    resumed = tiny_loop(tmp_path / "cut", num_rounds=4, topology=Ring(), callbacks=_dispfl(True))
    resumed.fit(tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / "cut/checkpoints/last.ckpt"))
    rows = _rows(tmp_path / "cut")
    assert ["consensus_acc" in r for r in rows] == [False, False, True, True]
    assert _without(rows, TIMES + CONSENSUS) == _without(_rows(tmp_path / "plain"), TIMES)
    # pl-fed's resume check lets the argument change (an old config has no init_args at all)
    gossip = "pl_fedsparse.callbacks.Gossip"
    old = yaml.safe_dump({"trainer": {"callbacks": [{"class_path": gossip}]}})
    new = yaml.safe_dump({"trainer": {"callbacks": [{"class_path": gossip, "init_args": {"consensus_eval": True}}]}})
    assert config_changes(old, new) == ({"trainer.callbacks.0.init_args.consensus_eval": ["(absent)", True]}, {})


class WorkerForward(InProcessExecutor):
    """Fits in process, evaluation forward passes on a :class:`FitWorker` replica fed as RayExecutor feeds its
    workers (``worker_spec`` once, ``sync_state`` and each chunk's client state per evaluation, all pickled)."""

    def __init__(self) -> None:
        super().__init__()
        self.worker: FitWorker | None = None
        self.calls = 0

    def forward_clients(self, clients, split, views, has_global):  # type: ignore[no-untyped-def]
        loop = self.loop
        assert loop is not None
        if self.worker is None:
            self.worker = FitWorker(pickle.loads(pickle.dumps(worker_spec(loop))))
        self.calls += 1
        store = loop.client_store.state_dict()
        chunk = {k: store.get(k, {}) for k in clients[1:]}  # the worker holds only its chunk's state
        out = self.worker.forward(self.calls, pickle.loads(pickle.dumps(sync_state(loop))), clients[1:], split,
                                  dict(views), has_global, pickle.loads(pickle.dumps(chunk)))
        return [loop.evaluator.forward(clients[0], split, dict(views), has_global), *out]


def test_workers_evaluate_the_consensus_the_driver_built(tmp_path: Path) -> None:
    ref = tiny_loop(tmp_path / "ref", num_rounds=2, topology=Ring(), callbacks=_dispfl(True))
    ref.fit(tiny_module(), tiny_datamodule())
    executor = WorkerForward()
    spread = tiny_loop(tmp_path / "spread", num_rounds=2, topology=Ring(), callbacks=_dispfl(True),
                       executor=executor)
    spread.fit(tiny_module(), tiny_datamodule())
    assert executor.calls == 2
    assert _without(_rows(tmp_path / "spread"), TIMES) == _without(_rows(tmp_path / "ref"), TIMES)
    # a replica without the driver's consensus cannot build one from its chunk: it fails, it does not guess
    gossip = next(cb for cb in spread.callbacks if isinstance(cb, Gossip))
    assert gossip._consensus is None
    worker = executor.worker
    assert worker is not None
    views = {CLEAN.name: CLEAN}
    with pytest.raises(UserCodeError, match="does not exist"):  # the KeyError, behind the user-code wall
        worker.forward(99, pickle.loads(pickle.dumps(sync_state(spread))), [1], "test", views, False,
                       {1: spread.client_store.state_dict()[1]})


def test_benchmark_script_gives_the_runs_own_consensus(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``papers/dispfl/consensus_eval.py`` on a checkpoint = the run's own ``consensus_acc`` at that round."""
    run = tmp_path / "run"
    cfg = tmp_path / "dpsgd.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": {
        "num_rounds": 2, "logger": False, "default_root_dir": str(run),
        "topology": {"class_path": "pl_fedsparse.topology.Ring"},
        "callbacks": [{"class_path": "pl_fedsparse.callbacks.Gossip", "init_args": {"consensus_eval": True}}]}}))
    code, _, err = run_main(["fit", "--config", str(cfg), *TINY_CLI], capsys)
    assert code == 0, err
    last = _rows(run)[-1]
    assert last["round"] == 1 and last["evaluated"]
    spec = importlib.util.spec_from_file_location("consensus_eval", REPO / "papers" / "dispfl" / "consensus_eval.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    out = script.consensus_metrics(run, "last.ckpt", tmp_path)
    assert out["round"] == 2
    assert (out["consensus_acc"], out["consensus_acc_weighted"]) == (last["consensus_acc"],
                                                                     last["consensus_acc_weighted"])
    assert out["acc_mean"] == last["acc_mean"]


def test_configs_and_arguments() -> None:
    for name in ("cifar10_dpsgd", "cifar10_dpsgd_cpu", "cifar10_dpsgd_ft", "cifar10_dpsgd_ft_cpu"):
        cbs = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())["trainer"]["callbacks"]
        gossip = [c for c in cbs if c["class_path"].endswith(".Gossip")]
        assert gossip[0]["init_args"] == {"consensus_eval": True}, name
    for path in (REPO / "configs").glob("*dispfl*.yaml"):  # DisPFL reports personal models: its configs keep it off
        cbs = yaml.safe_load(path.read_text())["trainer"].get("callbacks") or []
        assert not any((c.get("init_args") or {}).get("consensus_eval") for c in cbs
                       if c["class_path"].endswith(".Gossip")), path.name
    with pytest.raises(ConfigError, match="Gossip.consensus_eval='yes' is invalid: expected true or false"):
        Gossip(consensus_eval="yes")  # type: ignore[arg-type]
    assert Gossip().consensus_eval is False and Gossip().state_key == "Gossip"  # checkpoints keep their key
