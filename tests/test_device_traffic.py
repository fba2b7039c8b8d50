"""The device-traffic counter (``benchmarks/device_traffic.py``) on the CPU: no Trainer built and no module moved per
client fit, no synchronising call and no transfer inside a training step, no transfer in mask readjustment — for the
configs where that holds today. Each count is planted once below (a Trainer per fit, a sync in the step, a host copy
in readjustment) to show the test sees it."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import device_traffic  # noqa: E402


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("config", ["fedavg", "fedspa", "dmpfl"])
@pytest.mark.slow
def test_no_trainer_no_move_no_sync_per_step(config: str) -> None:
    r = device_traffic.measure(config)
    assert r["fits"] > 0 and r["steps"] > 0
    assert r["trainers_per_fit"] == 0 and r["module_moves_per_fit"] == 0, r
    assert r["syncs_per_step"] == 0 and r["transfers_per_step"] == 0 and r["sends_per_step"] == 0, r
    assert r["readjust_transfers"] == 0 and r["readjust_syncs_per_call"] == 0, r  # (masks selected by sorting)


@pytest.mark.slow
def test_pfedgate_steps_without_a_host_sync_on_the_device_path() -> None:
    """The gate's knapsack runs on the device (the path a GPU takes; on the CPU a Python scan is faster)."""
    r = device_traffic.measure("pfedgate")
    assert r["trainers_per_fit"] == 0 and r["module_moves_per_fit"] == 0, r
    assert r["syncs_per_step"] == 0 and r["transfers_per_step"] == 0, r


@pytest.mark.slow
def test_pfedgate_gives_the_same_numbers_on_the_device_knapsack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from conftest import run_main

    from pl_fedsparse.functional import gate

    rows = []
    for host in (True, False):
        monkeypatch.setattr(gate, "HOST_KNAPSACK_ON_CPU", host)
        run = tmp_path / str(host)
        code, _, err = run_main(["fit", "--config", "configs/synthetic_pfedgate.yaml", "--trainer.num_rounds", "2",
                                 "--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false",
                                 "--trainer.default_root_dir", str(run)], capsys)
        assert code == 0, err
        rows.append([{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
                     for x in (run / "metrics.jsonl").read_text().splitlines()])
    assert rows[0] == rows[1]


@pytest.mark.slow
def test_the_counter_sees_what_it_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the reference path (a Trainer per fit, which also places the module); a ``.item()`` in every
    training step; a host copy inside prune-and-regrow."""
    r = device_traffic.measure("fedavg", fit_runner="trainer")
    assert r["trainers_per_fit"] == 1 and r["module_moves_per_fit"] >= 1
    from pl_fedsparse.module import FederatedModule

    step = FederatedModule.training_step

    def syncing(self: Any, batch: Any, batch_idx: int) -> Any:
        loss = step(self, batch, batch_idx)
        loss.detach().item()
        return loss

    monkeypatch.setattr(FederatedModule, "training_step", syncing)
    assert device_traffic.measure("fedavg")["syncs_per_step"] == 1

    def indexing(self: Any, batch: Any, batch_idx: int) -> Any:  # read on the host one level down (pFedGate's was)
        loss = step(self, batch, batch_idx)
        return loss + loss.detach().reshape(1)[torch.zeros((), dtype=torch.int64)] * 0

    monkeypatch.setattr(FederatedModule, "training_step", indexing)
    assert device_traffic.measure("fedavg")["syncs_per_step"] == 1
    # a read of a host tensor is a synchronising call (counted: an upper bound) but no wait; of a device one, both
    from pl_fedsparse.executors import base

    end_fit = base.end_fit

    def reading(loop: Any, request: Any, watch: Any, n: int, update: Any, *a: Any, **k: Any) -> Any:
        out = end_fit(loop, request, watch, n, update, *a, **k)
        next(iter(out.state.values())).sum().item()  # (the update crossed: a host copy)
        return out

    monkeypatch.setattr(FederatedModule, "training_step", step)
    monkeypatch.setattr(base, "end_fit", reading)
    import pl_fedsparse.executors.in_process as ip

    monkeypatch.setattr(ip, "end_fit", reading)
    base_r = device_traffic.measure("fedavg")
    assert base_r["waits_per_fit"] == 0 and base_r["syncs_per_fit"] == 3, base_r  # (2 host reads before it)

    def waiting(self: Any, batch: Any, batch_idx: int) -> Any:
        loss = step(self, batch, batch_idx)
        if batch_idx == 0:
            loss.detach().item()  # (once an epoch, inside the step)
        return loss

    monkeypatch.setattr(FederatedModule, "training_step", waiting)
    r = device_traffic.measure("fedavg")
    assert r["waits_per_fit"] >= 1 and r["syncs_per_fit"] == 3 + r["waits_per_fit"], r
    monkeypatch.undo()
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    from pl_fedsparse.functional import sparse

    many = sparse.drop_and_grow_many

    def copying(masks: Any, drops: Any, grows: Any, *a: Any, **k: Any) -> Any:
        return many(masks, [d.cpu() for d in drops], grows, *a, **k)

    import pl_fedsparse.callbacks.prune_regrow as pr

    monkeypatch.setattr(pr, "drop_and_grow_many", copying)
    assert device_traffic.measure("fedspa")["readjust_transfers"] > 0

    def listing(masks: Any, drops: Any, grows: Any, *a: Any, **k: Any) -> Any:
        masks[0].nonzero()  # what the CPU's selection does, once per tensor
        return many(masks, drops, grows, *a, **k)

    monkeypatch.setattr(pr, "drop_and_grow_many", listing)
    assert device_traffic.measure("fedspa")["readjust_syncs_per_call"] > 0


@pytest.mark.slow
def test_the_counter_sees_values_made_on_the_device_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted in every training step: ``torch.tensor(data, device=...)`` — on a GPU a copy from pageable memory and a
    wait for the stream: a transfer and a synchronising call; the same value by ``transfer.host_tensor`` — sent from
    pinned memory without a wait: a send only."""
    from pl_fedsparse.functional import transfer
    from pl_fedsparse.module import FederatedModule

    step = FederatedModule.training_step

    def made_there(self: Any, batch: Any, batch_idx: int) -> Any:
        loss = step(self, batch, batch_idx)
        return loss + torch.tensor([0.0], device=loss.device).sum()

    def sent(self: Any, batch: Any, batch_idx: int) -> Any:
        loss = step(self, batch, batch_idx)
        return loss + transfer.host_tensor([0.0], loss.device).sum()

    monkeypatch.setattr(FederatedModule, "training_step", made_there)
    r = device_traffic.measure("fedavg")
    assert r["syncs_per_step"] == 1 and r["transfers_per_step"] == 1 and r["sends_per_step"] == 0, r
    monkeypatch.setattr(FederatedModule, "training_step", sent)
    r = device_traffic.measure("fedavg")
    assert r["syncs_per_step"] == 0 and r["transfers_per_step"] == 0 and r["sends_per_step"] == 1, r


@pytest.mark.slow
def test_counting_leaves_the_engine_as_it_found_it() -> None:
    """Everything the counter patches is put back as it was (a staticmethod stays one): a fit after counting runs."""
    from pl_fedsparse.executors import runner
    from pl_fedsparse.executors.in_process import InProcessExecutor

    before = {name: vars(owner).get(name) for owner, name in [(runner.FitRunner, "_step"),
                                                              (InProcessExecutor, "run_one")]}
    device_traffic.measure("fedavg")
    assert isinstance(vars(runner.FitRunner)["_step"], staticmethod)
    assert {name: vars(owner).get(name) for owner, name in [(runner.FitRunner, "_step"),
                                                            (InProcessExecutor, "run_one")]} == before
    assert device_traffic.measure("fedavg")["trainers_per_fit"] == 0  # and it still fits


#: state copies across the host link per client fit, as counted today: one copy in (the start weights with the
#: client's entries), one out (the update with the fit's new entries); DM-PFL's global mask crosses when the server
#: changes it, outside the fits. With copies kept on the device between fits (``trainer.device_state_budget``, on in a
#: simulated device run) the copy in is left out where everything is there already: the server's weights, kept there
#: from the aggregation made there (FedAvg, FedSpa) or crossing once a round for the round's messages (pFedGate, whose
#: own aggregation runs on the host: 1 in per round of 10 fits); the messages made on the device (FedSpa's masked
#: global model, DisPFL's gossip average); DM-PFL's entries its last fit wrote. FedPSE starts every fit from weights
#: the host computed for that client (its personalised downstream message)
STATE_TRANSFERS = {"fedavg": 1.0, "fedpse": 1.5, "pfedgate": 1.05, "dmpfl": 1.42, "fedspa": 1.0, "dispfl": 1.0}


@pytest.mark.slow
@pytest.mark.parametrize("config", list(STATE_TRANSFERS))
def test_state_crosses_in_few_copies_per_fit(config: str) -> None:
    r = device_traffic.measure(config)
    assert r["transfers_per_fit"] <= STATE_TRANSFERS[config], r
    assert r["transfers_per_step"] == 0 and r["readjust_transfers"] == 0, r
    # nothing in a fit waits for a device value: the training loss, which readjusted masks changed, DM-PFL's stored
    # weights are read with the update's copy to the host or sized from host values (ClientUpdate.on_host)
    assert r["waits_per_fit"] == 0, r


@pytest.mark.slow
@pytest.mark.parametrize("as_tensors", [True, False])
def test_a_modules_own_fit_metrics_as_tensors_make_no_wait(as_tensors: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module with its own ``fit_metrics`` (the engine then asks it when training ends): values returned as 0-dim
    tensors on the device cross with the update's copy, no wait; as floats (the plant) they are read at once."""
    from pl_fedsparse.executors.in_process import InProcessExecutor
    from pl_fedsparse.module import FederatedModule

    def step(self: Any, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = self.loss(self(x), y)
        part = loss.detach() * y.shape[0]
        self.own_sum = part if batch_idx == 0 and self.own_seen == 0 else self.own_sum + part
        self.own_seen += int(y.shape[0])
        return loss

    def start(self: Any) -> None:
        self.own_sum, self.own_seen = None, 0

    def metrics(self: Any) -> dict[str, Any]:
        mean = self.own_sum / self.own_seen
        return {"train_loss": mean if as_tensors else float(mean), "samples_seen": self.own_seen}

    monkeypatch.setattr(FederatedModule, "training_step", step)
    monkeypatch.setattr(FederatedModule, "on_fit_start", start)
    monkeypatch.setattr(FederatedModule, "fit_metrics", metrics)
    # (the engine's own loss record is put off only where fit_metrics is FederatedModule's: here it is the module's)
    monkeypatch.setattr(InProcessExecutor, "_losses_read_later", lambda self, module, meter: None)
    r = device_traffic.measure("fedavg")
    if as_tensors:
        assert r["waits_per_fit"] == 0, r
    else:
        assert r["waits_per_fit"] == 1 and r["examples"]["fit/waits"] == ["__float__"], r


@pytest.mark.slow
@pytest.mark.parametrize("config, plant", [("fedavg", "loss"), ("fedspa", "changed"), ("dmpfl", "counts")])
def test_the_counter_sees_a_wait_at_the_end_of_a_fit(config: str, plant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted, one each: the training loss read when the fit's training ends (as ``fit_metrics`` is asked without
    the device update); which readjusted masks changed read in ``on_client_fit_end`` (every put-off read run at once);
    DM-PFL's stored weights gathered by a bool index (its masks' counts not known on the host)."""
    from pl_fedsparse.callbacks.dmpfl import DualMask
    from pl_fedsparse.client import ClientUpdate
    from pl_fedsparse.executors.in_process import InProcessExecutor

    if plant == "loss":
        monkeypatch.setattr(InProcessExecutor, "_losses_read_later", lambda self, module, meter: None)
    elif plant == "changed":
        monkeypatch.setattr(ClientUpdate, "on_host", lambda self, tensors, then: then(list(tensors)))
    else:
        monkeypatch.setattr(DualMask, "_mask_counts", lambda self, loop, k, like: None)
    r = device_traffic.measure(config)
    assert r["waits_per_fit"] >= 1, r
    assert r["examples"]["fit/waits"] == (["__getitem__[bool]"] if plant == "counts" else ["tolist"]), r


@pytest.mark.slow
def test_the_counter_sees_the_start_weights_cross_at_every_fit_without_device_copies() -> None:
    """Planted: no copies kept on the device between fits (``--budget 0``): the round's weights cross for every
    fit's message (and the new ones are not found from the aggregation)."""
    kept, none = device_traffic.measure("fedavg"), device_traffic.measure("fedavg", budget="0")
    assert none["message_transfers_per_message"] == 1 > kept["message_transfers_per_message"]
    assert none["transfers_per_fit"] + none["message_transfers_per_message"] == 2


@pytest.mark.slow
def test_the_counter_sees_a_state_copy_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the update copied to the host tensor by tensor (as before packing)."""
    from pl_fedsparse.executors import base

    whole = base.update_to_host
    monkeypatch.setattr(base, "update_to_host", lambda u, copy: whole(u, lambda ts: [copy([t])[0] for t in ts]))
    assert device_traffic.measure("fedavg")["transfers_per_fit"] > STATE_TRANSFERS["fedavg"]


@pytest.mark.slow
def test_the_counter_sees_the_update_cross_before_the_callbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: a callback whose ``on_client_fit_end`` does not take the update on the device (a user's, say) —
    the update crosses before the callbacks, and what they compute there crosses again; and DM-PFL's global mask
    moved at every fit instead of once per mask, by the server."""
    from pl_fedsparse.callbacks.masking import SparseMask

    monkeypatch.setattr(SparseMask, "device_update", False)
    assert device_traffic.measure("fedspa")["transfers_per_fit"] > STATE_TRANSFERS["fedspa"]
    monkeypatch.undo()
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    from pl_fedsparse.callbacks.dmpfl import DualMask

    where = DualMask._global_where

    def uncached(self: Any, like: torch.Tensor) -> dict[str, torch.Tensor]:
        self._global_on = None
        return where(self, like)

    monkeypatch.setattr(DualMask, "_global_where", uncached)
    assert device_traffic.measure("dmpfl")["transfers_per_fit"] > STATE_TRANSFERS["dmpfl"] + 0.5


@pytest.mark.slow
def test_dispfl_messages_are_made_on_the_device_without_a_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """DisPFL's gossip average is made on the fits' device: each neighbour's stored model crosses once a round (read
    from the copy kept there for its other neighbours), the receiver's mask once, the ledger reads nothing on the
    device, and the fit finds its start weights there. Planted: the ledger counting the masks' bytes on the device (a
    wait per mask); the messages made on the host (the start weights cross in every fit)."""
    from pl_fedsparse.callbacks import gossip as gossip_mod
    from pl_fedsparse.functional import transfer

    r = device_traffic.measure("dispfl")
    assert r["message_syncs_per_message"] == 0, r
    assert 0 < r["message_transfers_per_message"] <= 2, r
    assert r["transfers_per_fit"] <= 1, r
    with monkeypatch.context() as mp:
        count = gossip_mod.packed_count  # (every round's messages are flat: the ledger's counts are these)
        mp.setattr(gossip_mod, "packed_count",
                   lambda p: count(transfer.to_device({"p": p}, torch.device("cpu"))["p"]))  # on the device
        assert device_traffic.measure("dispfl")["message_syncs_per_message"] > 0
    monkeypatch.setattr(gossip_mod, "message_device", lambda loop: None)
    host = device_traffic.measure("dispfl")
    assert host["message_transfers_per_message"] == 0 and host["transfers_per_fit"] >= 2, host


@pytest.mark.slow
@pytest.mark.parametrize("config, most", [("fedavg", 1), ("pfedgate", 1), ("fedpse", 4), ("fedspa", 2), ("dmpfl", 2.25)])
def test_the_server_aggregates_on_the_device_without_a_wait(config: str, most: float) -> None:
    """Every method's aggregation on the fits' device reads no value there (DM-PFL's new global mask included: its
    count of eligible positions is not read on the host) and brings its results back in one copy (what the updates
    left on the host crosses in one more; DM-PFL's global mask in its own; FedPSE's DPS: its counts out, its draws
    in, the new updates out). Planted for DM-PFL: the count read on the host again (a wait per masked tensor); for
    FedPSE: DPS's counts read where they are made, one by one."""
    r = device_traffic.measure(config)
    assert r["aggregate_syncs_per_round"] == 0, r
    assert 0 < r["aggregate_transfers_per_round"] <= most, r
    if config == "dmpfl":
        from pl_fedsparse.functional import dual

        real = dual._top_eligible

        def counting(score: torch.Tensor, count: int) -> torch.Tensor:
            return real(score, min(count, int((score >= 0).sum())))  # the count-first rule's host read

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dual, "_top_eligible", counting)
            assert device_traffic.measure(config)["aggregate_syncs_per_round"] > 0
    if config == "fedpse":
        from pl_fedsparse.functional import transfer

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(transfer, "to_host", lambda tensors, **kw: dict(tensors))  # (left on the device)
            assert device_traffic.measure(config)["aggregate_syncs_per_round"] > 0


@pytest.mark.slow
def test_fedpses_messages_start_where_the_fits_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """FedPSE's message (the stored start plus the pending personalised update) is made on the fits' device from the
    copies kept there, and the next start is made where the update is, so from the second round on nothing crosses
    in; the ledger reads no mask there. Planted: the message made on the host (its start crosses with every fit)."""
    import pl_fedsparse.callbacks.fedpse as fedpse_mod

    r = device_traffic.measure("fedpse")
    assert r["message_syncs_per_message"] == 0 and r["transfers_per_fit"] <= STATE_TRANSFERS["fedpse"], r
    monkeypatch.setattr(fedpse_mod, "message_device", lambda loop: None)
    assert device_traffic.measure("fedpse")["transfers_per_fit"] > STATE_TRANSFERS["fedpse"]


@pytest.mark.slow
def test_the_operator_count_sees_one_more_kernel_in_a_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ops_per_step`` counts the operators a step dispatches that launch a kernel on a GPU: one more in
    ``training_step`` (a multiplication) is exactly two more per step, its product and the product in its backward;
    a view (``reshape``) is none."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    from pl_fedsparse.module import FederatedModule

    base = device_traffic.measure("fedavg")["ops_per_step"]
    step = FederatedModule.training_step

    def one_more(self: Any, batch: Any, batch_idx: int) -> Any:
        return step(self, batch, batch_idx).reshape(()) * 1.0

    monkeypatch.setattr(FederatedModule, "training_step", one_more)
    assert device_traffic.measure("fedavg")["ops_per_step"] == base + 2  # the product and its backward


@pytest.mark.slow
@pytest.mark.parametrize("config", ["fedavg", "fedspa", "pfedgate", "fedpse"])
def test_stacked_steps_wait_for_nothing_and_copy_no_state(config: str) -> None:
    """The VectorizedExecutor's steps (every client's at once): no synchronising call and no transfer of state per
    step (counted by difference of a run with one local epoch and one with two); its small host-made rows are sent
    without a wait. Around the steps, a group's updates reach the host as the in-process executor's do: with no
    callback at a fit's end (FedAvg) every client's trained weights in one copy for the whole group; where every
    callback takes the update on the device (FedSpa, pFedGate, FedPSE), at most two copies of state a fit."""
    r = device_traffic.measure_stacked(config)
    assert r["steps_added"] > 0 and r["sequential_fits"] == 0, r
    assert r["syncs_per_step"] == 0 and r["transfers_per_step"] == 0, r
    assert r["trainers_per_step"] == 0 and r["module_moves_per_step"] == 0, r
    if config == "fedavg":
        assert r["group_transfers_per_group"] == 1, r
    else:  # (FedSpa: its masks found on the device where they crossed with the start weights, for every fit of
        # the group — not only the first to end)
        assert r["group_transfers_per_fit"] <= 2, r
    # the only reads: the first step's gradient check (once a run) and, a group, its clients' loss sums read with
    # whether their weights are finite (one copy; FedSpa's changed masks go with each update's copy)
    fits_per_group = r["group_transfers_per_group"] / r["group_transfers_per_fit"]
    assert r["syncs_outside_steps"] == 1 and round(r["group_syncs_per_fit"] * fits_per_group, 1) == 1, r
