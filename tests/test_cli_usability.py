"""What a new user meets first: ``pl-fed --help`` lists every subcommand, ``pl-fed fit --help`` fits in a screen or
two, one callback's argument can be set from the command line, ``pl-fed configs`` prints whole descriptions, and a
long evaluation shows progress on a terminal only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import one_line, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import FederatedModule, shipped
from pl_fedsparse.callbacks import ShiftEvaluation
from pl_fedsparse.cli import FedCLI
from pl_fedsparse.cli.help import OWN_SUBCOMMANDS
from pl_fedsparse.cli.overrides import apply_callback_overrides, split_callback_overrides
from pl_fedsparse.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DMPFL = str(REPO / "configs" / "synthetic_dmpfl.yaml")  # DualMask, AdaptiveInference, ShiftEvaluation
SUBCOMMANDS = [*FedCLI.subcommands(), *OWN_SUBCOMMANDS]


@pytest.fixture(autouse=True)
def _columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Help and listings as on an 80-column terminal."""
    monkeypatch.setenv("COLUMNS", "80")


# ------------------------------------------------------------------------------------------------ pl-fed --help
@pytest.mark.parametrize("args", [[], ["--help"], ["-h"]])
def test_top_level_help_lists_every_subcommand(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(args, capsys)
    assert code == 0 and out.startswith("usage: pl-fed")
    assert SUBCOMMANDS == ["fit", "validate", "test", "configs", "report", "sweep"]
    assert "{" + ",".join(SUBCOMMANDS) + "}" in out
    listed = re.findall(r"^    (\w+) {2,}\S", out, flags=re.MULTILINE)
    assert listed == SUBCOMMANDS


def test_unknown_subcommand_lists_them_all(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fitt", "--config", "quickstart"], capsys)
    assert code == 2
    assert one_line(err) == ("error: unknown subcommand 'fitt': expected one of fit, validate, test, configs, report, "
                             "sweep (see `pl-fed --help`)")


# ------------------------------------------------------------------------------------------------ pl-fed fit --help
@pytest.mark.slow
def test_fit_help_is_short_and_complete() -> None:
    # in a fresh interpreter, as a user runs it: in the test process, the classes the test modules define (modules,
    # callbacks, executors) would be listed too
    res = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", "fit", "--help"], capture_output=True, text=True,
                         timeout=300, check=False, cwd=Path(__file__).resolve().parent.parent)
    code, out = res.returncode, res.stdout
    assert code == 0, res.stderr[-2000:]
    assert len(out.splitlines()) < 250, len(out.splitlines())  # was ~1,000 lines (675 torch.nn.Module classes)
    for option in ("--trainer.num_rounds", "--trainer.callbacks", "--trainer.client_state_codec", "--model.help",
                   "--data.help", "--trainer.callbacks.help", "--ckpt_path", "--seed_everything", "--print_config"):
        assert option in out, option
    # class choices summarised: the shipped ones by name, the frameworks' counted
    assert "lightning.pytorch.callbacks.EarlyStopping" not in out and "torch.nn.Linear" not in out
    flat = " ".join(out.split())
    assert "pl_fedsparse.callbacks.{" in flat and "DualMask" in flat and "more from lightning" in flat
    assert "`--trainer.callbacks.help CLASS` shows its arguments" in flat
    assert "pl-fed fit --model.help FederatedModule" in out  # the epilog says how to see a class's arguments
    assert "--trainer.callbacks.DualMask.iterations" in out


def test_class_help_is_short(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["fit", "--model.help", "FederatedModule"], capsys)
    assert code == 0 and len(out.splitlines()) < 80, len(out.splitlines())  # was ~700 (every torch.nn.Module)
    flat = " ".join(out.split())
    assert "--model.backbone" in flat and "pl_fedsparse.models.{" in flat and "LeNetCIFAR" in flat
    assert "torch.nn.Linear" not in out and "more from torch" in flat
    code, out, _ = run_main(["fit", "--model.help", "FederatedModule", "--model.backbone.help", "LeNetCIFAR"], capsys)
    assert code == 0 and "--model.backbone.num_classes" in out


# ------------------------------------------------------------------------------------------------ callback overrides
def _printed(args: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    code, out, err = run_main(["fit", "--config", DMPFL, *args, "--print_config"], capsys)
    assert code == 0, err
    return yaml.safe_load(out)


def _callbacks(cfg: dict) -> dict[str, dict]:
    return {cb["class_path"].rsplit(".", 1)[-1]: cb.get("init_args") or {} for cb in cfg["trainer"]["callbacks"]}


@pytest.mark.parametrize("args", [
    ["--trainer.callbacks.DualMask.iterations", "3"],
    ["--trainer.callbacks.0.iterations", "3"],
    ["--trainer.callbacks.DualMask.iterations=3"],
    ["--trainer.callbacks.pl_fedsparse.callbacks.DualMask.iterations", "3"],
])
def test_override_one_callback_by_name_or_index(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    base = _callbacks(_printed([], capsys))
    cbs = _callbacks(_printed(args, capsys))
    assert base["DualMask"]["iterations"] == 1 and cbs["DualMask"]["iterations"] == 3
    assert {k: v for k, v in cbs["DualMask"].items() if k != "iterations"} == \
        {k: v for k, v in base["DualMask"].items() if k != "iterations"}
    assert cbs["ShiftEvaluation"] == base["ShiftEvaluation"] and cbs["AdaptiveInference"] == base["AdaptiveInference"]


def test_overrides_of_several_callbacks_and_yaml_values(capsys: pytest.CaptureFixture[str]) -> None:
    cbs = _callbacks(_printed(["--trainer.callbacks.ShiftEvaluation.shifts", "[0.0, 1.0]",
                               "--trainer.callbacks.1.as_personal", "true",
                               "--trainer.callbacks.DualMask.alpha0", "5e-1",  # a float, as jsonargparse reads it
                               "--trainer.num_rounds", "3"], capsys))
    assert cbs["ShiftEvaluation"]["shifts"] == [0.0, 1.0] and cbs["AdaptiveInference"]["as_personal"] is True
    assert cbs["DualMask"]["alpha0"] == 0.5


def test_jsonargparse_form_still_sets_the_last_callback(capsys: pytest.CaptureFixture[str]) -> None:
    cbs = _callbacks(_printed(["--trainer.callbacks.when", "every"], capsys))
    assert cbs["ShiftEvaluation"]["when"] == "every"


@pytest.mark.parametrize("args, expected", [
    (["--trainer.callbacks.Foo.iterations", "2"],
     ("error: --trainer.callbacks.Foo.iterations: no configured callback is named 'Foo'; trainer.callbacks is "
      "[0: DualMask, 1: AdaptiveInference, 2: ShiftEvaluation]")),
    (["--trainer.callbacks.3.iterations", "2"],
     ("error: --trainer.callbacks.3.iterations: no callback at index 3; trainer.callbacks is "
      "[0: DualMask, 1: AdaptiveInference, 2: ShiftEvaluation]")),
    (["--trainer.callbacks+", "pl_fedsparse.callbacks.ShiftEvaluation", "--trainer.callbacks.ShiftEvaluation.when",
      "every"],
     ("error: --trainer.callbacks.ShiftEvaluation.when: 2 callbacks are named 'ShiftEvaluation' (indices 2, 3): "
      "address one by index, e.g. --trainer.callbacks.2.when")),
    (["--trainer.callbacks.DualMask.bogus", "2"],
     ("error: --trainer.callbacks.DualMask.bogus: DualMask (trainer.callbacks[0]) has no argument 'bogus'; its "
      "arguments: density, iterations")),
    (["--trainer.callbacks.DualMask.iterations", "many"],
     "error: --trainer.callbacks.DualMask.iterations=many is invalid: Expected a <class 'int'>"),
    (["--trainer.callbacks.DualMask.iterations", "-1"],
     "error: DualMask.iterations=-1 is invalid: expected an int >= 0"),  # the constructor's own check
    (["--trainer.callbacks.DualMask.iterations"],
     "error: --trainer.callbacks.DualMask.iterations expects a value"),
])
def test_override_errors_are_one_line(args: list[str], expected: str, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fit", "--config", DMPFL, "--trainer.default_root_dir", str(tmp_path / "run"),
                             "--trainer.num_rounds", "1", "--data.num_clients", "4", *args], capsys)
    assert code == 2
    assert one_line(err).startswith(expected), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_override_reaches_the_run_and_its_config_yaml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code, _, err = run_main(["fit", "--config", DMPFL, "--trainer.callbacks.ShiftEvaluation.shifts", "[0.25]",
                             "--trainer.callbacks.2.corruptions", "[]", "--trainer.callbacks.0.iterations", "1",
                             "--trainer.num_rounds", "2", "--trainer.eval_every", "2", "--data.num_clients", "4",
                             "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run)], capsys)
    assert code == 0, err
    saved = _callbacks(yaml.safe_load((run / "config.yaml").read_text()))
    assert saved["ShiftEvaluation"]["shifts"] == [0.25] and saved["ShiftEvaluation"]["corruptions"] == []
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert "shift25/acc_mean" in last and not any(k.startswith(("shift50/", "contrast")) for k in last)


def test_split_and_apply_are_plain_functions() -> None:
    rest, found = split_callback_overrides(["fit", "--trainer.callbacks.help", "DualMask", "--trainer.callbacks.x", "1",
                                            "--trainer.callbacks.init_args.x", "1", "--", "--trainer.callbacks.0.x"])
    assert found == [] and rest[1:4] == ["--trainer.callbacks.help", "DualMask", "--trainer.callbacks.x"]
    entries = [{"class_path": "a.B", "init_args": {"x": 1, "d": {"y": 2}}}]
    _, found = split_callback_overrides(["--trainer.callbacks.B.d.y", "3"])
    assert apply_callback_overrides(entries, found) == [{"class_path": "a.B", "init_args": {"x": 1, "d": {"y": 3}}}]
    assert entries[0]["init_args"]["d"]["y"] == 2  # not changed in place
    with pytest.raises(ConfigError, match=r"trainer.callbacks is \[none\]"):
        apply_callback_overrides([], found)


# ------------------------------------------------------------------------------------------------ pl-fed configs
def test_configs_prints_whole_descriptions_wrapped(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["configs"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert all(len(line) <= 80 or len(line.split()) == 1 for line in lines), max(lines, key=len)  # long file names
    flat = " ".join(out.split())
    # synthetic_dmpfl.yaml's three comment lines, whole; its example command left out
    assert ("DM-PFL+ end to end on the embedded synthetic task (no files, no network, ~30 s on 2 CPU cores): dual "
            "masks (Phase 1), global and personal refinement (Phase 2), adaptive inference, evaluated under 0/50/100 % "
            "shift and two corruptions. synthetic_fedavg.yaml") in flat
    assert "pl-fed fit --config configs/synthetic_dmpfl.yaml" not in out
    names = [line.split()[0] for line in lines if line[:1].strip()]
    assert names == list(shipped.shipped_configs())
    assert all(line.startswith("    ") for line in lines if not line[:1].strip())  # 80 columns: below the name


# ------------------------------------------------------------------------------------------------ evaluation progress
def test_evaluation_progress_only_when_enabled_and_numbers_unchanged(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    results = {}
    for show in (True, False):
        loop = tiny_loop(tmp_path / str(show), num_rounds=1, enable_progress_bar=show,
                         callbacks=[ShiftEvaluation(shifts=[0.0, 1.0], corruptions=[], severities=[1])])
        loop.fit(tiny_module(), tiny_datamodule())
        err = capsys.readouterr().err
        results[show] = loop.history
        assert (re.search(r"evaluating clients \(\d+ views x 2 models\):.* 0/4 ", err) is not None) is show, err
        assert "evaluating" not in (tmp_path / str(show)).joinpath("metrics.jsonl").read_text()
    strip = [{k: v for k, v in row.items() if "time" not in k} for row in results[True]]
    assert strip == [{k: v for k, v in row.items() if "time" not in k} for row in results[False]]


def test_a_later_class_path_says_which_init_args_it_drops(capsys: pytest.CaptureFixture[str],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """``--model.backbone.class_path X`` after a config that set arguments X does not take: jsonargparse drops them
    silently; pl-fed says which, once, on every command line (not on a class_path that stays the same)."""
    from conftest import TINY_CLI

    told = "pl_fedsparse.models.MLP was replaced by pl_fedsparse.models.ResNet18GN (a later class_path), which " \
           "does not take input_size=8: dropped"
    for _ in range(2):  # a second command line in the same process is told again
        caplog.clear()
        code, out, _ = run_main(["fit", *TINY_CLI, "--model.backbone.class_path", "pl_fedsparse.models.ResNet18GN",
                                 "--print_config"], capsys)
        assert code == 0
        assert "input_size" not in yaml.safe_load(out)["model"]["backbone"]["init_args"]
        assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [told]
    for same_or_unset in (["--model.backbone.class_path", "pl_fedsparse.models.MLP"],  # the same class
                          ["--model", "test_cli_usability.MyModule"]):  # only defaults (backbone=None) replaced
        caplog.clear()
        code, _, _ = run_main(["fit", *same_or_unset, *TINY_CLI, "--print_config"], capsys)
        assert code == 0 and not [r for r in caplog.records if r.levelname == "WARNING"]


class MyModule(FederatedModule):
    """A user's subclass (the default model section's class replaced by it)."""
