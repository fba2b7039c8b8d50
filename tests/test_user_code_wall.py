"""The user's code behind one wall: what their module, data module or training step does wrong ends in one line
naming the class, the hook and where (model check, client, round), with nothing written before a refusal; a round in
which every fit failed stops the run (exit 1) unless ``trainer.on_client_fault: continue``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY_CLI, one_line, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import FederatedCallback
from pl_fedsparse.errors import ConfigError, UserCodeError, user_code

MODULES = '''
import torch
from pl_fedsparse import FederatedModule
from pl_fedsparse.data import FederatedDataModule

class InitRaises(FederatedModule):
    def __init__(self, **kw):
        super().__init__(**kw)
        raise ValueError("my init is broken")

class ForwardValueError(FederatedModule):
    def forward(self, x):
        raise ValueError("bad forward")

class EvalForwardRaises(FederatedModule):
    def forward(self, x):
        if not self.training:
            raise KeyError("eval broke")
        return super().forward(x)

class WrongRows(FederatedModule):
    def forward(self, x):
        out = super().forward(x)
        return out if self.training else out[:-1]

class LateEvalFails(FederatedModule):
    def forward(self, x):
        if not self.training and x.shape[0] == 7:
            raise IndexError("no row 7")
        return super().forward(x)

class StepNone(FederatedModule):
    def training_step(self, batch, batch_idx):
        return None

class DictWithoutLoss(FederatedModule):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return {"Loss": out} if batch_idx % 2 else {"loss": out}

class DictLossNone(FederatedModule):
    def training_step(self, batch, batch_idx):
        return {"loss": None}

class FloatLoss(FederatedModule):
    def training_step(self, batch, batch_idx):
        return float(super().training_step(batch, batch_idx))

class OptimizersNone(FederatedModule):
    configure_optimizers = None

class StepIndexesBatch(FederatedModule):
    def training_step(self, batch, batch_idx):
        return self.helper(batch)

    def helper(self, batch):
        return batch["x"]

class NanLoss(FederatedModule):
    def loss(self, logits, y):
        return super().loss(logits, y) * float("nan")

class BackboneRaises(torch.nn.Module):
    def __init__(self, num_classes: int = 4):
        super().__init__()
        raise ValueError("my backbone cannot be built")

class BrokenData(FederatedDataModule):
    def load_base_dataset(self):
        raise ZeroDivisionError("my loader divides by zero")
'''

_MODEL = ["--model.init_args.backbone", "pl_fedsparse.models.MLP", "--model.init_args.backbone.init_args.num_classes",
          "4", "--model.init_args.backbone.init_args.in_channels", "1",
          "--model.init_args.backbone.init_args.input_size", "8"]


@pytest.fixture()
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "usermods.py").write_text(MODULES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _fit(project: Path, model: str, *extra: str) -> list[str]:
    data = TINY_CLI[TINY_CLI.index("--data.name"):]
    return ["fit", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar",
            "false", "--model", f"usermods.{model}", *_MODEL, *data, "--trainer.num_rounds", "2",
            "--trainer.default_root_dir", str(project / "run"), *extra]


@pytest.mark.parametrize("model, code, expected", [
    ("InitRaises", 1, "usermods.InitRaises.__init__ raised: my init is broken"),
    ("ForwardValueError", 1, "ForwardValueError.forward raised ValueError: bad forward (the model check: a batch of "
                             "2 from data.name='synthetic')"),
    ("EvalForwardRaises", 1, "EvalForwardRaises.forward raised KeyError: 'eval broke' (the model check: a batch of "
                             "2 from data.name='synthetic', eval mode)"),
    ("WrongRows", 2, "model=WrongRows is invalid: expected forward(x) in eval mode to return one row of logits per "
                     "input, got 1 rows for a batch of 2"),
])
def test_a_broken_module_is_one_line_before_anything_is_written(project: Path, model: str, code: int,
                                                                 expected: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    got, _, err = run_main(_fit(project, model), capsys)
    assert got == code, err
    assert expected in one_line(err)
    assert not (project / "run").exists()


def test_a_failing_backbone_is_named_not_the_module_holding_it(project: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """jsonargparse names only the outermost class it was building (``model``); the line names the backbone."""
    data = TINY_CLI[TINY_CLI.index("--data.name"):]
    args = ["fit", "--seed_everything", "0", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
            "--model", "pl_fedsparse.FederatedModule", "--model.init_args.backbone", "usermods.BackboneRaises", *data,
            "--trainer.num_rounds", "2", "--trainer.default_root_dir", str(project / "run")]
    code, _, err = run_main(args, capsys)
    assert code == 1, err
    assert "usermods.BackboneRaises.__init__ raised: my backbone cannot be built" in one_line(err)
    assert not (project / "run").exists()


def test_a_forward_failing_in_a_later_evaluation_names_the_clients_and_round(project: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(_fit(project, "LateEvalFails", "--data.eval_batch_size", "7"), capsys)
    assert code == 1, err
    line = one_line(err)
    assert "LateEvalFails.forward raised IndexError: no row 7 (client" in line and "round 0, evaluation)" in line


def test_a_data_module_whose_loading_raises_is_one_line(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _fit(project, "InitRaises")
    i = args.index("--model")
    del args[i:i + 2 + len(_MODEL)]
    j = args.index("--data.name")
    args[j:j + 2] = ["--data", "usermods.BrokenData"]
    args = [a for a in args if a != "--data.synthetic" and not a.startswith('{"num_train"')]
    args = ["--data.init_args." + a[len("--data."):] if a.startswith("--data.") else a for a in args]
    code, _, err = run_main([*args, "--model.backbone", "pl_fedsparse.models.MLP"], capsys)
    assert code == 1, err
    assert "BrokenData.load_base_dataset raised ZeroDivisionError: my loader divides by zero" in one_line(err)
    assert not (project / "run").exists()


def test_training_step_returning_none_is_named_and_a_round_of_failures_stops(project: Path,
                                                                              capsys: pytest.CaptureFixture[str]
                                                                              ) -> None:
    code, _, err = run_main(_fit(project, "StepNone"), capsys)
    assert code == 1, err
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert last.startswith("error: round 0: every participant's fit failed (no_loss x4; the first: client 0: "
                           "no_loss: training_step returned None for all"), last
    assert "Traceback" not in err


@pytest.mark.parametrize("model, fit_runner, expected", [
    ("DictWithoutLoss", "auto", "DictWithoutLoss.training_step returned a dict without a 'loss' tensor (keys: 'Loss'): "
                                "expected the loss tensor, a dict holding it under 'loss', or None to skip the batch"),
    ("DictLossNone", "auto", "DictLossNone.training_step returned a dict whose 'loss' is a NoneType: expected"),
    ("FloatLoss", "auto", "FloatLoss.training_step returned a float: expected the loss tensor"),
    ("DictWithoutLoss", "trainer", "when `training_step` returns a dict, the 'loss' key needs to be present "
                                   "(DictWithoutLoss; Lightning's Trainer, client 0, round 0)"),
])
def test_a_training_step_output_lightning_refuses_is_refused_in_one_line(
        project: Path, model: str, fit_runner: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    """What Lightning's ``Trainer`` refuses from ``training_step`` (a dict without a loss tensor, a float) is refused
    by the persistent fit runner too — not trained as a skipped step (half the batches, silently) — and the
    reference path's refusal is the same kind of line (exit 2: the user's code to fix, not a client fault)."""
    code, _, err = run_main(_fit(project, model, "--trainer.fit_runner", fit_runner), capsys)
    assert code == 2, err
    assert expected in one_line(err) and "Traceback" not in err


def test_configure_optimizers_that_is_not_a_method_is_refused_at_the_model_check(
        project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(_fit(project, "OptimizersNone"), capsys)
    assert code == 2, err
    assert "model=OptimizersNone is invalid: expected a LightningModule that defines configure_optimizers()" in err
    assert not (project / "run").exists()


def test_a_fit_that_raises_names_the_users_class_and_method(project: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A client fault names the innermost method of the user's own code the exception came from; with
    ``on_client_fault: raise`` the run stops at it in one line (exit 1), its traceback on ``PL_FED_DEBUG=1``."""
    code, _, err = run_main(_fit(project, "StepIndexesBatch"), capsys)
    assert code == 1, err
    assert ("the first: client 0: exception: StepIndexesBatch.helper raised TypeError: tuple indices must be "
            "integers or slices, not str") in one_line(err), err
    code, _, err = run_main(_fit(project, "StepIndexesBatch", "--trainer.on_client_fault", "raise",
                                 "--trainer.overwrite", "true"), capsys)
    assert code == 1, err
    assert err.splitlines()[-1] == (
        "error: round 0: client 0's train fit failed (exception: StepIndexesBatch.helper raised TypeError: tuple "
        "indices must be integers or slices, not str); trainer.on_client_fault=raise (PL_FED_DEBUG=1 prints its "
        "traceback)"), err
    assert "Traceback" not in err
    monkeypatch.setenv("PL_FED_DEBUG", "1")
    for extra in ([], ["--trainer.on_client_fault", "raise"]):
        code, _, err = run_main(_fit(project, "StepIndexesBatch", "--trainer.overwrite", "true", *extra), capsys)
        assert code == 1, err
        assert "Traceback" in err and 'return batch["x"]' in err, err
        assert err.splitlines()[-1].startswith("error: round 0: "), err


def test_nan_losses_everywhere_stop_the_run_unless_told_to_continue(project: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(_fit(project, "NanLoss"), capsys)
    assert code == 1, err
    assert "every participant's fit failed (nonfinite_loss x4" in err.splitlines()[-1]
    assert (project / "run" / "checkpoints" / "last.ckpt").exists()  # the round-0 start checkpoint is intact
    code, _, err = run_main(_fit(project, "NanLoss", "--trainer.on_client_fault", "continue", "--trainer.overwrite",
                                 "true"), capsys)
    assert code == 0, err


def test_debug_prints_the_users_traceback(project: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_FED_DEBUG", "1")
    code, _, err = run_main(_fit(project, "ForwardValueError"), capsys)
    assert code == 1
    assert "Traceback" in err and 'raise ValueError("bad forward")' in err
    assert err.rstrip().splitlines()[-1].startswith("error: ForwardValueError.forward raised ValueError")


def test_user_code_lets_the_engines_own_errors_and_interrupts_through() -> None:
    for exc in (ConfigError("x is invalid"), FileNotFoundError(2, "No such file", "f"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with user_code(object(), "hook"):
                raise exc
    with pytest.raises(UserCodeError, match=r"^object\.hook raised TypeError: t \(here\)$"):
        with user_code(object(), "hook", "here"):
            raise TypeError("t")


class _Personal(FederatedCallback):
    """Owns the personal model: the global state, edited by ``edit``."""

    def __init__(self, edit: Any) -> None:
        self.edit = edit

    def personal_state(self, loop: Any, client_idx: int) -> Any:
        return self.edit(dict(loop.global_state))


@pytest.mark.parametrize("edit, expected", [
    (lambda s: {k: v for k, v in s.items() if k.endswith("weight")},
     "_Personal.personal_state returned a state without backbone.layers.0.bias, backbone.layers.2.bias (client 0, "
     "round 0): expected the whole model's state, every entry of module.state_dict() with its shape"),
    (lambda s: {**s, "backbone.layers.0.weight": s["backbone.layers.0.weight"].t()},
     "_Personal.personal_state returned backbone.layers.0.weight of shape (64, 16) instead of (16, 64)"),
    (lambda s: {**s, "extra": torch.ones(1)}, "_Personal.personal_state returned entries the model does not have: "
                                              "extra"),
    (lambda s: list(s.values()), "_Personal.personal_state returned a list that is not a dict of tensors"),
])
def test_a_personal_state_that_is_not_the_whole_model_is_one_line(tmp_path: Path, edit: Any, expected: str) -> None:
    """A partial personal state would be evaluated over what the working module last held (another client's
    weights), silently; a wrong shape would fail deep in a copy."""
    loop = tiny_loop(tmp_path, callbacks=[_Personal(edit)])
    with pytest.raises(UserCodeError) as err:
        loop.fit(tiny_module(), tiny_datamodule())
    assert str(err.value).startswith(expected), str(err.value)
    assert len(loop.history) == 0


def test_a_whole_personal_state_passes(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path, num_rounds=1, callbacks=[_Personal(lambda s: s)])
    loop.fit(tiny_module(), tiny_datamodule())
    assert len(loop.history) == 1
