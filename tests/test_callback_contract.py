"""The callback contract, checked in code (pl_fedsparse.contract, docs/extending.md "The rules the loop checks").

A user trial broke two documented rules without a word: a callback that set ``self.`` attributes during a fit gave
other numbers on Ray workers, and one that changed state across rounds without ``state_dict`` resumed to other
numbers. The loop now stops such a run with one line (``trainer.callback_contract: error``) or warns once (``warn``).
"""

from __future__ import annotations

import collections
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_CLI, one_line, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.callbacks import Ditto
from pl_fedsparse.client import Message
from pl_fedsparse.contract import CallbackContractError, FitWatch, _plain, checked_callbacks, plain_equal

REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------ callbacks
class CountInFit(FederatedCallback):
    """Breaks rule 1: counts in a fit hook (a worker's count never reaches the driver)."""

    def __init__(self, hook: str = "on_client_fit_end") -> None:
        self.hook = hook
        self.count = 0

    def on_client_fit_end(self, loop: Any, module: Any, update: Any) -> None:
        if self.hook == "on_client_fit_end":
            self.count += 1

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.hook == "on_train_batch_end":
            self.count += 1


class AccumulateRounds(FederatedCallback):
    """Breaks rule 2: accumulates across rounds in a driver hook, without state_dict (lost on resume)."""

    def __init__(self) -> None:
        self.total = 0.0

    def on_round_end(self, loop: Any, round_idx: int, metrics: dict[str, Any]) -> None:
        self.total += float(metrics["train_loss"] or 0.0) + 1.0


class SavedAccumulateRounds(AccumulateRounds):
    """Rule 2 kept: the same accumulation, saved."""

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.total = float(state_dict["total"])


class FitScratch(FederatedCallback):
    """A device copy made in on_train_start and left there (not dropped in on_train_end)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.anchor = [p.detach().clone() for p in pl_module.parameters()]


class DeclaredFitScratch(FitScratch):
    scratch_attributes = ("anchor",)


class DropsItsScratch(FederatedCallback):
    """Per-fit scratch set in on_train_start and put back in on_train_end: back to its pre-fit fingerprint."""

    def __init__(self) -> None:
        self.anchor: list[torch.Tensor] = []
        self.context: Any = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.anchor = [p.detach().clone() for p in pl_module.parameters()]
        self.context = trainer

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.anchor, self.context = [], None


class WellBehaved(FederatedCallback):
    """Everything where the contract puts it: client state, update.extras, a driver hook, state_dict."""

    def __init__(self) -> None:
        self.seen = 0

    def setup_federation(self, loop: Any) -> None:
        self.add_client_state(loop, "fits", lambda k: torch.zeros((), dtype=torch.long))

    def on_client_fit_end(self, loop: Any, module: Any, update: Any) -> None:
        k = update.client_idx
        self.set_client_state(loop, k, "fits", self.get_client_state(loop, k, "fits") + 1)
        update.extras["well/samples"] = update.n_samples  # travels back with the update

    def on_before_aggregate(self, loop: Any, updates: Any) -> None:
        self.seen += sum(int(u.extras["well/samples"]) for u in updates)

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.seen = int(state_dict["seen"])


def _fit(tmp_path: Path, callbacks: list[Any], **kw: Any) -> Any:
    loop = tiny_loop(tmp_path, callbacks=callbacks, **kw)
    loop.fit(tiny_module(), tiny_datamodule())
    return loop


# ------------------------------------------------------------------------------------------------ rule 1: fits
@pytest.mark.parametrize("hook", ["on_client_fit_end", "on_train_batch_end"])
def test_an_attribute_set_during_a_fit_stops_the_run_in_round_0(tmp_path: Path, hook: str) -> None:
    loop = tiny_loop(tmp_path, callbacks=[CountInFit(hook)])
    with pytest.raises(CallbackContractError) as err:
        loop.fit(tiny_module(), tiny_datamodule())
    message = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in message
    assert "CountInFit.count changed during a fit (client 0's train fit, round 0)" in message
    for where in ("add_client_state", "update.extras", "on_round_end", "CountInFit.scratch_attributes",
                  "trainer.callback_contract"):
        assert where in message
    assert loop.history == []  # before round 0 ended (not swallowed as a client fault)


def test_an_attribute_set_during_a_fit_is_no_client_fault_even_under_skip(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, callbacks=[CountInFit()], on_client_fault="skip")
    with pytest.raises(CallbackContractError):
        loop.fit(tiny_module(), tiny_datamodule())
    assert loop.round_faults == []


def test_a_plain_lightning_callback_of_the_user_is_checked_too(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    class Steps(pl.Callback):
        def __init__(self) -> None:
            self.steps = 0

        def on_train_batch_end(self, *args: Any) -> None:
            self.steps += 1

    with pytest.raises(CallbackContractError, match=r"Steps\.steps changed during a fit"):
        _fit(tmp_path, [Steps()])


def test_lightning_own_callbacks_are_not_checked() -> None:
    from lightning.pytorch.callbacks import Timer

    mine = CountInFit()
    assert checked_callbacks([Timer(), mine]) == [mine]


def test_undeclared_fit_scratch_is_an_error_and_declared_scratch_passes(tmp_path: Path) -> None:
    with pytest.raises(CallbackContractError, match=r"FitScratch\.anchor changed during a fit"):
        _fit(tmp_path / "a", [FitScratch()])
    loop = _fit(tmp_path / "b", [DeclaredFitScratch()])
    assert len(loop.history) == 2


def test_scratch_put_back_by_the_end_of_the_fit_passes(tmp_path: Path) -> None:
    loop = _fit(tmp_path, [DropsItsScratch()])
    assert len(loop.history) == 2


def test_warn_mode_warns_once_and_the_run_completes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pl_fedsparse.contract"):
        loop = _fit(tmp_path, [CountInFit(), AccumulateRounds()], callback_contract="warn")
    assert len(loop.history) == 2
    fit = [r for r in caplog.records if "CountInFit.count" in r.getMessage()]
    saved = [r for r in caplog.records if "AccumulateRounds.total" in r.getMessage()]
    assert len(fit) == 1 and len(saved) == 1, [r.getMessage() for r in caplog.records]
    assert loop.fed_callbacks[0].count == 2 * loop.num_clients  # in process it counts (that is the trap)


def test_fit_watch_fingerprints() -> None:
    class Cb:
        pass

    cb = Cb()
    t = torch.zeros(3)
    cb.__dict__.update(n=1, t=t, d={"a": [1.0, t]}, big=list(range(1000)), nan=float("nan"), empty=[])
    watch = FitWatch([cb])
    cb.empty = []  # a new, equal container
    cb.nan = float("nan")
    assert watch.changed() == []
    watch = FitWatch([cb])
    t.add_(1)  # in place: a new tensor version
    cb.big = list(range(1000))  # too large to read: compared by identity
    cb.new = 1
    assert [a for _, a in watch.changed()] == ["big", "d", "new", "t"]


# ------------------------------------------------------------------------------------------------ rule 2: checkpoints
def test_unsaved_cross_round_state_stops_the_run_at_the_next_checkpoint(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, callbacks=[AccumulateRounds()])
    with pytest.raises(CallbackContractError) as err:
        loop.fit(tiny_module(), tiny_datamodule())
    message = str(err.value)
    assert "\n" not in message
    assert "AccumulateRounds.total changed since setup_federation but AccumulateRounds.state_dict() does not " \
           "restore it" in message and "load_state_dict" in message
    assert len(loop.history) == 1  # at the checkpoint after round 0; the one before round 0 passed
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["round"] == 0  # the checkpoint that would lose the state was not written


def test_saved_state_and_the_well_behaved_callback_pass(tmp_path: Path) -> None:
    loop = _fit(tmp_path, [SavedAccumulateRounds(), WellBehaved(), Ditto(lam=0.1)])
    assert len(loop.history) == 2
    assert loop.fed_callbacks[1].seen > 0


def test_plain_equal() -> None:
    assert plain_equal({"a": (1, 2.0), "t": torch.tensor([float("nan"), 1.0])},
                       {"a": [1, 2.0], "t": torch.tensor([float("nan"), 1.0])})
    assert not plain_equal(torch.zeros(2), torch.zeros(2, dtype=torch.long))
    assert not plain_equal({"a": 1}, {"a": 1, "b": 2})


class Tally:  # a user's helper object holding plain data
    def __init__(self) -> None:
        self.n = 0
        self.seen: list[int] = []


class DequeOfRounds(FederatedCallback):
    """Breaks rule 2: the last rounds in a deque, not saved."""

    def __init__(self) -> None:
        self.recent: collections.deque[int] = collections.deque(maxlen=3)

    def on_round_end(self, loop: Any, round_idx: int, metrics: dict[str, Any]) -> None:
        self.recent.append(round_idx)


class HelperObjectCount(FederatedCallback):
    """Breaks rule 2: a helper object's count, not saved."""

    def __init__(self) -> None:
        self.tally = Tally()

    def on_round_end(self, loop: Any, round_idx: int, metrics: dict[str, Any]) -> None:
        self.tally.n += 1


class SavedHelperObjectCount(HelperObjectCount):
    def state_dict(self) -> dict[str, Any]:
        return {"n": self.tally.n}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tally.n = int(state_dict["n"])


@pytest.mark.parametrize("callback, attr", [(DequeOfRounds, "recent"), (HelperObjectCount, "tally")])
def test_unsaved_state_in_a_deque_or_a_helper_object_is_found(tmp_path: Path, callback: type, attr: str) -> None:
    """A deque, and an object of the user's own class holding plain data, are compared as lists and dicts are (a
    resume would rebuild them empty: another run)."""
    loop = tiny_loop(tmp_path, callbacks=[callback()])
    with pytest.raises(CallbackContractError, match=f"{callback.__name__}.{attr} changed since setup_federation"):
        loop.fit(tiny_module(), tiny_datamodule())


def test_a_saved_helper_object_passes_and_library_objects_are_not_compared(tmp_path: Path) -> None:
    assert len(_fit(tmp_path, [SavedHelperObjectCount()]).history) == 2
    t, u = Tally(), Tally()
    assert plain_equal(t, u) and plain_equal(collections.deque([1, 2]), [1, 2])
    u.seen.append(1)
    assert not plain_equal(t, u)
    assert _plain(t) and not _plain(torch.Generator()) and not _plain(torch.nn.Linear(1, 1))
    assert not _plain(Message({"w": torch.ones(1)}))  # (the engine's own objects: not the user's state)


# ------------------------------------------------------------------------------------------------ the switch
def test_bad_mode_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"trainer.callback_contract='maybe' is invalid: expected one of error, warn"):
        tiny_loop(".", callback_contract="maybe")


@pytest.mark.slow
def test_the_cli_prints_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "contract_user_cb.py").write_text(
        "from pl_fedsparse import FederatedCallback\n\n"
        "class Scaffold(FederatedCallback):\n"
        "    def __init__(self):\n        self.c = 0.0\n\n"
        "    def on_client_fit_end(self, loop, module, update):\n        self.c += 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["fit", *TINY_CLI, "--trainer.num_rounds", "2", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--trainer.callbacks+", "contract_user_cb.Scaffold"]
    code, _, err = run_main(args, capsys)
    assert code == 2
    assert "Scaffold.c changed during a fit" in one_line(err)
    code, _, err = run_main([*args[:-4], "--trainer.default_root_dir", str(tmp_path / "run2"),
                             "--trainer.callback_contract", "warn", *args[-2:]], capsys)
    assert code == 0, err


# ------------------------------------------------------------------------------------------------ shipped methods
#: every shipped synthetic config (masks/DST, pFedGate, DM-PFL, FedPSE, FedRep, LG-FedAvg, FedEM, the baselines and
#: the top-level examples): two rounds each under the default `error`, ~1-2 s each
SHIPPED = sorted(p.stem for p in (REPO / "configs").glob("synthetic_*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.slow
def test_shipped_configs_keep_the_contract(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(REPO)  # the examples are imported as `callbacks.<file>`, as pl-fed does from the repo root
    monkeypatch.syspath_prepend(str(REPO))
    code, _, err = run_main(["fit", "--config", f"configs/{name}.yaml", "--trainer.num_rounds", "2",
                             "--data.num_clients", "6", "--trainer.enable_progress_bar", "false",
                             "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert code == 0, err


# ------------------------------------------------------------------------------------------------ Ray
@pytest.mark.slow
def test_a_violation_on_a_ray_worker_is_the_driver_error(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    cloudpickle = pytest.importorskip("ray.cloudpickle")
    from pl_fedsparse.executors import RayExecutor

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        loop = tiny_loop(tmp_path, callbacks=[CountInFit()], executor=RayExecutor(num_workers=2))
        with pytest.raises(CallbackContractError, match=r"CountInFit\.count changed during a fit \(client \d's"):
            loop.fit(tiny_module(), tiny_datamodule())
        assert loop.history == []
    finally:
        ray.shutdown()
