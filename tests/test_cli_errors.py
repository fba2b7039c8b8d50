"""Faults at the ``pl-fed`` front end: imports from the working directory, one-line errors (parse errors, OS errors,
seeds), Ctrl-C, and the warning when ``clients_per_round`` is clamped."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import TINY_CLI, one_line, run_main

from pl_fedsparse import policies
from pl_fedsparse.cli import main
from pl_fedsparse.topology import Star

REPO = Path(__file__).resolve().parents[1]






def _ours(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.fixture
def user_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Top-level module names a test creates in its working directory: hidden from ``sys.modules`` during the test
    (a same-named module imported earlier, e.g. the repository's ``callbacks``, must not answer) and removed after,
    with whatever was there before put back."""
    names: list[str] = []
    saved = dict(sys.modules)
    yield names
    prefixes = tuple(names)
    for k in [k for k in sys.modules if _ours(k, prefixes)]:
        del sys.modules[k]
    sys.modules.update({k: v for k, v in saved.items() if _ours(k, prefixes)})


def hide_modules(monkeypatch: pytest.MonkeyPatch, *prefixes: str) -> None:
    for k in [k for k in sys.modules if _ours(k, prefixes)]:
        monkeypatch.delitem(sys.modules, k)


def console_script_path(monkeypatch: pytest.MonkeyPatch, cwd: Path) -> None:
    """``sys.path`` as under the ``pl-fed`` console script: neither the working directory nor the repository on it
    (``python -m pytest`` and tests/test_user_callbacks.py put them there)."""
    drop = {"", ".", str(cwd), str(REPO)}
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in drop and Path(p or ".").resolve() != cwd])


CALLBACKS = textwrap.dedent("""
    import sys

    import lightning.pytorch as pl

    from pl_fedsparse import FederatedCallback


    class InterruptAtRound(FederatedCallback):
        '''Ctrl-C at the start of a round (once: the flag file remembers it).'''

        def __init__(self, round_idx: int = 1, flag: str = "interrupted.flag", how: str = "keyboard"):
            self.round_idx, self.flag, self.how = round_idx, flag, how

        def on_round_start(self, loop, round_idx):
            if round_idx != self.round_idx or __import__("os").path.exists(self.flag):
                return
            open(self.flag, "w").close()
            if self.how == "keyboard":
                raise KeyboardInterrupt
            if self.how == "lightning":  # what Lightning's _call_and_handle_interrupt does
                try:
                    raise KeyboardInterrupt
                except KeyboardInterrupt:
                    sys.exit(1)
            sys.exit(int(self.how))  # a real exit, with its own status


    class InterruptInBatch(pl.Callback):
        '''Ctrl-C inside a client's Lightning fit (Lightning turns it into a graceful shutdown and sys.exit(1)).'''

        def __init__(self, round_idx: int = 1):
            self.round_idx = round_idx

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            from pl_fedsparse import current_fit

            if current_fit().round_idx == self.round_idx:
                raise KeyboardInterrupt


    class RaiseOSError(FederatedCallback):
        '''An OSError nobody handles, at the start of round 0.'''

        def __init__(self, code: str = "ENOSPC", filename: str = ""):
            self.code, self.filename = code, filename

        def on_round_start(self, loop, round_idx):
            import errno, os

            n = getattr(errno, self.code)
            if self.filename:
                raise OSError(n, os.strerror(n), self.filename)
            raise OSError(n, os.strerror(n))


    class OpensAFile(FederatedCallback):
        '''A constructor failing with an OSError (jsonargparse wraps what constructors raise).'''

        def __init__(self, path: str = "missing.txt"):
            open(path).close()
""")


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, user_modules: list[str]) -> Path:
    """A project folder (the working directory) with the test callbacks in ``faultcb.py``."""
    (tmp_path / "faultcb.py").write_text(CALLBACKS)
    user_modules.append("faultcb")
    monkeypatch.chdir(tmp_path)
    console_script_path(monkeypatch, tmp_path)
    return tmp_path


def tiny(run: Path, *extra: str, rounds: int = 2) -> list[str]:
    return ["fit", *TINY_CLI, "--trainer.num_rounds", str(rounds), "--trainer.default_root_dir", str(run), *extra]


def shadowing_project(folder: Path, package_init: bool) -> Path:
    """A project folder with a ``tensorboard.py`` that would shadow the installed package (it writes the returned
    marker file when imported) and a ``callbacks/usercb.py`` user callback; returns the marker's path."""
    marker = folder / "shadow-was-imported"
    (folder / "tensorboard.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (folder / "callbacks").mkdir()
    if package_init:
        (folder / "callbacks" / "__init__.py").write_text("")
    (folder / "callbacks" / "usercb.py").write_text(
        "from pl_fedsparse import FederatedCallback\n"
        "class Hello(FederatedCallback):\n"
        "    def on_federation_end(self, loop):\n"
        "        print('hello from callbacks/ in the project folder')\n")
    return marker


# ------------------------------------------------------------------------------------------------ 1. imports
@pytest.mark.parametrize("package_init", [True, False], ids=["package", "namespace-folder"])
@pytest.mark.slow
def test_working_dir_modules_import_but_never_shadow_installed_ones(
        package_init: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        user_modules: list[str]) -> None:
    marker = shadowing_project(tmp_path, package_init)
    user_modules.append("callbacks")
    hide_modules(monkeypatch, "callbacks")  # the repository's own callbacks/ may be imported by other tests
    # the real tensorboard must be imported *during* the run, so that a shadowing file would be picked up
    hide_modules(monkeypatch, "tensorboard", "torch.utils.tensorboard")
    user_modules += ["tensorboard", "torch.utils.tensorboard"]
    monkeypatch.chdir(tmp_path)
    console_script_path(monkeypatch, tmp_path)

    code, out, err = run_main(tiny(tmp_path / "run", "--trainer.logger", "true", "--trainer.callbacks+",
                                   "callbacks.usercb.Hello", rounds=1), capsys)

    assert code == 0, err
    assert not marker.exists(), "tensorboard.py in the working directory replaced the installed package"
    assert "hello from callbacks/ in the project folder" in out
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert not [f for f in sys.meta_path if type(f).__module__ == "pl_fedsparse.cli"]  # nothing left behind
    assert str(tmp_path) not in sys.path


PL_FED = Path(sys.executable).parent / "pl-fed"


@pytest.mark.skipif(not PL_FED.is_file(), reason="the pl-fed console script is not installed next to this Python")
@pytest.mark.slow
def test_console_script_from_a_project_folder(tmp_path: Path) -> None:
    """The real thing: a fresh `pl-fed` process in a folder with a `tensorboard.py` and a `callbacks/` package; and
    a configuration error there is exactly one line on stderr (no "Seed set to" line before it)."""
    marker = shadowing_project(tmp_path, package_init=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run([str(PL_FED), *tiny(tmp_path / "run", "--trainer.logger", "true", "--trainer.callbacks+",
                                               "callbacks.usercb.Hello", rounds=1)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert "hello from callbacks/ in the project folder" in proc.stdout
    proc = subprocess.run([str(PL_FED), *tiny(tmp_path / "bad", "--data.alpha", "-0.5")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == "error: data.alpha=-0.5 is invalid: expected a number > 0\n"


# ------------------------------------------------------------------------------------------------ 2. parse errors
@pytest.mark.parametrize("argv0", ["/venv/bin/pl-fed", "cli.py", "-c"])
def test_parse_errors_point_to_the_right_help(argv0: str, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", [argv0])
    code, _, err = run_main(["fit", "--bogus", "1"], capsys)
    assert code == 2
    assert one_line(err) == "error: unrecognized arguments: --bogus 1 (see `pl-fed fit --help`)"
    code, _, err = run_main(["bogus"], capsys)
    line = one_line(err)
    assert code == 2 and line.startswith("error: ") and "'bogus'" in line, line
    assert line.endswith("(see `pl-fed --help`)"), line
    code, _, err = run_main(["test", "--trainer.num_rounds", "x"], capsys)
    assert code == 2 and one_line(err).endswith("(see `pl-fed test --help`)")


USER_CLASSES = textwrap.dedent("""
    import torch
    from pl_fedsparse import FederatedModule

    class NeedsWidth(FederatedModule):
        def __init__(self, width: int, **kw):
            super().__init__(**kw)

    class PlainNet(torch.nn.Module):
        pass
""")


@pytest.mark.parametrize("key, value, expected", [
    ("model", "mine.NeedsWidth", "model.class_path='mine.NeedsWidth' is invalid: its __init__ requires width (give "
                                 "--model.init_args.width, or model.init_args in the config)"),
    ("model", "mine.PlainNet", "model.class_path='mine.PlainNet' is invalid: expected a lightning.pytorch."
                               "LightningModule subclass (a plain torch.nn.Module goes in as "
                               "model.init_args.backbone of pl_fedsparse.FederatedModule"),
    ("data", "mine.PlainNet", "data.class_path='mine.PlainNet' is invalid: expected a "
                              "pl_fedsparse.data.FederatedDataModule subclass"),
    ("model", "elsewhere.Net", "model.class_path='elsewhere.Net' is invalid: No module named 'elsewhere' (run "
                               "pl-fed from the folder that holds the module, or add that folder to PYTHONPATH)"),
])
def test_a_class_path_that_cannot_be_used_is_one_line(key: str, value: str, expected: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Not jsonargparse's account of every type it tried (a dozen lines folded into one): the key, the class path
    and what is allowed — also where the class path is in the config rather than on the command line."""
    (tmp_path / "mine.py").write_text(USER_CLASSES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({key: {"class_path": value}}))
    for how in (["--config", "c.yaml"], [f"--{key}.class_path", value]):
        code, _, err = run_main(["fit", *TINY_CLI, *how, "--trainer.default_root_dir", str(tmp_path / "run")],
                                capsys)
        assert code == 2, err
        line = one_line(err)
        assert line.startswith(f"error: {expected}"), line
        assert "Union subtypes" not in line and not (tmp_path / "run").exists()


def test_long_values_are_printed_in_full(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    value = "x" * 300 + "-the-end-" + "y" * 300
    code, _, err = run_main(["fit", *TINY_CLI, "--trainer.num_rounds", value], capsys)
    assert code == 2 and value in one_line(err)
    # a ConfigError from a constructor, with a long user value
    path = str(tmp_path / ("d" * 200) / ("e" * 200) / "cifar")
    code, _, err = run_main(["fit", *TINY_CLI, "--data.name", "cifar10", "--data.root", path,
                             "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert code == 2 and path in one_line(err)


# ------------------------------------------------------------------------------------------------ 3. OS errors
def test_run_dir_under_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file.txt").write_text("not a directory")
    run = tmp_path / "file.txt" / "run"
    code, _, err = run_main(tiny(run), capsys)
    line = one_line(err)
    assert code == 2 and line.startswith("error: ") and str(run) in line, line


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_parent_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, _, err = run_main(tiny(ro / "run"), capsys)
    finally:
        ro.chmod(0o700)
    line = one_line(err)
    assert code == 2 and str(ro / "run") in line, line


@pytest.mark.parametrize(
    ("code_name", "filename", "expected"),
    [
        ("ENOSPC", "", ["error: No space left on device (trainer.default_root_dir=", "the disk is full"]),
        ("EACCES", "/srv/elsewhere/data.bin", ["error: /srv/elsewhere/data.bin: Permission denied (",
                                              "fix the permissions"]),
        ("EEXIST", "{run}/checkpoints/x", ["error: {run}/checkpoints/x: File exists (trainer.default_root_dir="]),
        ("ENOTDIR", "{run}/a/b", ["error: {run}/a/b: Not a directory (", "is a file, not a directory"]),
    ],
)
def test_unhandled_os_errors_are_one_line(code_name: str, filename: str, expected: list[str], project: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "run"
    code, _, err = run_main(tiny(run, "--trainer.callbacks+", "faultcb.RaiseOSError", "--trainer.callbacks.code",
                                 code_name, "--trainer.callbacks.filename", filename.format(run=run)), capsys)
    line = one_line(err)
    assert code == (74 if code_name == "ENOSPC" else 2), err  # a storage failure: EX_IOERR
    for part in expected:
        assert part.format(run=run) in line, line
    if code_name == "EACCES":  # not under the run directory: the run directory is not blamed
        assert "default_root_dir" not in line


def test_os_error_in_a_constructor_is_one_line(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = project / "no" / "such.txt"
    code, _, err = run_main(tiny(project / "run", "--trainer.callbacks+", "faultcb.OpensAFile",
                                 "--trainer.callbacks.path", str(missing)), capsys)
    assert code == 2 and one_line(err).startswith(f"error: {missing}: No such file or directory")


# ------------------------------------------------------------------------------------------------ 4. seeds
@pytest.mark.parametrize("seed", ["-1", "4294967296", "-4294967296"])
def test_out_of_range_seed_is_refused_in_one_line(seed: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    args = [a for a in TINY_CLI]
    args[args.index("--seed_everything") + 1] = seed
    code, _, err = run_main(["fit", *args, "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    line = one_line(err)
    assert code == 2 and line.startswith(f"error: seed_everything={seed} is invalid"), line
    assert "[0, 4294967295]" in line and "true" in line
    assert not (tmp_path / "run").exists()


def test_seed_null_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main(["fit", *TINY_CLI, "--seed_everything", "null"], capsys)
    assert code == 2 and "seed_everything" in one_line(err)


@pytest.mark.slow
def test_seed_true_draws_a_recorded_seed_and_false_seeds_nothing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    seeds = []
    for name in ("a", "b"):
        code, _, err = run_main([*tiny(tmp_path / name, rounds=1), "--seed_everything", "true"], capsys)
        assert code == 0, err
        seed = yaml.safe_load((tmp_path / name / "config.yaml").read_text())["seed_everything"]
        assert isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed <= 2**32 - 1
        seeds.append(seed)
    assert seeds[0] != seeds[1]  # random (a clash has probability 2**-32)
    code, _, err = run_main([*tiny(tmp_path / "c", rounds=1), "--seed_everything", "false"], capsys)
    assert code == 0, err
    assert yaml.safe_load((tmp_path / "c" / "config.yaml").read_text())["seed_everything"] is False


def test_largest_seed_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main([*tiny(tmp_path / "r", rounds=1), "--seed_everything", "4294967295"], capsys)
    assert code == 0, err


# ------------------------------------------------------------------------------------------------ 5. Ctrl-C
def test_ctrl_c_between_rounds_exits_130_and_the_hint_resumes(project: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "run"
    handler = signal.getsignal(signal.SIGINT)
    code, _, err = run_main(tiny(run, "--trainer.callbacks+", "faultcb.InterruptAtRound"), capsys)
    assert code == 130, err
    line = one_line(err, "interrupted")
    ckpt = run / "checkpoints" / "last.ckpt"
    assert line.startswith("interrupted: resume with `pl-fed fit ") and f"--ckpt_path {ckpt}`" in line, line
    assert signal.getsignal(signal.SIGINT) is handler
    # the printed command resumes the run and completes it
    command = shlex.split(line.split("`")[1])
    assert command[:2] == ["pl-fed", "fit"]
    code, _, err = run_main(command[1:], capsys)
    assert code == 0, err
    rows = [yaml.safe_load(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1]


def test_the_resume_hint_is_a_shell_command_for_any_path(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run directory with a space and a quote in its name: the printed command, split as a shell splits it,
    resumes the run."""
    run = project / "my run's dir"
    code, _, err = run_main(tiny(run, "--trainer.callbacks+", "faultcb.InterruptAtRound"), capsys)
    assert code == 130, err
    line = one_line(err, "interrupted")
    command = shlex.split(line.split("`")[1])
    assert command[command.index("--trainer.default_root_dir") + 1] == str(run)
    code, _, err = run_main(command[1:], capsys)
    assert code == 0, err
    assert [yaml.safe_load(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_accelerator_that_is_not_there_is_one_line_and_nothing_is_written(tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main([*tiny(tmp_path / "run", rounds=1), "--trainer.accelerator", "gpu"], capsys)
    assert code == 2
    assert "trainer.accelerator='gpu' is invalid: expected cpu or auto (no CUDA device" in one_line(err)
    assert not (tmp_path / "run").exists()


def test_ctrl_c_inside_a_lightning_fit_exits_130(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "run"
    handler = signal.getsignal(signal.SIGINT)
    code, _, err = run_main(tiny(run, "--trainer.callbacks+", "faultcb.InterruptInBatch"), capsys)
    assert code == 130, err
    assert f"--ckpt_path {run / 'checkpoints' / 'last.ckpt'}`" in one_line(err, "interrupted")
    assert signal.getsignal(signal.SIGINT) is handler  # Lightning set SIG_IGN while shutting down


def test_lightnings_interrupt_exit_is_an_interrupt(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """sys.exit(1) raised while handling a KeyboardInterrupt (Lightning's shutdown), if it escapes a fit."""
    run = project / "run"
    code, _, err = run_main(tiny(run, "--trainer.callbacks+", "faultcb.InterruptAtRound",
                                 "--trainer.callbacks.how", "lightning"), capsys)
    assert code == 130 and one_line(err, "interrupted").startswith("interrupted: resume with"), err


def test_other_exits_are_not_swallowed(project: Path) -> None:
    with pytest.raises(SystemExit) as info:
        main(tiny(project / "run", "--trainer.callbacks+", "faultcb.InterruptAtRound",
                  "--trainer.callbacks.how", "3"))
    assert info.value.code == 3


def test_ctrl_c_without_a_checkpoint_says_so(project: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = project / "run"
    code, _, err = run_main(tiny(run, "--trainer.checkpoint_every", "0", "--trainer.callbacks+",
                                 "faultcb.InterruptAtRound"), capsys)
    assert code == 130
    assert one_line(err, "interrupted") == (f"interrupted: no checkpoint was written in {run} (trainer.checkpoint_every=0), "
                             "the run cannot be resumed")


def test_ctrl_c_before_this_runs_first_checkpoint_beside_a_stray_one(project: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A ``checkpoints/last.ckpt`` this run did not write (put there by hand: no run file, no metrics) is not taken
    for the run's own when it is interrupted before writing one."""
    run = project / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"not this run's")
    code, _, err = run_main(tiny(run, "--trainer.checkpoint_every", "0", "--trainer.callbacks+",
                                 "faultcb.InterruptAtRound"), capsys)
    assert code == 130
    assert one_line(err, "interrupted") == (f"interrupted: no checkpoint was written in {run} "
                                            "(trainer.checkpoint_every=0), the run cannot be resumed")


# ------------------------------------------------------------------------------------------------ 6. clamping
class _StubLoop:
    """What the default ``select_clients`` reads of a federation (a plain object, not a ``SimpleNamespace``: the
    policy remembers the federations it warned about by weak reference, like a loop, hashed by identity)."""

    def __init__(self, **attributes: Any) -> None:
        vars(self).update(attributes)


def _stub_loop(clients_per_round: int | None, num_clients: int = 4) -> _StubLoop:
    from pl_fedsparse.streams import Streams

    return _StubLoop(topology=Star(), seed=0, clients_per_round=clients_per_round, join_ratio=1.0,
                     num_clients=num_clients, streams=Streams(0))


def test_clamped_clients_per_round_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    loop = _stub_loop(10)
    with caplog.at_level(logging.WARNING, logger="pl_fedsparse.policies"):
        for r in range(3):
            assert policies.select_clients(loop, r, range(4)) == [0, 1, 2, 3]  # type: ignore[arg-type]
    msgs = [r.getMessage() for r in caplog.records if r.name == "pl_fedsparse.policies"]
    assert len(msgs) == 1, msgs
    assert "trainer.clients_per_round=10" in msgs[0] and "4 clients" in msgs[0]
    caplog.clear()
    other = _stub_loop(10)  # another run warns again
    with caplog.at_level(logging.WARNING, logger="pl_fedsparse.policies"):
        policies.select_clients(other, 0, range(4))  # type: ignore[arg-type]
    assert len([r for r in caplog.records if r.name == "pl_fedsparse.policies"]) == 1


@pytest.mark.parametrize("clients_per_round", [None, 2, 4])
def test_no_warning_without_clamping(clients_per_round: int | None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pl_fedsparse.policies"):
        policies.select_clients(_stub_loop(clients_per_round), 0, range(4))  # type: ignore[arg-type]
    assert not [r for r in caplog.records if r.name == "pl_fedsparse.policies"]


def test_clamped_clients_per_round_warns_once_per_cli_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pl_fedsparse.policies"):
        code, _, err = run_main([*tiny(tmp_path / "run", rounds=3), "--trainer.clients_per_round", "10"], capsys)
    assert code == 0, err
    msgs = [r.getMessage() for r in caplog.records if r.name == "pl_fedsparse.policies"]
    assert len(msgs) == 1 and "trainer.clients_per_round=10" in msgs[0] and "4 clients" in msgs[0], msgs


@pytest.mark.parametrize("option", ["--trainer.default_root_dir", "--ckpt_path"])
def test_an_empty_path_is_refused_not_taken_for_no_path(option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``--ckpt_path "$CKPT"`` with the variable unset is an empty string: a new run elsewhere (or from scratch)
    would start silently instead of the resume asked for."""
    monkeypatch.chdir(tmp_path)
    extra = [option, ""] if option == "--ckpt_path" else []
    root = "" if option != "--ckpt_path" else str(tmp_path / "run")
    code, _, err = run_main(["fit", *TINY_CLI, "--trainer.default_root_dir", root, *extra], capsys)
    assert code == 2, err
    name = option.removeprefix("--")
    assert one_line(err).startswith(f"error: {name}='' is invalid: expected "), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, expected", [
    (["--model.backbone", "mine_broken.Net"], "model.backbone.class_path='mine_broken.Net' is invalid: importing it "
                                              "failed: No module named 'no_such_dependency' (a module it imports is "
                                              "not installed)"),
    (["--config", "typo.yaml"], "data.batchsize is invalid: expected an argument of "
                                "pl_fedsparse.data.FederatedDataModule's __init__ (did you mean batch_size?)"),
    (["--data.batch_size", "abc"], "data.batch_size='abc' is invalid: expected an int"),
    (["--trainer.callbacks+", "torch.nn.Linear"], "trainer.callbacks='torch.nn.Linear' is invalid: expected a "
                                                  "lightning.pytorch.Callback subclass"),
    (["--trainer.eval_metrics", "[auc]"], "trainer.eval_metrics is invalid: 'auc' is not one of 'f1_macro', 'ece'"),
    (["--seed_everything", "abc"], "seed_everything='abc' is invalid: expected true or false or an int"),
    (["--trainer.topology", "Foo"], "trainer.topology='Foo' is invalid: expected a class path"),
])
def test_a_value_jsonargparse_refuses_is_named_in_one_line(args: list[str], expected: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The option as the user wrote it (nested: ``model.backbone``, ``data.batchsize``), the value and what is
    allowed — not the union of every type jsonargparse tried, with the whole section it was given."""
    (tmp_path / "mine_broken.py").write_text("import no_such_dependency\n")
    (tmp_path / "typo.yaml").write_text("data:\n  batchsize: 32\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run_main(["fit", *TINY_CLI, *args, "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert code == 2, err
    line = one_line(err)
    assert line.startswith(f"error: {expected}"), line
    assert "Union subtypes" not in line and "Given value" not in line
