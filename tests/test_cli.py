"""The ``pl-fed`` command line: --print_config, overrides, a real tiny fit, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import TINY_CLI

from pl_fedsparse.cli import main

REPO = Path(__file__).resolve().parents[1]


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as e:  # jsonargparse exits on parse errors and after --print_config
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_print_config_applies_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["fit", "--config", str(REPO / "configs/quickstart.yaml"), "--trainer.num_rounds", "3",
                             "--data.alpha", "0.7", "--data.num_clients", "8", "--print_config"], capsys)
    assert code == 0
    cfg = yaml.safe_load(out)
    assert cfg["trainer"]["num_rounds"] == 3
    assert cfg["data"]["alpha"] == 0.7 and cfg["data"]["num_clients"] == 8
    assert cfg["trainer"]["callbacks"][0]["class_path"] == "pl_fedsparse.callbacks.FineTune"


def test_tiny_fit_writes_run_and_config_reproduces_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    args = ["fit", *TINY_CLI, "--trainer.num_rounds", "2", "--trainer.default_root_dir", str(run)]
    code, out, err = run_main(args, capsys)
    assert code == 0, err
    assert "final results" in out
    for name in ("metrics.jsonl", "summary.json", "config.yaml"):
        assert (run / name).is_file()
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["trainer"]["num_rounds"] == 2 and cfg["seed_everything"] == 0
    # the saved config reproduces the run
    run2 = tmp_path / "again"
    code, _, err = run_main(["fit", "--config", str(run / "config.yaml"), "--trainer.default_root_dir", str(run2)],
                            capsys)
    assert code == 0, err

    def rows(d: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
                for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert rows(run) == rows(run2)


def test_resume_from_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    base = ["fit", *TINY_CLI, "--trainer.default_root_dir", str(run)]
    assert run_main([*base, "--trainer.num_rounds", "1"], capsys)[0] == 0
    code, out, err = run_main([*base, "--trainer.num_rounds", "2", "--ckpt_path",
                               str(run / "checkpoints/last.ckpt")], capsys)
    assert code == 0, err
    assert [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_test_subcommand_evaluates_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert run_main(["fit", *TINY_CLI, "--trainer.num_rounds", "1", "--trainer.default_root_dir", str(run)],
                    capsys)[0] == 0
    code, out, err = run_main(["test", *TINY_CLI, "--ckpt_path", str(run / "checkpoints/last.ckpt")], capsys)
    assert code == 0, err
    assert "test results" in out


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (["--data.alpha", "0"], "data.alpha=0"),
        (["--data.alpha", "-1"], "data.alpha=-1"),
        (["--trainer.join_ratio", "1.5"], "trainer.join_ratio=1.5"),
        (["--trainer.join_ratio", "0"], "trainer.join_ratio=0"),
        (["--data.num_clients", "100000"], "data.num_clients=100000"),
        (["--data.name", "imagenet"], "imagenet"),
        (["--data.name", "cifar10", "--data.root", "/nonexistent/cifar"], "data.root='/nonexistent/cifar'"),
        (["--trainer.precision", "8-mixed"], "trainer.precision='8-mixed'"),
        (["--trainer.num_rounds", "0"], "trainer.num_rounds=0"),
    ],
)
def test_bad_input_is_one_line(override: list[str], expected: str, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code, out, err = run_main(["fit", *TINY_CLI, "--trainer.default_root_dir", str(run), *override], capsys)
    assert code != 0
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and expected in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (run / "metrics.jsonl").exists()  # nothing half-written


def test_missing_dataset_says_how_to_get_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fit", *TINY_CLI, "--data.name", "cifar10", "--data.root", str(tmp_path)], capsys)
    assert code != 0 and "download" in err and "tar -xzf" in err


def test_checkpoint_of_another_config_via_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert run_main(["fit", *TINY_CLI, "--trainer.num_rounds", "1", "--trainer.default_root_dir", str(run)],
                    capsys)[0] == 0
    code, _, err = run_main(["fit", *TINY_CLI, "--data.num_clients", "5", "--trainer.default_root_dir",
                             str(tmp_path / "other"), "--ckpt_path", str(run / "checkpoints/last.ckpt")], capsys)
    assert code == 2 and err.count("\n") == 1 and "another configuration" in err and "num_clients" in err


@pytest.mark.slow
def test_console_script_subprocess_no_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", "fit", *TINY_CLI, "--data.alpha", "-0.5",
                           "--trainer.default_root_dir", str(tmp_path / "r")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.alpha=-0.5")


def test_project_folder_classes_are_importable(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mycb.py").write_text(
        "from pl_fedsparse import FederatedCallback\n"
        "class Hello(FederatedCallback):\n"
        "    def on_federation_end(self, loop):\n"
        "        print('hello from the project folder')\n")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["fit", *TINY_CLI, "--trainer.num_rounds", "1", "--trainer.callbacks+", "mycb.Hello",
                               "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert "hello from the project folder" in out


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_parses(config: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every config in configs/ resolves (class paths, argument names and types) with --print_config."""
    code, out, err = run_main(["fit", "--config", str(REPO / "configs" / config), "--print_config"], capsys)
    assert code == 0, err
    cfg = yaml.safe_load(out)
    assert cfg["trainer"]["num_rounds"] >= 1


@pytest.mark.slow
def test_synthetic_dmpfl_config_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The README's DM-PFL demo (shortened): dual masks, both phases, adaptive inference, shift metrics."""
    run = tmp_path / "dm"
    code, out, err = run_main(["fit", "--config", str(REPO / "configs/synthetic_dmpfl.yaml"),
                               "--trainer.num_rounds", "4", "--trainer.eval_every", "4",
                               "--data.num_clients", "6", "--trainer.default_root_dir", str(run)], capsys)
    assert code == 0, err
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("acc_mean", "global_acc", "adaptive_acc", "shift100/acc_mean", "shift100/adaptive_acc",
                "contrast_s3/global_acc", "shift_avg/adaptive_acc", "adaptive_chose_personal"):
        assert 0.0 <= last[key] <= 1.0, key
    assert last["dmpfl_phase"] == 2


@pytest.mark.slow
def test_a_run_prints_no_jsonargparse_deprecation_and_keeps_nulls(tmp_path: Path) -> None:
    """jsonargparse >= 4.49 renamed dump's ``skip_none`` to ``skip_unset`` and warns on every run that passes the old
    name (Lightning's callers still do); the CLI passes the name the installed version knows, and config.yaml keeps
    the ``null`` values either way."""
    env = {**os.environ, "JSONARGPARSE_DEPRECATION_WARNINGS": "all", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", "fit", "--config",
                          str(REPO / "configs" / "synthetic_fedavg.yaml"), "--trainer.num_rounds", "1",
                          "--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path / "run")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "skip_none" not in res.stderr and "skip_unset" not in res.stderr, res.stderr[-2000:]
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert "ckpt_path" in cfg and cfg["ckpt_path"] is None  # a None value is written, not skipped
