"""The persistent fit runner drives a LightningModule as ``Trainer.fit`` does: the same hooks in the same order, the
same weights, optimizer state and learning rates bit for bit on the CPU, and no Trainer built or module moved per
fit. Every comparison runs both paths on the same start."""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from conftest import TINY_CLI, one_line, run_main, tiny_datamodule, tiny_module

from pl_fedsparse import ConfigError, FederatedLoop, FederatedModule
from pl_fedsparse.context import current_fit
from pl_fedsparse.executors.base import FitMeter
from pl_fedsparse.executors.runner import (
    FitRunner,
    FitTrainer,
    RunnerUnsupported,
    ignores_batch_outputs,
    runner_support,
)

HOOKS = ("setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end", "on_train_epoch_start",
         "on_train_epoch_end", "on_train_batch_start", "on_train_batch_end", "on_before_backward",
         "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad")


class Recorder(pl.Callback):
    """Records every in-fit hook with what it reads of the trainer."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []


def _recording(hook: str) -> Any:
    def fn(self: Recorder, trainer: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        opt = trainer.optimizers[0] if trainer.optimizers else None
        lr = opt.param_groups[0]["lr"] if opt is not None else None
        extra: tuple[Any, ...] = ()
        if hook == "on_train_batch_end":
            outputs = args[0]
            extra = (sorted(outputs), float(outputs["loss"]), args[2])
        elif hook == "on_before_backward":
            extra = (float(args[0]),)
        elif hook == "on_after_backward":
            extra = (float(sum(p.grad.abs().sum() for p in module.parameters() if p.grad is not None)),)
        self.calls.append((hook, trainer.current_epoch, trainer.global_step, lr, *extra))
    return fn


for _h in HOOKS:
    setattr(Recorder, _h, _recording(_h))


class Net(pl.LightningModule):
    """A module that logs, reads its trainer, and can skip the rest of an epoch or return a dict."""

    def __init__(self, sched: str | None = None, as_dict: bool = False, skip_at: int | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                        torch.nn.Linear(8, 3))
        self.sched, self.as_dict, self.skip_at = sched, as_dict, skip_at
        self.seen: list[tuple[Any, ...]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.body(x), y)
        self.log("train_loss", loss)
        self.seen.append(("step", self.current_epoch, self.global_step, self.trainer.current_epoch, batch_idx))
        return {"loss": loss, "n": y.shape[0]} if self.as_dict else loss

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(("batch_start", batch_idx))
        return -1 if self.skip_at is not None and batch_idx == self.skip_at else None

    def on_train_epoch_end(self) -> None:
        self.seen.append(("epoch_end", self.current_epoch))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
        if self.sched == "epoch":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}
        if self.sched == "step":
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9), "interval": "step", "frequency": 2}}
        return opt


def _loader(n: int = 20, batch: int = 6) -> Any:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True,
                                       generator=torch.Generator().manual_seed(1))


def _trainer_fit(module: pl.LightningModule, loader: Any, callbacks: list[Any], max_epochs: int, max_steps: int,
                 precision: str, clip: float | None) -> None:
    """The reference: a fresh Trainer, built as the in-process executor builds it."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, max_epochs=max_epochs,  # type: ignore[arg-type]
                             max_steps=max_steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             limit_val_batches=0, gradient_clip_val=clip)
        trainer.fit(module, train_dataloaders=loader)


def _both(max_epochs: int = 2, max_steps: int = -1, precision: str = "32-true", clip: float | None = None,
          limit: int | float | None = None, **net: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    torch.manual_seed(0)
    base = Net(**net)
    out = []
    for path in ("trainer", "runner"):
        module, rec, meter = copy.deepcopy(base), Recorder(), FitMeter()
        if limit is not None:
            rec = _LimitedRecorder(limit)
        torch.manual_seed(3)  # dropout draws from the global generator on both paths
        if path == "trainer":
            _trainer_fit(module, _loader(), [rec, meter], max_epochs, max_steps, precision, clip)
        else:
            FitRunner(torch.device("cpu"), precision, clip).fit(module, _loader(), [rec, meter],
                                                                 max_epochs=max_epochs, max_steps=max_steps)
        out.append((rec.calls, module.seen, {k: v.clone() for k, v in module.state_dict().items()},
                    meter.metrics(), torch.rand(1).item()))
    return tuple(out[0]), tuple(out[1])


class _LimitedRecorder(Recorder):
    def __init__(self, limit: int | float) -> None:
        super().__init__()
        self.limit = limit

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        super().setup(trainer, module, stage=stage)
        trainer.limit_train_batches = self.limit


def _assert_same(ref: tuple[Any, ...], fast: tuple[Any, ...]) -> None:
    assert fast[0] == ref[0]  # every callback hook, in order, with the trainer's epoch, step and learning rate
    assert fast[1] == ref[1]  # the module's own hooks and what it reads of its trainer
    assert fast[2].keys() == ref[2].keys()
    for k in ref[2]:
        assert torch.equal(fast[2][k], ref[2][k]), k  # bit for bit
    assert {k: repr(v) for k, v in fast[3].items()} == {k: repr(v) for k, v in ref[3].items()}  # (NaN == NaN)
    assert fast[4] == ref[4]  # the global RNG is where the reference leaves it


@pytest.mark.parametrize("case", [
    dict(max_epochs=2),
    dict(max_epochs=3, sched="epoch"),
    dict(max_epochs=2, sched="step"),
    dict(max_epochs=-1, max_steps=5),  # a step limit across epochs (4 batches an epoch)
    dict(max_epochs=2, clip=0.05),
    dict(max_epochs=2, as_dict=True),
    dict(max_epochs=2, skip_at=2),  # on_train_batch_start returns -1: the rest of the epoch is skipped
    dict(max_epochs=2, dropout=0.3),
    dict(max_epochs=2, precision="bf16-mixed"),
    dict(max_epochs=2, limit=0),  # no training batch (a client without data): the train hooks do not run
    dict(max_epochs=2, limit=2, sched="epoch"),
    dict(max_epochs=2, limit=0.5),
], ids=["epochs", "epoch-scheduler", "step-scheduler-freq2", "max-steps", "clip", "dict-output", "skip-rest",
        "dropout", "bf16-mixed", "limit-0", "limit-2", "limit-half"])
def test_runner_equals_trainer_fit(case: dict[str, Any]) -> None:
    ref, fast = _both(**case)
    _assert_same(ref, fast)


def test_the_comparison_can_fail() -> None:
    """A planted difference (the runner calls ``on_train_epoch_end`` before the epoch's last batch ends, i.e. a
    wrong hook order; and a wrong clipping norm) is caught."""
    ref, fast = _both(max_epochs=2, clip=0.05)
    calls = list(fast[0])
    i = next(j for j, c in enumerate(calls) if c[0] == "on_train_epoch_end")
    calls[i - 1], calls[i] = calls[i], calls[i - 1]
    with pytest.raises(AssertionError):
        _assert_same(ref, (calls, *fast[1:]))
    ref2, fast2 = _both(max_epochs=2, clip=0.5)
    with pytest.raises(AssertionError):
        _assert_same(ref, fast2)


def test_trainer_attributes_the_runner_lacks_name_the_way_back() -> None:
    trainer = FitTrainer(FitRunner(torch.device("cpu")))
    with pytest.raises(AttributeError, match=r"trainer\.val_check_interval is not available.*fit_runner trainer"):
        _ = trainer.val_check_interval


def test_runner_support_names_what_it_cannot_do() -> None:
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    class OwnStep(Net):
        def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
            super().optimizer_step(*args, **kwargs)

    assert runner_support(Net()) is None
    assert runner_support(Manual()) == "Manual uses manual optimization"
    assert runner_support(OwnStep()) == "OwnStep overrides optimizer_step"

    class TwoOptims(Net):
        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.2)]

    with pytest.raises(RunnerUnsupported, match="2 optimizers"):
        FitRunner(torch.device("cpu")).fit(TwoOptims(), _loader(), [], max_epochs=1, max_steps=-1)


# ------------------------------------------------------------------------------------------------ in the engine
def _count_trainers_and_moves(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"trainers": 0, "moves": 0}
    init, to = pl.Trainer.__init__, torch.nn.Module.to

    def counting_init(self: Any, *a: Any, **k: Any) -> None:
        counts["trainers"] += 1
        init(self, *a, **k)

    def counting_to(self: Any, *a: Any, **k: Any) -> Any:
        if isinstance(self, pl.LightningModule) and current_fit() is not None:  # (evaluation places it once a round)
            counts["moves"] += 1
        return to(self, *a, **k)

    monkeypatch.setattr(pl.Trainer, "__init__", counting_init)
    monkeypatch.setattr(torch.nn.Module, "to", counting_to)
    return counts


@pytest.mark.parametrize("fit_runner", ["auto", "trainer"])
def test_no_trainer_and_no_module_move_per_fit_on_the_runner(fit_runner: str, tmp_path: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted per fit over two rounds of four clients after the first fit: 0 Trainers and 0 module moves on the
    runner; the reference path builds one Trainer per fit (which is what this test would see if the runner were
    bypassed)."""
    loop = FederatedLoop(num_rounds=3, local_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         checkpoint_every=0, default_root_dir=str(tmp_path), fit_runner=fit_runner)
    loop.setup(tiny_module(), tiny_datamodule(num_clients=4))
    loop.run_round(0)  # warm: the first fit may place the module
    counts = _count_trainers_and_moves(monkeypatch)
    loop.run_round(1)
    loop.run_round(2)
    loop.reporter.release()
    if fit_runner == "auto":
        assert counts == {"trainers": 0, "moves": 0}
    else:
        assert counts["trainers"] == 8


def _rows(run: Any) -> list[dict[str, Any]]:
    import json

    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["synthetic_fedspa", "synthetic_pfedgate", "synthetic_fedrep"])
@pytest.mark.slow
def test_method_configs_give_the_same_numbers_on_both_paths(config: str, tmp_path: Any,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Masks (prune-and-regrow, gradient-based regrowth), pFedGate's gate optimiser inside the step and FedRep's
    head/body epochs: identical metrics, bytes and FLOPs."""
    rows = {}
    for path in ("auto", "trainer"):
        run = tmp_path / path
        code, _, err = run_main(["fit", "--config", f"configs/{config}.yaml", "--trainer.num_rounds", "2",
                                 "--trainer.eval_every", "1", "--trainer.fit_runner", path,
                                 "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run)],
                                capsys)
        assert code == 0, err
        rows[path] = _rows(run)
    assert rows["auto"] == rows["trainer"]


def test_fit_runner_fast_where_it_cannot_apply_is_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "manualnet.py").write_text('''
import torch
from pl_fedsparse import FederatedModule

class ManualNet(FederatedModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = self.loss(self(x), y)
        self._step_losses.add(loss, int(y.shape[0]))  # (FederatedModule's fit_metrics: what training_step saw)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss
''')
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = TINY_CLI[TINY_CLI.index("--data.name"):]
    model = ["--model", "manualnet.ManualNet", "--model.init_args.backbone", "pl_fedsparse.models.MLP",
             "--model.init_args.backbone.init_args.num_classes", "4",
             "--model.init_args.backbone.init_args.in_channels", "1",
             "--model.init_args.backbone.init_args.input_size", "8"]
    base = ["fit", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar",
            "false", *model, *data, "--trainer.num_rounds", "1"]
    code, _, err = run_main([*base, "--trainer.fit_runner", "fast", "--trainer.default_root_dir",
                             str(tmp_path / "fast")], capsys)
    assert code == 2
    line = one_line(err)
    assert "trainer.fit_runner='fast' is invalid here: ManualNet uses manual optimization" in line
    assert not (tmp_path / "fast" / "checkpoints").exists() or not any((tmp_path / "fast" / "checkpoints").iterdir())
    code, _, err = run_main([*base, "--trainer.default_root_dir", str(tmp_path / "auto")], capsys)
    assert code == 0, err  # auto: a Trainer per fit for this module
    code, _, err = run_main([*base, "--trainer.fit_runner", "quick", "--trainer.default_root_dir",
                             str(tmp_path / "bad")], capsys)
    assert code == 2 and "fit_runner" in err and "Traceback" not in err


@pytest.mark.parametrize("fit_runner", ["auto", "trainer"])
def test_a_module_without_an_optimizer_is_a_one_line_error_on_both_paths(fit_runner: str, tmp_path: Any) -> None:
    """``configure_optimizers`` returning ``None`` (Lightning: a warning, then a fit with no optimizer, so the client
    would upload its start weights unchanged) fails the fit with one line naming the method; a manual-optimisation
    module may return ``None``."""
    from pl_fedsparse.errors import UserCodeError

    module = tiny_module()
    module.configure_optimizers = lambda: None  # type: ignore[method-assign]
    loop = FederatedLoop(num_rounds=1, local_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         checkpoint_every=0, default_root_dir=str(tmp_path), fit_runner=fit_runner,
                         on_client_fault="raise")
    loop.setup(module, tiny_datamodule(num_clients=2))
    with pytest.raises(UserCodeError, match=r"configure_optimizers\(\) returned no optimizer: a local fit needs one"):
        loop.run_round(0)
    loop.reporter.release()


class _Keeper(pl.Callback):
    """Keeps what ``on_train_batch_end`` is given as the loss."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"])


class _Marked(pl.Callback):
    calls = 0

    @ignores_batch_outputs
    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        _Marked.calls += 1


class _MarkedThenReading(_Marked):
    """A subclass whose override reads the outputs, without the mark."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"])


def _step_losses(callbacks: list[Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """The runner's step results (what ``on_train_batch_end`` would get) and the losses ``training_step`` returned,
    over one epoch of :class:`Net`."""
    torch.manual_seed(0)
    module, returned, outputs = Net(), [], []
    step, train = FitRunner._step, Net.training_step

    def spy_step(*a: Any, **k: Any) -> Any:
        outputs.append(step(*a, **k))
        return outputs[-1]

    def spy_train(self: Any, *a: Any) -> Any:
        returned.append(train(self, *a))
        return returned[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(FitRunner, "_step", staticmethod(spy_step))
        mp.setattr(Net, "training_step", spy_train)
        FitRunner(torch.device("cpu")).fit(module, _loader(), callbacks, max_epochs=1, max_steps=-1)
    return outputs, returned


@pytest.mark.parametrize("callbacks, copied", [
    (lambda: [], False), (lambda: [_Marked()], False), (lambda: [_Keeper()], True),
    (lambda: [_Marked(), _Keeper()], True), (lambda: [_MarkedThenReading()], True), (lambda: [FitMeter()], True),
], ids=["none", "marked", "reader", "marked-and-reader", "unmarked-override", "fit-meter"])
def test_the_steps_loss_is_copied_only_for_hooks_that_may_read_it(callbacks: Any, copied: bool) -> None:
    """``outputs["loss"]`` is a detached copy of the step's loss, as Lightning gives it, wherever a hook of
    ``on_train_batch_end`` may read it (a callback's not marked ``ignores_batch_outputs``, an override in a subclass
    of a marked one, the module's own); without such a hook, the loss is only detached (no copy: on a GPU a kernel
    launch a step). The values are the same either way."""
    outputs, returned = _step_losses(callbacks())
    assert len(outputs) == len(returned) == 4
    for out, loss in zip(outputs, returned):
        assert torch.equal(out["loss"], loss) and not out["loss"].requires_grad
        assert (out["loss"].data_ptr() != loss.data_ptr()) is copied


def test_a_modules_own_batch_end_hook_gets_a_copy() -> None:
    """The module's own ``on_train_batch_end`` may read the outputs: the loss it is given is a copy."""

    class Reading(Net):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            self.seen.append(("loss", loss))
            return loss

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.seen.append(("given", outputs["loss"]))

    torch.manual_seed(0)
    module = Reading()
    FitRunner(torch.device("cpu")).fit(module, _loader(), [], max_epochs=1, max_steps=-1)
    returned = [e[1] for e in module.seen if e[0] == "loss"]
    given = [e[1] for e in module.seen if e[0] == "given"]
    assert len(returned) == len(given) == 4
    assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(returned, given))


class _Logs(FederatedModule):
    """Logs in ``training_step`` (``mode``: Lightning's default flags, or ``on_epoch=True``) and, once an epoch,
    at its end with ``on_epoch=True``."""

    def __init__(self, mode: str = "step", **kw: Any) -> None:
        super().__init__(**kw)
        self.mode = mode

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        if self.mode == "step":
            self.log("my_loss", loss * 2)
        else:
            self.log("my_loss", loss * 2, on_step=False, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        self.log("epoch_marker", float(self.current_epoch + 1), on_epoch=True)


def _logging_rows(tmp_path: Any, fit_runner: str, mode: str = "step") -> list[dict[str, Any]]:
    from conftest import tiny_module as tiny

    backbone = tiny().backbone
    loop = FederatedLoop(num_rounds=2, local_epochs=2, accelerator="cpu", logger=False, enable_progress_bar=False,
                         checkpoint_every=0, default_root_dir=str(tmp_path / fit_runner), fit_runner=fit_runner)
    loop.fit(_Logs(mode, backbone=backbone), tiny_datamodule(num_clients=4))
    return _rows(tmp_path / fit_runner)


def test_what_a_fit_logs_reaches_the_rounds_row_as_on_the_trainer(tmp_path: Any) -> None:
    """``self.log`` in a fit: each fit's last value of each name, averaged over the round's fits, in the row as
    ``logged/<name>`` (metrics.jsonl, TensorBoard) — the same numbers on the runner as through Lightning's Trainer
    (a value logged once an epoch with ``on_epoch=True`` too: there is nothing to reduce)."""
    rows = _logging_rows(tmp_path, "auto")
    assert rows == _logging_rows(tmp_path, "trainer")
    assert all(r["logged/epoch_marker"] == 2.0 for r in rows)  # (the last epoch's)
    assert all(isinstance(r["logged/my_loss"], float) and r["logged/my_loss"] > 0 for r in rows)
    assert rows[0]["logged/my_loss"] != rows[1]["logged/my_loss"]


def test_an_epoch_reduction_the_runner_does_not_make_is_one_line(tmp_path: Any) -> None:
    """``on_epoch=True`` in ``training_step`` asks Lightning for an epoch mean; the runner keeps last values, so
    it refuses (naming the Trainer path, which makes the mean) rather than record another number."""
    with pytest.raises(ConfigError, match=r"^_Logs logged 'my_loss' with on_epoch=True: the persistent fit runner "
                                          r"keeps each name's last value .* --trainer.fit_runner trainer"):
        _logging_rows(tmp_path, "auto", mode="epoch")
    rows = _logging_rows(tmp_path, "trainer", mode="epoch")
    assert all(r["logged/my_loss"] > 0 for r in rows)
