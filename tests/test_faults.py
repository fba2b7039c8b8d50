"""Client faults do not poison the federation (``trainer.on_client_fault``).

A fault is injected into one client's fit (``pl_fedsparse.testing.FaultInjection``: NaN weights, NaN gradients, an
infinite upload, an exception, no data) and the run goes through the CLI for FedAvg, FedSpa and DisPFL: it exits 0,
the global / peer models stay finite, the fault is counted, and every other number equals a run in which the faulty
client was simply not sampled in that round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import TINY_CLI, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import FederatedCallback, policies
from pl_fedsparse.cli import main
from pl_fedsparse.executors import ClientFaultError
from pl_fedsparse.run.checkpoint import load_checkpoint
from pl_fedsparse.testing import FAULT_KINDS, FaultInjection

CLIENT, ROUND = 2, 1


class SkipClient(FederatedCallback):
    """The comparison run: the default sampling, without ``client`` in ``round``."""

    def __init__(self, *, client: int = 0, round: int = 0) -> None:
        self.client, self.round = client, round

    def select_clients(self, loop: Any, round_idx: int, client_ids: Sequence[int]) -> list[int]:
        chosen = policies.select_clients(loop, round_idx, client_ids)
        return [k for k in chosen if not (k == self.client and round_idx == self.round)]


METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"callbacks": []},
    "fedspa": {"callbacks": [
        {"class_path": "pl_fedsparse.callbacks.GradientRegrow", "init_args": {"density": 0.5}},
        {"class_path": "pl_fedsparse.callbacks.FedSpaAggregation"}]},
    "dispfl": {"topology": {"class_path": "pl_fedsparse.topology.Ring"}, "callbacks": [
        {"class_path": "pl_fedsparse.callbacks.RandomRegrow",
         "init_args": {"density": 0.5, "same_mask": False, "mask_personal_eval": False}},
        {"class_path": "pl_fedsparse.callbacks.Gossip"}]},
}
COMPARED = ("acc_mean", "acc_weighted", "acc_bottom10", "global_acc", "loss_mean", "train_loss")


def _run(tmp_path: Path, name: str, method: str, extra: list[dict[str, Any]], capsys: Any) -> Path:
    trainer = {"num_rounds": 3, "callbacks": METHODS[method]["callbacks"] + extra, "logger": False}
    if "topology" in METHODS[method]:
        trainer["topology"] = METHODS[method]["topology"]
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": trainer}))
    run = tmp_path / name
    code = main(["fit", *TINY_CLI, "--config", str(cfg), "--trainer.default_root_dir", str(run)])
    assert code == 0, capsys.readouterr().err
    return run


def _rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _all_finite(tree: Any) -> bool:
    if isinstance(tree, dict):
        return all(_all_finite(v) for v in tree.values())
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        return bool(torch.isfinite(tree).all())
    return True


@pytest.mark.parametrize("kind", FAULT_KINDS)
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.slow
def test_a_faulty_client_is_left_out(tmp_path: Path, method: str, kind: str, capsys: Any) -> None:
    fault = {"class_path": "pl_fedsparse.testing.FaultInjection",
             "init_args": {"client": CLIENT, "rounds": [ROUND], "kind": kind}}
    skip = {"class_path": "test_faults.SkipClient", "init_args": {"client": CLIENT, "round": ROUND}}
    faulty = _run(tmp_path, "faulty", method, [fault], capsys)
    absent = _run(tmp_path, "absent", method, [skip], capsys)
    rows, ref = _rows(faulty), _rows(absent)
    expected_kind = {"nan_weights": "nonfinite_weights", "nan_gradients": "nonfinite_loss",
                     "inf_upload": "nonfinite_upload", "exception": "exception", "empty_data": "no_data"}[kind]
    assert [r["client_faults"] for r in rows] == [0, 1, 0]
    assert rows[ROUND]["client_fault_kinds"] == [{"client": CLIENT, "kind": expected_kind, "fit": "train"}]
    if kind == "nan_gradients" and method == "fedavg":  # (the first step's NaN makes every later loss NaN)
        assert rows[ROUND]["client_fault_kinds"][0]["kind"] in ("nonfinite_loss", "nonfinite_weights")
    for a, b in zip(rows, ref):
        for key in COMPARED:
            va, vb = a.get(key), b.get(key)
            assert (va is None and vb is None) or va == vb, (a["round"], key, va, vb)
            assert va is None or math.isfinite(va)
    summary = json.loads((faulty / "summary.json").read_text())
    assert summary["client_faults_total"] == 1 and summary["client_faults"] == {str(CLIENT): {expected_kind: 1}}
    ckpt = load_checkpoint(faulty / "checkpoints" / "last.ckpt")
    assert _all_finite(ckpt["global_state"] or {}) and _all_finite(ckpt["client_store"])


def test_raise_policy_stops_the_run(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path / "a", num_rounds=2, on_client_fault="raise",
                     callbacks=[FaultInjection(client=1, rounds=[0], kind="nan_weights")])
    with pytest.raises(ClientFaultError, match="client 1's train fit failed"):
        loop.fit(tiny_module(), tiny_datamodule())
    loop = tiny_loop(tmp_path / "b", num_rounds=2, on_client_fault="raise",
                     callbacks=[FaultInjection(client=1, rounds=[0], kind="exception")])
    with pytest.raises(RuntimeError, match="injected fault in client 1"):
        loop.fit(tiny_module(), tiny_datamodule())


def test_every_participant_failing_leaves_the_global_model_unchanged_with_continue(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    probe = tiny_loop(tmp_path / "a", num_rounds=2, clients_per_round=1, seed=3)
    probe.setup(tiny_module(), tiny_datamodule())
    picked = probe.select_clients(1)
    loop2 = tiny_loop(tmp_path / "b", num_rounds=2, clients_per_round=1, seed=3, on_client_fault="continue",
                      callbacks=[FaultInjection(client=picked[0], rounds=[1], kind="exception")])
    seen: dict[str, Any] = {}

    class Watch(FederatedCallback):
        def on_round_start(self, lp, round_idx):  # type: ignore[no-untyped-def]
            seen[f"start{round_idx}"] = {k: v.clone() for k, v in lp.global_state.items()}

    loop2.callbacks.insert(0, Watch())
    with caplog.at_level("WARNING"):
        loop2.fit(tiny_module(), tiny_datamodule())
    assert "every participant's fit failed; the global state is unchanged" in caplog.text
    for k, v in seen["start1"].items():
        assert torch.equal(loop2.global_state[k], v)  # type: ignore[index]
    assert loop2.history[1]["client_faults"] == 1 and loop2.history[1]["train_loss"] is None


def test_fault_in_a_requested_fit_keeps_the_previous_personal_model(tmp_path: Path) -> None:
    """A failing fine-tuning fit is left out: the client keeps what it had (here: nothing fine-tuned yet)."""
    from pl_fedsparse.callbacks import FineTune

    class BreakFineTune(FederatedCallback):
        def on_client_fit_end(self, lp, module, update):  # type: ignore[no-untyped-def]
            if update.kind == "finetune" and update.client_idx == 0:
                raise RuntimeError("fine-tuning crashed")

    ft = FineTune(epochs=1)
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[ft, BreakFineTune()])
    loop.fit(tiny_module(), tiny_datamodule())
    assert ft.get_client_state(loop, 0, "weights") == {}  # never fine-tuned: the global model is reported
    assert ft.get_client_state(loop, 1, "weights") != {}
    assert loop.history[-1]["client_fault_kinds"] == [{"client": 0, "kind": "exception", "fit": "finetune"}]
