"""A device run simulated on the CPU (``pl_fedsparse.testing.simulated_device``): a tensor left on the wrong side of
the host link fails as it would on a GPU, without one; every method's device path runs under it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from pl_fedsparse.callbacks import FederatedCallback
from pl_fedsparse.functional import gate, sparse, transfer
from pl_fedsparse.functional.transfer import DeviceMismatch, to_device
from pl_fedsparse.testing import simulated_device

REPO = Path(__file__).resolve().parents[1]


def test_what_meets_the_device_must_be_there() -> None:
    host = torch.ones(2, 3)  # (made before: a host tensor, e.g. a client's stored state)
    with simulated_device():
        w = to_device({"w": torch.ones(2, 3)}, "cpu")["w"]
        assert transfer.placed_on(w) is not None and transfer.placed_on(host) is None
        # moved where the weights are, made there, computed from them, scalars, host indices: as on a GPU
        for ok in (w * host.to(w.device), w * host.to(w.device, torch.float64).float(),
                   w + torch.zeros(2, 3, device=w.device), w.abs() > w.mean(), w * torch.tensor(2.0),
                   w[torch.tensor([1, 0])]):
            assert transfer.placed_on(ok) is not None
        assert transfer.placed_on(host) is None  # (.to(w.device) copied it there; the host tensor stays host)
        for bad in (lambda: w * host, lambda: w * w.cpu(), lambda: torch.where(w > 0, w, host),
                    lambda: w * host.to(host.device)):
            with pytest.raises(DeviceMismatch, match="on the device and on the host"):
                bad()
    # the switches are put back, and the numbers are those of a plain run
    assert not transfer.ALWAYS_PACK and gate.HOST_KNAPSACK_ON_CPU and sparse.HOST_SELECTION_ON_CPU
    assert not transfer._placed
    assert torch.equal(torch.ones(2, 3) * torch.ones(2, 3), torch.ones(2, 3))


def test_lenient_where_the_cpu_cannot_tell() -> None:
    """A tensor made from none (``torch.arange(8)``: on a GPU it is where its ``device=`` says) meets either side;
    without ``strict`` nothing is checked, as in the device-traffic counter."""
    with simulated_device():
        w = to_device({"w": torch.ones(8)}, "cpu")["w"]
        assert torch.equal(w * torch.arange(8.0), torch.arange(8.0))
    with simulated_device(strict=False):
        w = to_device({"w": torch.ones(8)}, "cpu")["w"]
        assert torch.equal(w * torch.ones(8), torch.ones(8))


class HostMask(FederatedCallback):
    """A user's callback that says its hook takes the update on the device, but keeps its mask on the host: on a GPU
    the product fails (the bug ``simulated_device`` is for)."""

    device_update = True

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        name = next(iter(update.state))
        mask = torch.ones_like(update.state[name].cpu())  # a host tensor, as a callback might cache one
        update.state[name] = update.state[name] * mask


class DeviceMask(HostMask):
    """The same, moving the mask where the update is (``to_where``): runs on a GPU, and here."""

    def on_client_fit_end(self, loop, module, update):  # type: ignore[no-untyped-def]
        name = next(iter(update.state))
        mask = transfer.to_where({"m": torch.ones_like(update.state[name].cpu())}, update.state[name])["m"]
        update.state[name] = update.state[name] * mask


@pytest.mark.parametrize("callback, fails", [("HostMask", True), ("DeviceMask", False)])
def test_a_callback_that_keeps_a_host_tensor_fails_as_on_a_gpu(callback: str, fails: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from conftest import one_line, run_main

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys.modules[__name__], callback, globals()[callback], raising=False)
    with simulated_device():
        code, _, err = run_main(["fit", "--config", "configs/synthetic_fedavg.yaml", "--trainer.num_rounds", "1",
                                 "--trainer.callbacks+", f"{__name__}.{callback}", "--trainer.on_client_fault",
                                 "raise", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
                                 str(tmp_path / callback)], capsys)
    if fails:
        assert code != 0
        line = one_line(err)
        assert f"{callback}.on_client_fit_end raised DeviceMismatch" in line and "on the host" in line, line
    else:
        assert code == 0, err


@pytest.mark.slow
@pytest.mark.parametrize("config", ["configs/synthetic_fedavg.yaml", "configs/synthetic_fedspa.yaml",
                                    "configs/synthetic_pfedgate.yaml", "configs/synthetic_fedrep.yaml",
                                    "configs/synthetic_fedem.yaml", "configs/synthetic_dispfl.yaml"])
def test_the_vectorized_executor_mixes_no_sides(config: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Many clients per step on "the device": the same numbers as a plain run, nothing met from the host."""
    import contextlib

    from conftest import metric_rows, run_main

    monkeypatch.chdir(REPO)
    rows = []
    for sim in (False, True):
        run = tmp_path / str(sim)
        with simulated_device() if sim else contextlib.nullcontext():
            code, _, err = run_main(["fit", "--config", config, "--trainer.num_rounds", "2", "--trainer.executor",
                                     "pl_fedsparse.executors.VectorizedExecutor", "--trainer.on_client_fault",
                                     "raise", "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir",
                                     str(run)], capsys)
        assert code == 0, err
        rows.append(metric_rows(run))
    assert rows[0] == rows[1]
