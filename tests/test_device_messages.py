"""Messages made on the fits' device: DisPFL's gossip average computed where the fits run (``message_device``), with
the numbers of the host path, each neighbour's stored model crossing the link once a round, no wait on the device
for the ledger's byte counts — and the host path wherever the device cannot be used (a user's ``on_client_message``
that did not say it takes a device message, fits in other processes). Without a GPU, a device run is simulated on the
CPU (``pl_fedsparse.testing.simulated_device``: what is on "the device" is tracked, and mixing it with host tensors
fails as CUDA does)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import metric_rows, run_main

from pl_fedsparse.callbacks import FederatedCallback, Gossip
from pl_fedsparse.callbacks.base import message_device
from pl_fedsparse.functional import transfer
from pl_fedsparse.functional.accounting import message_nbytes
from pl_fedsparse.functional.sparse import expand_values, pack_mask, packed_count
from pl_fedsparse.testing import simulated_device

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import device_traffic


def _on_device_message(self: Any, loop: Any, out: Any) -> bool:
    """Whether every tensor of a message ``client_message`` returned is on "the device"."""
    return all(transfer.on_a_device([t]) for t in out.tensors.values())


def _run(tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str], *, sim: bool, config: str = "dispfl",
         budget: str = "auto", extra: tuple[str, ...] = (), path: str | None = None,
         spy: tuple[Any, str, Any] | None = None) -> tuple[list[dict[str, Any]], list[bool]]:
    """The device-traffic counter's ``config`` (or the config file ``path`` with its synthetic-task arguments) for
    2 rounds, evaluated every round: its metric rows and, for each call of the spied method ``(owner, name,
    probe(self, first argument, result) -> bool)``, the probe's answer (default: ``Gossip.client_message``, whether
    the message is on "the device")."""
    cfg, synth = device_traffic.CONFIGS[config]
    owner, attr, probe = spy or (Gossip, "client_message", _on_device_message)
    where: list[bool] = []
    real = getattr(owner, attr)

    def spied(self: Any, arg: Any, *rest: Any) -> Any:
        out = real(self, arg, *rest)
        where.append(probe(self, arg, out))
        return out

    run = tmp_path / name
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(owner, attr, spied)
        with simulated_device() if sim else contextlib.nullcontext():
            code, _, err = run_main(["fit", "--config", path or cfg, *synth, "--trainer.num_rounds", "2",
                                     "--trainer.eval_every", "1", "--trainer.enable_progress_bar", "false",
                                     "--trainer.on_client_fault", "raise", "--trainer.device_state_budget", budget,
                                     *extra, "--trainer.default_root_dir", str(run)], capsys)
    assert code == 0, err
    return metric_rows(run), where


def test_gossip_on_the_device_gives_the_numbers_of_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Every message made on the device (a simulated device run), and every personal model evaluated expanded there,
    with the same metrics and bytes as the CPU run, whose messages and models are made on the host."""
    monkeypatch.chdir(REPO)
    personal: list[bool] = []
    expanded = Gossip.personal_state

    def spy(self: Gossip, loop: Any, k: int) -> Any:
        state = expanded(self, loop, k)
        personal.append(all(transfer.on_a_device([t]) for t in state.values()))
        return state

    monkeypatch.setattr(Gossip, "personal_state", spy)
    host, on_host = _run(tmp_path, "cpu", capsys, sim=False)
    assert personal and not any(personal)
    personal.clear()
    device, on_device = _run(tmp_path, "sim", capsys, sim=True)
    assert personal and all(personal)
    assert on_host and not any(on_host)
    assert on_device and all(on_device)
    assert device == host and host[-1]["comm_cum_bytes_total"] > 0  # (the ledger's bytes too)


@pytest.mark.slow
def test_d_psgd_ft_on_the_device_gives_the_numbers_of_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """D-PSGD-FT: the gossip, the personal models evaluated (made on the device), the consensus of all of them and
    the fine-tuning that starts from it — the CPU run's numbers."""
    monkeypatch.chdir(REPO)
    cfg = "configs/cifar10_dpsgd_ft_cpu.yaml"
    host, _ = _run(tmp_path, "cpu", capsys, sim=False, path=cfg)
    device, on_device = _run(tmp_path, "sim", capsys, sim=True, path=cfg)
    assert on_device and all(on_device)
    assert device == host and any("consensus_acc" in r for r in host)


@pytest.mark.slow
def test_without_device_copies_kept_the_numbers_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``trainer.device_state_budget: 0``: every neighbour's model crosses for every message, the same numbers."""
    monkeypatch.chdir(REPO)
    host, _ = _run(tmp_path, "cpu", capsys, sim=False)
    device, on_device = _run(tmp_path, "sim0", capsys, sim=True, budget="0")
    assert all(on_device) and device == host


class HostScale(FederatedCallback):
    """A user's ``on_client_message`` combining the message with a host tensor (it does not say
    ``device_message``): on a GPU that would fail if the message were on the device."""

    def on_client_message(self, loop, client_idx, message):  # type: ignore[no-untyped-def]
        name = next(iter(message.tensors))
        message.tensors[name] = message.tensors[name] * torch.ones_like(loop.initial_state[name])  # (a host tensor)


class DeviceScale(HostScale):
    """The same, moving its tensor where the message is, and saying so."""

    device_message = True

    def on_client_message(self, loop, client_idx, message):  # type: ignore[no-untyped-def]
        name = next(iter(message.tensors))
        ones = transfer.to_where({"o": torch.ones_like(loop.initial_state[name])}, message.tensors[name])["o"]
        message.tensors[name] = message.tensors[name] * ones


@pytest.mark.parametrize("callback, on_device", [("HostScale", False), ("DeviceScale", True)])
def test_a_callback_that_edits_messages_on_the_host_keeps_them_there(callback: str, on_device: bool,
                                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Messages go to the device only when every ``on_client_message`` takes them there; a run with a host-only
    callback works (its messages stay on the host) — planted: with the declaration ignored, it fails as on a GPU."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys.modules[__name__], callback, globals()[callback], raising=False)
    extra = ("--trainer.callbacks+", f"{__name__}.{callback}")
    _, where = _run(tmp_path, callback, capsys, sim=True, extra=extra)
    assert where and all(w == on_device for w in where)


def test_the_declaration_is_what_keeps_a_host_callback_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Planted: every callback taken to accept device messages — the host-only callback meets a device message and
    the run fails (DeviceMismatch, as CUDA would)."""
    from pl_fedsparse.callbacks import base

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys.modules[__name__], "HostScale", HostScale, raising=False)
    monkeypatch.setattr(base, "_all_declare", lambda callbacks, hook, flag: True)
    cfg, synth = device_traffic.CONFIGS["dispfl"]
    with simulated_device():
        code, _, err = run_main(["fit", "--config", cfg, *synth, "--trainer.num_rounds", "1",
                                 "--trainer.enable_progress_bar", "false", "--trainer.callbacks+",
                                 f"{__name__}.HostScale", "--trainer.default_root_dir", str(tmp_path)], capsys)
    assert code != 0 and "DeviceMismatch" in err, err


def test_message_device_is_the_host_on_the_cpu_and_for_other_processes() -> None:
    class Loop:
        def __init__(self, device: Any) -> None:
            self.executor = type("E", (), {"message_device": device})()
            self.callbacks: list[Any] = []

    assert message_device(Loop(torch.device("cpu"))) is None  # a CPU run: nothing to save
    assert message_device(Loop(None)) is None  # fits in other processes (Ray): messages travel from the host
    with simulated_device():
        assert message_device(Loop(torch.device("cpu"))) == torch.device("cpu")  # "the device" of the simulation
        assert message_device(Loop(None)) is None


@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_packed_count_is_the_masks_count(n: int) -> None:
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < 0.4
    assert packed_count(pack_mask(mask)[0]) == int(mask.sum())
    values = {"w": torch.randn(n)}
    assert message_nbytes(values, {"w": mask}, counts={"w": packed_count(pack_mask(mask)[0])}) == \
        message_nbytes(values, {"w": mask})


def test_packed_count_refuses_what_is_not_packed_bytes() -> None:
    from pl_fedsparse.errors import ConfigError

    with pytest.raises(ConfigError, match="packed"):
        packed_count(torch.ones(3))


def test_expand_values_moves_a_host_mask_to_the_values() -> None:
    """Values on the device, the mask on the host: the mask goes to the values (the same tensor as on the host)."""
    mask = torch.tensor([[True, False], [False, True]])
    values = torch.tensor([1.0, 2.0])
    expected = expand_values(values, mask)
    with simulated_device():
        on_device = transfer.to_device({"v": values}, "cpu")["v"]
        out = expand_values(on_device, mask)
        assert transfer.on_a_device([out])
    assert torch.equal(out, expected)


def _server_run(tmp_path: Path, name: str, config: str, capsys: pytest.CaptureFixture[str], *, sim: bool,
                extra: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], list[bool]]:
    """:func:`_run` of ``config`` with, per aggregation, whether it ran on "the device"."""
    from pl_fedsparse.loop import FederatedLoop

    return _run(tmp_path, name, capsys, sim=sim, config=config, extra=extra,
                spy=(FederatedLoop, "aggregate", lambda self, updates, out: self.aggregation_device() is not None))


@pytest.mark.parametrize("config", ["fedavg", pytest.param("fedspa", marks=pytest.mark.slow), "pfedgate", "fedpse",
                                    pytest.param("dmpfl", marks=pytest.mark.slow)])
def test_the_server_aggregates_on_the_device_with_the_numbers_of_the_host(config: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """FedAvg (the loop's default), FedSpa's Eq. 4, pFedGate's FedAvg, FedPSE's EWA (whose server update, made
    there, reaches DPS on the host) and DM-PFL's Eq. 5 with its new global mask aggregate on the fits' device in a
    device run (the messages start there too), with the CPU run's numbers; on the CPU they aggregate on the host."""
    monkeypatch.chdir(REPO)
    extra = ("--trainer.num_rounds", "4") if config == "dmpfl" else ()  # (both of DM-PFL's phases, twice)
    host, on_host = _server_run(tmp_path, "cpu", config, capsys, sim=False, extra=extra)
    device, on_device = _server_run(tmp_path, "sim", config, capsys, sim=True, extra=extra)
    assert on_host and not any(on_host)
    assert on_device and all(on_device)
    assert device == host


@pytest.mark.slow
@pytest.mark.parametrize("aggregation, fedavg_weights", [("index", "participants"), ("ewa", "participants"),
                                                         ("fedavg", "all")])
def test_pfedgates_other_aggregations_on_the_device_give_the_numbers_of_the_host(
        aggregation: str, fedavg_weights: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """pFedGate's App. A index-wise average (block uploads unpacked there), its EWA and its FedAvg over all clients
    (the old global model weighted by the others' samples) on the fits' device: the CPU run's numbers."""
    from conftest import callback_config

    from pl_fedsparse.loop import FederatedLoop

    monkeypatch.chdir(REPO)
    path = callback_config("synthetic_pfedgate.yaml", "PFedGate", tmp_path, aggregation=aggregation,
                           fedavg_weights=fedavg_weights)

    spy = (FederatedLoop, "aggregate", lambda self, updates, out: self.aggregation_device() is not None)
    host, on_host = _run(tmp_path, "cpu", capsys, sim=False, config="pfedgate", path=path, spy=spy)
    device, on_device = _run(tmp_path, "sim", capsys, sim=True, config="pfedgate", path=path, spy=spy)
    assert on_host and not any(on_host)
    assert on_device and all(on_device)
    assert device == host


class HostAggregate(FederatedCallback):
    """A user's ``aggregate`` that combines the updates with a host tensor (it does not say ``device_aggregate``)."""

    def aggregate(self, loop, updates):  # type: ignore[no-untyped-def]
        glob = loop.global_state
        return {n: (t + 0 * torch.ones_like(loop.initial_state[n]) if t.is_floating_point() else t)
                for n, t in glob.items()}


def test_an_aggregate_that_does_not_say_so_runs_on_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A user's ``aggregate`` without ``device_aggregate`` gets host tensors in a device run (and works) — planted:
    with the declaration ignored it meets device tensors and fails as on a GPU."""
    from pl_fedsparse.callbacks import base
    from pl_fedsparse.loop import FederatedLoop

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys.modules[__name__], "HostAggregate", HostAggregate, raising=False)
    extra = ("--trainer.callbacks+", f"{__name__}.HostAggregate")
    _, where = _server_run(tmp_path, "host", "fedavg", capsys, sim=True, extra=extra)
    assert where and not any(where)
    monkeypatch.setattr(FederatedLoop, "aggregation_device",
                        lambda self: None if self.global_state is None else base.message_device(self))
    cfg, synth = device_traffic.CONFIGS["fedavg"]
    with simulated_device():
        code, _, err = run_main(["fit", "--config", cfg, *synth, "--trainer.num_rounds", "1",
                                 "--trainer.enable_progress_bar", "false", *extra,
                                 "--trainer.default_root_dir", str(tmp_path / "planted")], capsys)
    assert code != 0 and "DeviceMismatch" in err, err


def test_the_new_global_model_stays_on_the_device_for_the_next_round(tmp_path: Path) -> None:
    """The aggregated state comes back to the host with its device copy kept: the next round's messages find it
    there (nothing crosses). Planted: the copy not kept."""
    from conftest import tiny_datamodule, tiny_loop, tiny_module

    from pl_fedsparse.client import ClientStateStore

    def run(store_to_host: Any = None) -> bool:
        with pytest.MonkeyPatch.context() as mp:
            if store_to_host is not None:
                mp.setattr(ClientStateStore, "to_host", store_to_host)
            with simulated_device():
                loop = tiny_loop(tmp_path / str(store_to_host is None), num_rounds=2, device_state_budget="auto")
                loop.fit(tiny_module(), tiny_datamodule())
                assert loop.global_state is not None
                return all(loop.client_store.resident.lookup(t, loop.device) is not None
                           for t in loop.global_state.values())

    assert run()
    assert not run(lambda self, tensors: transfer.copy_tensors(list(tensors), "cpu"))


def test_fedpses_dps_on_the_device_gives_the_numbers_of_the_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """FedPSE's DPS (Alg. 3) made where the fits run: every participant's counts read at once, the same random draws
    from the same generators applied there — the CPU run's numbers. Planted: the draws applied to the other pool (the
    numbers change)."""
    import pl_fedsparse.callbacks.fedpse as fedpse_mod
    from pl_fedsparse.callbacks.fedpse import PersonalizedDownstream
    from pl_fedsparse.functional import pse

    monkeypatch.chdir(REPO)
    probe = (PersonalizedDownstream, "_personalize_on", lambda self, loop, out: True)
    host, on_host = _run(tmp_path, "cpu", capsys, sim=False, config="fedpse", spy=probe)
    device, on_device = _run(tmp_path, "sim", capsys, sim=True, config="fedpse", spy=probe)
    assert not on_host and len(on_device) == 2  # (once a round, on the device only)
    assert device == host
    real = pse.dps_draws
    monkeypatch.setattr(fedpse_mod, "dps_draws",  # the pools drawn in the other order
                        lambda extra, sizes, d, gen: real(extra, sizes[::-1], 1 - d, gen)[::-1])
    planted, _ = _run(tmp_path, "planted", capsys, sim=True, config="fedpse", spy=probe)
    assert planted != host
