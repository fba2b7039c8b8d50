"""A model shared by every client (the global model, FedAvg's personal model, D-PSGD's consensus) is evaluated on all
clients' rows of a view as one stream of large batches: the same metrics as one short run per client, fewer forward
calls, the evaluation hooks as documented, and never where a callback's ``on_client_evaluate_start`` depends on the
client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import RandomPeers
from pl_fedsparse.callbacks import AdaptiveInference, DualMask, FederatedCallback, FineTune, Gossip, ShiftEvaluation
from pl_fedsparse.data.loaders import TensorBatchLoader
from pl_fedsparse.evaluation import Evaluator, merge_loaders

TIMES = ("time_s", "time_cum_s", "time_train_s")


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMES} for r in rows]


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """The same rows, every float to 1e-6 (relative): with several threads a matrix kernel may split another batch
    size differently, which moves the last bits of a logit; a sample in the wrong client's slice moves far more."""
    if len(a) != len(b) or any(x.keys() != y.keys() for x, y in zip(a, b)):
        return False
    return all(x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9) if isinstance(x[k], float) else x[k] == y[k]
               for x, y in zip(a, b) for k in x)


def _fedavg() -> list[Any]:
    return [ShiftEvaluation(shifts=[0.0, 0.5, 1.0], corruptions=["contrast"], severities=[3], when="every")]


def _dmpfl_plus() -> list[Any]:
    return [DualMask(density=0.5, iterations=1), AdaptiveInference(),
            ShiftEvaluation(shifts=[0.0, 0.5, 1.0], corruptions=["contrast"], severities=[3], when="every")]


def _dpsgd_consensus() -> list[Any]:
    return [Gossip(consensus_eval=True)]


def _fedavg_ft() -> list[Any]:  # the personal kind depends on the client, the global one does not
    return [FineTune(epochs=1), ShiftEvaluation(shifts=[0.0, 1.0], corruptions=[], when="every")]


METHODS = {"fedavg": (_fedavg, {}), "dmpfl_plus": (_dmpfl_plus, {}),
           "dpsgd_consensus": (_dpsgd_consensus, {"topology": RandomPeers(k=2)}), "fedavg_ft": (_fedavg_ft, {})}


def _unequal_clients() -> Any:
    """5 clients with test sets of different sizes (32, 12, 14, 8, 35 rows): a slice in the wrong place shows."""
    return tiny_datamodule(num_clients=5, test_mode="split", split_ratios=[0.75, 0.0, 0.25], quantity_skew=True)


def _count_forward_calls(monkeypatch: pytest.MonkeyPatch, stream: bool) -> dict[str, int]:
    """Set ``Evaluator.stream_shared`` and count ``Evaluator.logits`` calls (one per forward run over a loader)."""
    monkeypatch.setattr(Evaluator, "stream_shared", stream)
    calls = {"n": 0}
    real = Evaluator.logits

    def counting(self: Evaluator, loader: Any, where: str = "") -> Any:
        calls["n"] += 1
        return real(self, loader, where)

    monkeypatch.setattr(Evaluator, "logits", counting)
    return calls


def _run(tmp_path: Path, name: str, stream: bool, monkeypatch: pytest.MonkeyPatch, method: str,
         callbacks: list[Any] | None = None) -> tuple[list[dict[str, Any]], int]:
    make, kw = METHODS[method]
    calls = _count_forward_calls(monkeypatch, stream)
    loop = tiny_loop(tmp_path / name, num_rounds=2, eval_every=1, callbacks=(callbacks or []) + make(),
                     eval_metrics=["f1_macro", "ece"], **kw)
    loop.fit(tiny_module(), _unequal_clients())
    return _rows(tmp_path / name), calls["n"]


@pytest.mark.parametrize("method", list(METHODS))
def test_one_stream_gives_the_per_client_metrics_with_fewer_forward_calls(tmp_path: Path, method: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    per_client, calls_per_client = _run(tmp_path, "off", False, monkeypatch, method)
    streamed, calls_streamed = _run(tmp_path, "on", True, monkeypatch, method)
    assert _same(streamed, per_client)  # every metric of every round
    assert calls_streamed < calls_per_client


class _ClientNoise(FederatedCallback):
    """Moves the global model by an amount that depends on the client: its start hook is not shared."""

    def on_client_evaluate_start(self, loop: Any, module: Any, client_idx: int, kind: str) -> None:
        if kind == "global":
            with torch.no_grad():
                for p in module.parameters():
                    p.add_(0.05 * (client_idx + 1))


def test_a_start_hook_that_depends_on_the_client_keeps_the_per_client_evaluation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    per_client, calls_off = _run(tmp_path, "off", False, monkeypatch, "fedavg", [_ClientNoise()])
    streamed, calls_on = _run(tmp_path, "on", True, monkeypatch, "fedavg", [_ClientNoise()])
    assert _same(streamed, per_client) and calls_on == calls_off  # not streamed at all
    assert per_client[-1]["global_acc"] != per_client[-1]["acc_mean"]  # the hook did change the global model


class _Counter(FederatedCallback):
    scratch_attributes = ("starts", "ends")  # what the test reads, nothing a resume needs

    def __init__(self) -> None:
        self.starts: list[tuple[int, str]] = []
        self.ends: list[tuple[int, str, float]] = []

    def evaluation_start_is_shared(self, loop: Any, kind: str) -> bool:
        return True  # it only counts

    def on_client_evaluate_start(self, loop: Any, module: Any, client_idx: int, kind: str) -> None:
        self.starts.append((client_idx, kind))

    def on_client_evaluate_end(self, loop: Any, module: Any, client_idx: int, kind: str,
                               metrics: dict[str, float]) -> None:
        self.ends.append((client_idx, kind, metrics["n"]))


def test_hooks_fire_once_per_stream_and_end_once_per_client_with_its_own_metrics(tmp_path: Path) -> None:
    counter = _Counter()
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[counter])
    dm = _unequal_clients()
    loop.fit(tiny_module(), dm)
    # FedAvg, clean view only: one stream per kind, both with the first client
    assert counter.starts == [(0, "personal"), (0, "global")]
    assert sorted(counter.ends) == sorted((k, kind, float(len(dm.client_indices(k, "test"))))
                                          for k in range(5) for kind in ("personal", "global"))


def test_merge_loaders_refuses_what_is_not_one_stream() -> None:
    x, y = torch.arange(8, dtype=torch.uint8).view(8, 1, 1, 1), torch.arange(8)

    def loader(idx: list[int] | None, images: torch.Tensor = x, **kw: Any) -> TensorBatchLoader:
        args: dict[str, Any] = {"shuffle": False, "generator_seed": 0, "mean": [0], "std": [1]}
        args.update(kw)
        return TensorBatchLoader(images, y, 3, indices=None if idx is None else torch.tensor(idx), **args)

    merged = merge_loaders([loader([7, 1]), loader([2]), loader([])])
    assert merged is not None and [yb.tolist() for _, yb in merged] == [[7, 1, 2]]
    assert merge_loaders([loader([0]), loader([1], images=x.clone())]) is None  # other inputs
    assert merge_loaders([loader([0]), loader([1], mean=[0.5])]) is None  # normalised otherwise
    assert merge_loaders([loader([0]), loader([1], shuffle=True)]) is None
    assert merge_loaders([loader([0]), loader(None)]) is None  # its own tensor, no rows to select
    assert merge_loaders([loader([0]), [(x, y)]]) is None  # not a TensorBatchLoader
    assert merge_loaders([]) is None


@pytest.mark.slow
def test_the_default_eval_batch_is_chosen_for_the_device_and_changes_no_metric(tmp_path: Path) -> None:
    rows = {}
    for size in (None, 512, 7):
        loop = tiny_loop(tmp_path / str(size), num_rounds=2, eval_every=1, callbacks=_fedavg(),
                         eval_metrics=["f1_macro", "ece"])
        dm = _unequal_clients()
        dm.eval_batch_size = size
        loop.fit(tiny_module(), dm)
        assert loop.evaluator.device_type == "cpu" and loop.evaluator.batch_size() == (128 if size is None else size)
        assert not {"eval_device", "eval_batch_fixed"} & set(vars(dm))  # the evaluator's choice, not the data's
        rows[size] = _rows(tmp_path / str(size))
    assert _same(rows[None], rows[512]) and _same(rows[None], rows[7])


class _BatchCentred(torch.nn.Module):
    """Logits minus their batch mean in eval mode too: a sample's output depends on the rest of its batch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        return out - out.mean(0, keepdim=True)


def test_a_module_mixing_the_samples_of_a_batch_is_never_streamed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from pl_fedsparse import FederatedModule

    def run(name: str, stream: bool) -> tuple[list[dict[str, Any]], int]:
        calls = _count_forward_calls(monkeypatch, stream)
        torch.manual_seed(0)
        loop = tiny_loop(tmp_path / name, num_rounds=1, callbacks=_fedavg())
        loop.fit(FederatedModule(_BatchCentred(), lr=0.1), _unequal_clients())
        return _rows(tmp_path / name), calls["n"]

    with caplog.at_level("WARNING"):
        on, calls_on = run("on", True)
    off, calls_off = run("off", False)
    assert _same(on, off) and calls_on == calls_off
    assert any("mixes the samples of a batch" in r.getMessage() for r in caplog.records)


def test_a_model_whose_logits_are_nan_is_not_taken_for_one_mixing_samples(tmp_path: Path) -> None:
    """NaN logits (a diverged model) are NaN one by one as together: the evaluation says nothing about mixing."""
    from pl_fedsparse import FederatedModule
    from pl_fedsparse.evaluation import Evaluator

    class NanLogits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x) * float("nan")

    loop = tiny_loop(tmp_path, num_rounds=1)
    loop.setup(FederatedModule(NanLogits(), lr=0.1), tiny_datamodule())
    assert Evaluator(loop).samples_independent()
    loop.reporter.release()


def test_an_evaluation_that_depends_on_the_batch_keeps_one_batch_size_on_every_device(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``eval_batch_size: null`` is the device's throughput choice (128 CPU, 512 GPU) only where predictions do not
    depend on the batch; pFedGate's per-batch mask and a module mixing samples get ``data.batch_size`` everywhere."""
    from pl_fedsparse import FederatedModule
    from pl_fedsparse.callbacks import PFedGate

    def sizes(name: str, callbacks: list[Any], module: Any, eval_batch_size: int | None = None) -> tuple[int, int]:
        dm = tiny_datamodule()
        dm.eval_batch_size = eval_batch_size
        dm.setup("fit")
        before = dict(vars(dm))
        loop = tiny_loop(tmp_path / name, callbacks=callbacks)
        loop.setup(module, dm)
        assert loop.evaluator.loader(0, "test").batch_size == loop.evaluator.batch_size()  # the size it chose
        assert set(vars(dm)) == set(before) and dm.eval_batch_size == eval_batch_size  # nothing written back
        return loop.evaluator.batch_size("cpu"), loop.evaluator.batch_size("cuda")

    assert sizes("fedavg", [], tiny_module()) == (128, 512)
    with caplog.at_level("INFO"):
        assert sizes("pfedgate", [PFedGate(density=0.5)], tiny_module()) == (16, 16)  # tiny_datamodule: batch 16
    assert any("PFedGate's evaluation depends on the batch" in r.getMessage() for r in caplog.records)
    assert sizes("mixing", [], FederatedModule(_BatchCentred(), lr=0.1)) == (16, 16)
    assert sizes("explicit", [PFedGate(density=0.5)], tiny_module(), eval_batch_size=64) == (64, 64)


def test_the_metrics_of_every_client_are_read_from_the_device_in_one_copy(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation reads the accuracy and loss sums of all clients, views and models in one call (one copy per
    device, where a read per value would make the host wait each time) — and the metrics the streamed evaluation
    hands to ``on_client_evaluate_end`` in one call per model kind — and they are the numbers read one by one."""
    import pl_fedsparse.evaluation as ev

    calls: list[int] = []
    real = ev.resolve_metrics
    monkeypatch.setattr(ev, "resolve_metrics", lambda ms: calls.append(sum("_sums" in m for m in ms)) or real(ms))
    loop = tiny_loop(tmp_path, num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())
    # the streamed evaluation's on_client_evaluate_end metrics: every client's in one read per model kind
    # (personal, global), then every client's personal and global metrics in one read — none read client by client
    n = loop.num_clients
    assert calls == [n, n, 2 * n], calls
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(37, 5, generator=g), torch.randint(0, 5, (37,), generator=g)
    pending = ev.pending_metrics(logits, labels)
    real([pending])
    assert pending == {"acc": float((logits.argmax(1) == labels).sum()) / 37,
                       "loss": float(torch.nn.functional.cross_entropy(logits, labels, reduction="sum")) / 37,
                       "n": 37.0}


def test_same_state_reads_one_answer_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether the personal model is the global one (FedAvg: evaluated once) is read in one copy, not one wait per
    tensor (``torch.equal`` answers on the host: on a device each call waits); torch.equal's answers otherwise."""
    import pl_fedsparse.evaluation as ev

    state = {f"t{i}": torch.randn(3, i + 1) for i in range(6)}
    same, other = {n: t.clone() for n, t in state.items()}, {n: t.clone() for n, t in state.items()}
    other["t5"][0, 0] += 1
    reads: list[str] = []
    real_equal, real_bool = torch.equal, torch.Tensor.__bool__
    monkeypatch.setattr(torch, "equal", lambda *a: reads.append("equal") or real_equal(*a))
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append("bool") or real_bool(t))
    assert ev._same_state(state, same) and not ev._same_state(state, other)
    assert reads == ["bool", "bool"], reads
