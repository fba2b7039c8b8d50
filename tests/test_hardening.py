"""Injected faults end cleanly: a disk that fills up (checkpoint, metrics.jsonl, run.json, TensorBoard, dataset
cache), SIGTERM at any moment (inside a fit, during an evaluation, during a checkpoint write), absurd sizes, and a
topology that cannot be built. Each ends in one line, with the right exit status, the lock released, nothing
half-written, and the last checkpoint intact and resumable."""

from __future__ import annotations

import builtins
import errno
import fnmatch
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_CLI, one_line, run_main

from pl_fedsparse.run.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]


def tiny(run: Path, *extra: str, rounds: int = 3) -> list[str]:
    return ["fit", *TINY_CLI, "--trainer.num_rounds", str(rounds), "--trainer.default_root_dir", str(run), *extra]


def rounds_in(run: Path) -> list[int]:
    return [json.loads(x)["round"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_clean(run: Path) -> None:
    """The lock is released and no temporary file is left anywhere in the run directory."""
    assert not (run / ".lock").exists(), sorted(p.name for p in run.iterdir())
    assert not [p for p in run.rglob("*.tmp")], [str(p) for p in run.rglob("*.tmp")]


# ------------------------------------------------------------------------------------------------- a full disk
class _Full(io.RawIOBase):
    """A file on a full disk: every write fails with ``code``."""

    def __init__(self, f: Any, code: int) -> None:
        self._f, self._code = f, code

    def write(self, data: Any) -> int:
        raise OSError(self._code, os.strerror(self._code))

    def writelines(self, lines: Any) -> None:
        raise OSError(self._code, os.strerror(self._code))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()
        super().close()


class FullDisk:
    """Every file opened for writing under ``root`` fails to take a write from the ``after``-th (0-based) opening of a
    file named like ``pattern`` on (the disk fills up then and stays full), until :meth:`free` is called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, pattern: str, after: int = 0,
                 code: int = errno.ENOSPC) -> None:
        self.real, self.root, self.pattern, self.after, self.code = io.open, str(root), pattern, after, code
        self.full, self.seen, self.failed = False, 0, []  # type: ignore[var-annotated]
        monkeypatch.setattr(builtins, "open", self.open)
        monkeypatch.setattr(io, "open", self.open)  # pathlib and os.fdopen open through io.open

    def free(self) -> None:
        self.full, self.after = False, 1 << 60

    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        f = self.real(file, mode, *args, **kwargs)
        if not any(c in mode for c in "wax+"):
            return f
        name = os.readlink(f"/proc/self/fd/{file}") if isinstance(file, int) else os.path.abspath(os.fsdecode(file))
        if not name.startswith(self.root):
            return f
        if not self.full and fnmatch.fnmatch(os.path.basename(name), self.pattern):
            self.full = self.seen >= self.after
            self.seen += 1
        if self.full:
            self.failed.append(name)
            return _Full(f, self.code)
        return f


pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="resolves file descriptors via /proc")


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    disk = FullDisk(monkeypatch, tmp_path, "*.ckpt*", after=1)  # the checkpoint before round 0 is written, not the next
    code, _, err = run_main(tiny(run), capsys)
    line = one_line(err)
    assert code == 74, err
    assert disk.failed and "No space left on device" in line and "the disk is full" in line, line
    assert_clean(run)
    # the previous checkpoint (no round completed yet), intact and safe to load
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["round"] == 0
    # space freed: the printed command resumes and completes the run
    disk.free()
    command = shlex.split(line.split("`")[1])
    assert command[:2] == ["pl-fed", "fit"]
    code, _, err = run_main(command[1:], capsys)
    assert code == 0, err
    assert sorted(set(rounds_in(run))) == [0, 1, 2]
    assert_clean(run)


@pytest.mark.parametrize(("pattern", "after", "names"), [("metrics.jsonl", 1, "metrics.jsonl"),
                                                         ("*run.json*", 0, "run.json"),
                                                         ("events.out.tfevents*", 0, "tensorboard")])
def test_disk_full_elsewhere_is_one_line(pattern: str, after: int, names: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    disk = FullDisk(monkeypatch, tmp_path, pattern, after=after)
    code, _, err = run_main(tiny(run, "--trainer.logger", "true"), capsys)
    line = one_line(err)
    assert disk.failed, "the fault was never reached"
    assert code == 74 and names in line and "No space left on device" in line, err
    assert_clean(run)


def test_a_full_disk_under_tensorboards_writer_thread_is_one_line_without_the_threads_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """TensorBoard writes its events on a thread of its own: a full disk there ends the run with the one line (exit
    74) and the thread does not print its own traceback too. (pytest catches thread exceptions itself, so a recording
    hook stands in for the console's here.)"""
    import threading

    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    run = tmp_path / "run"
    disk = FullDisk(monkeypatch, tmp_path, "events.out.tfevents*", after=0)
    code, _, err = run_main(tiny(run, "--trainer.logger", "true"), capsys)
    for t in threading.enumerate():  # the writer thread has ended (and reported) before we look
        if type(t).__name__ == "_AsyncWriterThread":
            t.join(10)
    assert disk.failed, "the fault was never reached"
    line = one_line(err)
    assert code == 74 and "tensorboard" in line and "No space left on device" in line, err
    assert seen == [], seen
    assert_clean(run)


@pytest.mark.parametrize(("code", "advice"), [(errno.EIO, "I/O error"), (errno.EROFS, "read-only"),
                                              (errno.EDQUOT, "quota")])
def test_other_storage_failures_are_one_line_too(code: int, advice: str, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    FullDisk(monkeypatch, tmp_path, "*.ckpt*", after=1, code=code)
    rc, _, err = run_main(tiny(run), capsys)
    line = one_line(err)
    assert rc == 74 and os.strerror(code) in line and advice in line and "last.ckpt" in line, err
    assert_clean(run)
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")


def test_a_dataset_cache_that_cannot_be_written_costs_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    from test_data_sources import write_folder

    from pl_fedsparse.data import FederatedDataModule

    write_folder(tmp_path / "imgs", per_class=8)
    monkeypatch.setenv("PL_FEDSPARSE_CACHE", str(tmp_path / "cache"))
    disk = FullDisk(monkeypatch, tmp_path / "cache", "*")
    dm = FederatedDataModule("image_folder", root=str(tmp_path / "imgs"), num_clients=2, batch_size=4)
    with caplog.at_level("WARNING", logger="pl_fedsparse"):
        dm.setup()  # the data is there, uncached
    assert disk.failed and dm.num_classes == 3
    assert any("was not written (No space left on device)" in r.getMessage() for r in caplog.records), caplog.text
    assert not list((tmp_path / "cache").rglob("*.tmp"))


# ----------------------------------------------------------------------------------------------------- SIGTERM
SIGNALLER = textwrap.dedent('''
    """Sends this process SIGTERM at a chosen moment (the tests' scheduler)."""
    import os, signal, time

    import pl_fedsparse.run.checkpoint as ck
    from pl_fedsparse import FederatedCallback


    ARMED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "armed")


    def _term():
        if not os.path.exists(ARMED):  # one signal per test: the resumed run is not signalled again
            return
        os.unlink(ARMED)
        os.kill(os.getpid(), getattr(signal, os.environ.get("SIGNALLER_SIGNAL", "SIGTERM")))
        time.sleep(5)  # the handler runs at the next bytecode; never reached when it works


    class SigtermAt(FederatedCallback):
        scratch_attributes = ("now",)  # set at every round's start

        def __init__(self, where: str = "fit", round: int = 1):
            self.where, self.round, self.now = where, round, -1
            if where == "checkpoint":
                original = ck._atomic

                def atomic(path, write):
                    def half(f):
                        if self.now == self.round and path.name.endswith(".ckpt"):
                            f.write(b"x" * 4096)  # half-written when the signal arrives
                            _term()
                        write(f)
                    return original(path, half)

                ck._atomic = atomic

        def on_round_start(self, loop, round_idx):
            self.now = round_idx

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if self.where == "fit" and self.now == self.round and batch_idx == 1:
                _term()

        def on_client_evaluate_start(self, loop, module, client_idx, kind):
            if self.where == "evaluate" and self.now == self.round and client_idx == 1:
                _term()
''')


@pytest.mark.parametrize("where, name", [("fit", "SIGTERM"), ("evaluate", "SIGTERM"), ("checkpoint", "SIGTERM"),
                                         ("fit", "SIGHUP")])
@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resumes(where: str, name: str, tmp_path: Path) -> None:
    """SIGTERM (a scheduler) and SIGHUP (the terminal closed) stop the run at any point with its checkpoint, its lock
    released, exit 128 + the signal and the command that resumes it."""
    (tmp_path / "signaller.py").write_text(SIGNALLER)
    run = tmp_path / "run"
    args = tiny(run, "--trainer.eval_every", "1", "--trainer.callbacks+", "signaller.SigtermAt",
                "--trainer.callbacks.where", where)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)]), "OMP_NUM_THREADS": "1",
           "SIGNALLER_SIGNAL": name}
    (tmp_path / "armed").touch()
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 128 + getattr(signal, name), res.stderr[-3000:]
    assert time.monotonic() - t0 < 120
    line = [x for x in res.stderr.splitlines() if x.startswith(f"terminated ({name})")]
    assert len(line) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert line[0].endswith("(the checkpoint holds 1 completed round, round 0 in metrics.jsonl; the resumed run "
                            "continues with round 2/3)"), line[0]  # the second round was cut
    assert_clean(run)
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")
    command = shlex.split(line[0].split("`")[1])
    assert command[:2] == ["pl-fed", "fit"]
    res = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", *command[1:]], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)  # the printed command resumes
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(set(rounds_in(run))) == [0, 1, 2]


# --------------------------------------------------------------------------------------- sizes and the topology
@pytest.mark.parametrize(("extra", "param"), [
    (["--data.synthetic", '{"num_train": 1000000000, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}'],
     "data.synthetic"),
    (["--data.synthetic", '{"num_train": 400, "num_test": 100, "size": 100000, "channels": 1, "num_classes": 4}'],
     "data.synthetic"),
])
def test_absurd_sizes_are_refused_in_seconds(extra: list[str], param: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    t0 = time.monotonic()
    code, _, err = run_main(tiny(run, *extra), capsys)
    assert code == 2 and one_line(err).startswith(f"error: {param}"), err
    assert time.monotonic() - t0 < 20
    assert not run.exists()


def test_client_state_beyond_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PL_FEDSPARSE_MEMORY_LIMIT", str(200_000))  # 200 kB: not 4 clients' masks and momentum
    run = tmp_path / "run"
    code, _, err = run_main(tiny(run, "--trainer.callbacks+", "pl_fedsparse.callbacks.SparseMask",
                                 "--trainer.callbacks.density", "0.5",
                                 "--data.synthetic", '{"num_train": 400, "num_test": 100, "size": 16, "channels": 3,'
                                 ' "num_classes": 4}', "--model.backbone.init_args.input_size", "16",
                                 "--model.backbone.init_args.in_channels", "3"), capsys)
    assert code == 2, err
    assert "data.num_clients" in one_line(err) or "data.synthetic" in one_line(err), err


def test_image_size_beyond_memory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from test_data_sources import write_folder

    from pl_fedsparse import ConfigError
    from pl_fedsparse.data import FederatedDataModule

    write_folder(tmp_path / "imgs", per_class=8)
    monkeypatch.setenv("PL_FEDSPARSE_CACHE", str(tmp_path / "cache"))
    dm = FederatedDataModule("image_folder", root=str(tmp_path / "imgs"), num_clients=2, image_size=50000)
    with pytest.raises(ConfigError, match=r"^data\.image_size=\[50000, 50000\] is invalid"):
        dm.setup()


def test_a_topology_that_cannot_be_built_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code, _, err = run_main(tiny(run, "--trainer.topology", "pl_fedsparse.topology.RandomPeers",
                                 "--trainer.topology.k", "10"), capsys)
    assert code == 2 and "k" in one_line(err), err
    assert not run.exists()


# ---------------------------------------------------------------------------------------------- a row per round
def test_every_round_has_a_row_with_its_faults_bytes_and_flops(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    code, _, err = run_main(tiny(run, "--trainer.eval_every", "2", "--trainer.join_ratio", "1.0",
                                 "--trainer.callbacks+", "pl_fedsparse.testing.FaultInjection",
                                 "--trainer.callbacks.client", "0", "--trainer.callbacks.rounds", "[2]",
                                 "--trainer.callbacks.kind", "exception", rounds=4), capsys)
    assert code == 0, err
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2, 3]
    assert [r["evaluated"] for r in rows] == [False, True, False, True]
    for r in rows:
        assert r["comm_bytes_total"] > 0 and r["flops_train"] > 0 and r["time_s"] > 0, r
        assert ("acc_mean" in r) == r["evaluated"], r  # evaluation columns only on evaluated rounds
    assert [r["client_faults"] for r in rows] == [0, 0, 1, 0]  # the fault of an unevaluated round is in its row
    summary = json.loads((run / "summary.json").read_text())
    assert summary["client_faults_total"] == 1
    assert summary["comm_cum_bytes_total"] == rows[-1]["comm_cum_bytes_total"] == sum(r["comm_bytes_total"]
                                                                                      for r in rows)


def test_a_signal_inside_a_deferred_block_lands_after_it() -> None:
    from pl_fedsparse.signals import Terminated, deferred_signals, stop_on_signals

    reached = []
    with pytest.raises(Terminated), stop_on_signals():
        with deferred_signals():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            reached.append("end of the block")  # the file this block creates is recorded before the signal lands
        reached.append("after the block")  # never: the signal is delivered when the block ends
    assert reached == ["end of the block"]


@pytest.mark.parametrize("value", ["-5", "abc", "nan", "inf"])
def test_a_memory_limit_that_is_no_size_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pl_fedsparse.errors import ConfigError
    from pl_fedsparse.resources import available_memory

    monkeypatch.setenv("PL_FEDSPARSE_MEMORY_LIMIT", value)
    with pytest.raises(ConfigError, match=rf"^PL_FEDSPARSE_MEMORY_LIMIT='{value}' is invalid: expected a number of "
                                          r"bytes >= 0$"):
        available_memory()
    monkeypatch.setenv("PL_FEDSPARSE_MEMORY_LIMIT", "1e9")
    assert available_memory() == 10**9
