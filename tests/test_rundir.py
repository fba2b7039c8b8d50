"""The run directory: one run per directory (a lock), run ids, a resume is the same run (configuration), kept round
checkpoints, hygiene (stale temporary files, umask, TensorBoard on resume) and one-line file-system errors."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import TINY_CLI, fit_until_interrupted, one_line, run_main, tiny_datamodule, tiny_loop, tiny_module

from pl_fedsparse import ConfigError, FederatedCallback
from pl_fedsparse.run import directory as rundir
from pl_fedsparse.errors import CheckpointError
from pl_fedsparse.run.checkpoint import load_checkpoint, save_checkpoint
from pl_fedsparse.run.config_diff import config_changes

REPO = Path(__file__).resolve().parents[1]

# a callback that blocks a run in round 0 (after the start checkpoint) until a file appears
BLOCKER = '''
import os, time
from pl_fedsparse import FederatedCallback

class Block(FederatedCallback):
    def on_round_start(self, loop, round_idx):
        go = os.environ.get("GO_FILE")
        if go and round_idx == 0:
            open(os.environ["BLOCKED_FILE"], "w").close()
            t = time.time()
            while not os.path.exists(go) and time.time() - t < 240:
                time.sleep(0.05)
'''






def digest(root: Path) -> dict[str, str]:
    """md5 of every file below ``root`` (hidden ones included)."""
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def rows(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def run_id(run: Path) -> str:
    return json.loads((run / "run.json").read_text())["run_id"]


def cli_fit(run: Path, *extra: str) -> list[str]:
    return ["fit", *TINY_CLI, "--trainer.default_root_dir", str(run), *extra]


def spawn(run: Path, tmp: Path, *extra: str, go: Path | None = None, blocked: Path | None = None
          ) -> subprocess.Popen[str]:
    (tmp / "blockcb.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    if go is not None and blocked is not None:
        env.update(GO_FILE=str(go), BLOCKED_FILE=str(blocked))
    return subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", *cli_fit(run, "--trainer.callbacks+",
                                                                                 "blockcb.Block", *extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def wait_for(cond: Any, what: str, timeout: float = 240) -> None:
    t = time.time()
    while not cond():
        assert time.time() - t < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------ one run per dir
@pytest.mark.slow
def test_two_concurrent_starts_into_one_directory_exactly_one_runs(tmp_path: Path) -> None:
    run, go = tmp_path / "run", tmp_path / "go"
    procs = [spawn(run, tmp_path, "--trainer.num_rounds", "2", go=go, blocked=tmp_path / f"blocked{i}")
             for i in range(2)]
    try:
        # the process that holds the directory waits in round 0 until the other one has ended
        wait_for(lambda: any(p.poll() is not None for p in procs), "one of the two runs to end")
        loser = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not loser)
        _, err = loser.communicate()
        assert loser.returncode == 2, err
        assert "Traceback" not in err
        errors = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
        line = errors[0]
        assert f"trainer.default_root_dir='{run}' is invalid: another run (pid {winner.pid} " in line, line
        go.touch()
        _, err = winner.communicate(timeout=240)
        assert winner.returncode == 0, err
    finally:
        go.touch()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [r["round"] for r in rows(run)] == [0, 1]  # one run's rows, not interleaved
    assert not (run / ".lock").exists()  # released at the end


def held_run(run: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    """A finished 1-round run in ``run``, then held open by an in-process reporter (as a running process would)."""
    assert run_main(cli_fit(run, "--trainer.num_rounds", "1"), capsys)[0] == 0
    holder = tiny_loop(run, num_rounds=2)
    holder.reporter.open(resuming=True, history=[], checkpoint=load_checkpoint(run / "checkpoints/last.ckpt"))
    return holder


def test_a_held_directory_is_refused_and_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    holder = held_run(run, capsys)
    try:
        before = {k: v for k, v in digest(run).items() if k != ".lock"}
        code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "2", "--ckpt_path",
                                        str(run / "checkpoints/last.ckpt")), capsys)
        assert code == 2
        assert f"another run (pid {os.getpid()} " in one_line(err)
        assert {k: v for k, v in digest(run).items() if k != ".lock"} == before
        assert (run / ".lock").exists()  # still the holder's
    finally:
        holder.reporter.release()
    assert not (run / ".lock").exists()
    # once released, the directory can be resumed
    code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "2", "--ckpt_path",
                                    str(run / "checkpoints/last.ckpt")), capsys)
    assert code == 0, err


def test_release_is_idempotent_and_safe_before_open(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path / "r")
    loop.reporter.release()  # never opened
    loop.reporter.open(resuming=False, history=[])
    assert (tmp_path / "r" / ".lock").exists()
    loop.reporter.release()
    loop.reporter.release()
    assert not (tmp_path / "r" / ".lock").exists()


def test_default_directories_of_runs_started_in_the_same_second_differ(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a, b = tiny_loop(tmp_path), tiny_loop(tmp_path)
    a.default_root_dir = b.default_root_dir = None
    try:
        da = a.reporter.open(resuming=False, history=[])
        db = b.reporter.open(resuming=False, history=[])
        assert da != db and da.parent == db.parent == Path("runs")
    finally:
        a.reporter.release()
        b.reporter.release()


@pytest.mark.slow
def test_stale_lock_of_a_killed_run_is_taken_over_and_its_directory_reused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    run, go, blocked = tmp_path / "run", tmp_path / "go", tmp_path / "blocked"
    proc = spawn(run, tmp_path, "--trainer.num_rounds", "2", go=go, blocked=blocked)
    try:
        wait_for(lambda: blocked.exists() or proc.poll() is not None, "the run to reach round 0")
        assert proc.poll() is None, proc.communicate()[1]
        killed_id = run_id(run)
        os.kill(proc.pid, signal.SIGKILL)  # killed right after the start: no round completed
        proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert json.loads((run / ".lock").read_text())["pid"] == proc.pid  # left behind
    assert (run / "checkpoints" / "round-000000.ckpt").is_file()
    assert (run / "metrics.jsonl").read_text() == ""
    with caplog.at_level(logging.INFO, logger="pl_fedsparse.run.directory"):
        code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "2"), capsys)  # a plain rerun
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("stale lock" in m and f"pid {proc.pid} " in m for m in warnings), warnings
    assert any("no round completed" in m for m in infos), infos
    assert [r["round"] for r in rows(run)] == [0, 1]
    assert run_id(run) != killed_id
    assert not (run / ".lock").exists()


def test_rerun_allowed_only_where_no_round_completed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def interrupted(run: Path, at: int) -> None:
        loop = tiny_loop(run, num_rounds=3, eval_every=2)
        real = loop.run_round

        def stop(r: int) -> dict[str, Any]:
            if r == at:
                raise KeyboardInterrupt
            return real(r)

        loop.run_round = stop  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            loop.fit(tiny_module(), tiny_datamodule())

    interrupted(tmp_path / "none", 0)
    with caplog.at_level(logging.INFO, logger="pl_fedsparse.run.directory"):
        tiny_loop(tmp_path / "none", num_rounds=1).fit(tiny_module(), tiny_datamodule())
    assert any("no round completed" in r.getMessage() for r in caplog.records)
    # the previous run's checkpoints do not mix with the new run's
    assert sorted(p.name for p in (tmp_path / "none/checkpoints").iterdir()) == [
        "last.ckpt", "round-000000.ckpt", "round-000001.ckpt"]
    assert load_checkpoint(tmp_path / "none/checkpoints/round-000000.ckpt")["run_id"] == run_id(tmp_path / "none")

    interrupted(tmp_path / "one", 1)  # round 0 completed (not evaluated: its row has no accuracy; it was saved)
    rows = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["evaluated"], "acc_mean" in r) for r in rows] == [(0, False, False)]
    before = digest(tmp_path / "one")
    with pytest.raises(ConfigError, match="already holds a run"):
        tiny_loop(tmp_path / "one", num_rounds=1).fit(tiny_module(), tiny_datamodule())
    assert digest(tmp_path / "one") == before


# ------------------------------------------------------------------------------------------------ run ids
def test_resume_into_another_runs_directory_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_loop(a, num_rounds=1, logger=True).fit(tiny_module(), tiny_datamodule())
    tiny_loop(b, num_rounds=1, logger=True).fit(tiny_module(), tiny_datamodule())
    id_a, id_b = run_id(a), run_id(b)
    assert id_a != id_b
    ckpt = a / "checkpoints" / "last.ckpt"
    assert load_checkpoint(ckpt)["run_id"] == id_a
    (b / "checkpoints" / ".last.ckpt.junk.tmp").write_bytes(b"x")  # would be removed by a run that took b
    before = digest(b)
    with pytest.raises(ConfigError) as e:
        tiny_loop(b, num_rounds=2, logger=True).fit(tiny_module(), tiny_datamodule(), ckpt_path=str(ckpt))
    msg = str(e.value)
    assert "\n" not in msg
    assert id_a in msg and id_b in msg and str(ckpt) in msg and str(b) in msg and repr(str(a)) in msg
    assert digest(b) == before
    # into a new directory, the checkpoint's run continues there
    tiny_loop(tmp_path / "c", num_rounds=2).fit(tiny_module(), tiny_datamodule(), ckpt_path=str(ckpt))
    assert run_id(tmp_path / "c") == id_a
    assert load_checkpoint(tmp_path / "c/checkpoints/last.ckpt")["run_id"] == id_a


def test_fresh_runs_get_distinct_ids_kept_in_every_checkpoint(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path / "r", num_rounds=2, keep_checkpoints=5)
    summary = loop.fit(tiny_module(), tiny_datamodule())
    rid = run_id(tmp_path / "r")
    assert len(rid) == 32 and summary["run_id"] == rid and summary["resumes"] == []
    for p in (tmp_path / "r/checkpoints").iterdir():
        assert load_checkpoint(p)["run_id"] == rid
    tiny_loop(tmp_path / "s", num_rounds=1).fit(tiny_module(), tiny_datamodule())
    assert run_id(tmp_path / "s") != rid


# ------------------------------------------------------------------------------------------------ same configuration
def test_resume_with_a_changed_learning_rate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert run_main(cli_fit(run, "--trainer.num_rounds", "1"), capsys)[0] == 0
    before = digest(run)
    code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "2", "--model.lr", "0.5", "--data.batch_size", "8",
                                    "--ckpt_path", str(run / "checkpoints/last.ckpt")), capsys)
    assert code == 2
    line = one_line(err)
    assert "ckpt_path=" in line and "keys that change results: data.batch_size 16 -> 8, model.lr 0.01 -> 0.5;" in line
    assert "num_rounds" not in line  # allowed
    assert "resume with the run's config.yaml" in line
    assert digest(run) == before


def test_resume_with_more_rounds_is_allowed_and_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert run_main(cli_fit(run, "--trainer.num_rounds", "1"), capsys)[0] == 0
    rid = run_id(run)
    code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "3", "--trainer.keep_checkpoints", "5",
                                    "--ckpt_path", str(run / "checkpoints/last.ckpt")), capsys)
    assert code == 0, err
    summary = json.loads((run / "summary.json").read_text())
    changed = {"trainer.num_rounds": [1, 3], "trainer.keep_checkpoints": [2, 5]}
    assert summary["resumes"] == [{"round": 1, "changed": changed}]
    assert summary["run_id"] == rid == run_id(run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["trainer"]["num_rounds"] == 3 and cfg["trainer"]["keep_checkpoints"] == 5
    # the record survives a further resume (from the round-2 checkpoint)
    code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "3", "--trainer.keep_checkpoints", "5",
                                    "--ckpt_path", str(run / "checkpoints/round-000002.ckpt")), capsys)
    assert code == 0, err
    assert json.loads((run / "summary.json").read_text())["resumes"] == [
        {"round": 1, "changed": changed}, {"round": 2, "changed": {}}]


class EvaluationOnly(FederatedCallback):
    """Declares an argument a resume may change (as an evaluation-only callback's schedule would)."""

    resume_may_change = ("when",)

    def __init__(self, when: str = "last", shifts: list[int] | None = None) -> None:
        self.when, self.shifts = when, shifts


def test_config_changes_allows_only_the_listed_keys() -> None:
    def cfg(lr: float, when: str, rounds: int, cb: str = "test_rundir.EvaluationOnly") -> str:
        return yaml.safe_dump({"model": {"lr": lr}, "trainer": {"num_rounds": rounds, "callbacks": [
            {"class_path": cb, "init_args": {"when": when, "shifts": [0, 50]}}]}})

    allowed, refused = config_changes(cfg(0.1, "last", 2), cfg(0.1, "every", 4))
    assert allowed == {"trainer.callbacks.0.init_args.when": ["last", "every"], "trainer.num_rounds": [2, 4]}
    assert refused == {}
    other = "pl_fedsparse.callbacks.FineTune"  # declares nothing
    allowed, refused = config_changes(cfg(0.1, "last", 2, other), cfg(0.5, "every", 2, other))
    assert allowed == {}
    assert refused == {"model.lr": [0.1, 0.5], "trainer.callbacks.0.init_args.when": ["last", "every"]}
    allowed, refused = config_changes(cfg(0.1, "last", 2, "no.such.Module"), cfg(0.1, "every", 2, "no.such.Module"))
    assert refused == {"trainer.callbacks.0.init_args.when": ["last", "every"]}
    assert config_changes(None, cfg(0.1, "last", 2)) == ({}, {})
    assert config_changes("a: [1, 2]", "a: [1]") == ({}, {"a.1": [2, "(absent)"]})
    assert config_changes("a: 1", "a: 1.0") == ({}, {})
    assert config_changes("a: 1", "a: true") == ({}, {"a": [1, True]})


# ------------------------------------------------------------------------------------------------ kept checkpoints
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_keep_checkpoints_leaves_exactly_that_many_round_files(tmp_path: Path, keep: int) -> None:
    loop = tiny_loop(tmp_path, num_rounds=4, keep_checkpoints=keep)
    loop.fit(tiny_module(), tiny_datamodule())
    ckpts = tmp_path / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names == ["last.ckpt", *[f"round-{r:06d}.ckpt" for r in range(5 - keep, 5)]]
    assert (ckpts / "last.ckpt").samefile(ckpts / "round-000004.ckpt")
    assert load_checkpoint(ckpts / "last.ckpt")["round"] == 4


def test_resume_from_a_kept_round_file_gives_the_uninterrupted_run(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    loop = tiny_loop(run, num_rounds=3, keep_checkpoints=4, clients_per_round=2, logger=True)
    loop.fit(tiny_module(), tiny_datamodule())
    full = rows(run)
    assert [r["round"] for r in full] == [0, 1, 2]
    ckpt = run / "checkpoints" / "round-000001.ckpt"
    assert load_checkpoint(ckpt)["round"] == 1
    time.sleep(1.1)  # TensorBoard orders event files by their names' whole-second timestamp
    resumed = tiny_loop(run, num_rounds=3, keep_checkpoints=4, clients_per_round=2, logger=True)
    summary = resumed.fit(tiny_module(seed=7), tiny_datamodule(), ckpt_path=str(ckpt))
    assert rows(run) == full
    assert summary["resumes"] == [{"round": 1, "changed": {}}]
    for k, v in loop.global_state.items():  # type: ignore[union-attr]
        assert torch.equal(v, resumed.global_state[k])  # type: ignore[index]
    # TensorBoard: the rounds run again replace the first run's events (no step twice)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("accuracy/acc_mean")] == [0, 1, 2]


def test_a_kill_between_the_round_file_and_last_leaves_a_consistent_pair(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:

    real = rundir.atomic_link

    def link(src: Path, dst: Path) -> None:
        if src.name == "round-000002.ckpt":
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(rundir, "atomic_link", link)
    with pytest.raises(KeyboardInterrupt):
        tiny_loop(tmp_path / "r", num_rounds=3).fit(tiny_module(), tiny_datamodule())
    ckpts = tmp_path / "r" / "checkpoints"
    assert load_checkpoint(ckpts / "last.ckpt")["round"] == 1
    assert load_checkpoint(ckpts / "round-000002.ckpt")["round"] == 2
    monkeypatch.setattr(rundir, "atomic_link", real)
    tiny_loop(tmp_path / "r", num_rounds=3).fit(tiny_module(), tiny_datamodule(), ckpt_path=str(ckpts / "last.ckpt"))
    tiny_loop(tmp_path / "full", num_rounds=3).fit(tiny_module(), tiny_datamodule())
    assert rows(tmp_path / "r") == rows(tmp_path / "full")


# ------------------------------------------------------------------------------------------------ hygiene
def test_stale_temporary_files_are_removed(tmp_path: Path) -> None:
    tiny_loop(tmp_path, num_rounds=1).fit(tiny_module(), tiny_datamodule())
    stale = [tmp_path / ".metrics.jsonl.abc12_yz.tmp", tmp_path / "checkpoints" / ".round-000002.ckpt.x1y2z3w4.tmp",
             tmp_path / "checkpoints" / ".last.ckpt.0a1b2c3d.tmp"]
    for p in stale:
        p.write_bytes(b"half a file")
    mine = [tmp_path / "notes.tmp", tmp_path / ".notes.tmp", tmp_path / ".draft.yaml.0a1b2c3d.tmp",
            tmp_path / "checkpoints" / ".mine.tmp"]  # not the engine's names: the user's files stay
    for p in mine:
        p.write_text("mine")
    tiny_loop(tmp_path, num_rounds=2).fit(tiny_module(), tiny_datamodule(),
                                          ckpt_path=str(tmp_path / "checkpoints/last.ckpt"))
    assert not any(p.exists() for p in stale)
    assert all(p.read_text() == "mine" for p in mine)
    assert sorted(p.name for p in tmp_path.rglob("*.tmp")) == sorted(p.name for p in mine)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_follow_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        loop = tiny_loop(tmp_path / "r", num_rounds=1)
        loop.config_text = "trainer:\n  num_rounds: 1\n"
        loop.fit(tiny_module(), tiny_datamodule())
    finally:
        os.umask(old)
    run = tmp_path / "r"
    files = [run / n for n in ("config.yaml", "metrics.jsonl", "summary.json", "run.json")]
    files += list((run / "checkpoints").iterdir())
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p


# ------------------------------------------------------------------------------------------------ errors
def _ignores_permissions(tmp: Path) -> bool:
    probe = tmp / "probe"
    probe.mkdir()
    probe.chmod(0o555)
    try:
        (probe / "x").touch()
        return True
    except PermissionError:
        return False
    finally:
        probe.chmod(0o755)


@pytest.mark.parametrize("case", ["file", "below_file", "read_only_parent", "read_only_dir"])
def test_unusable_root_is_one_line_and_nothing_is_written(tmp_path: Path, case: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "f").write_text("a file")
    if case == "file":
        root, problem = base / "f", f"Not a directory: '{base / 'f'}'"
    elif case == "below_file":
        root, problem = base / "f" / "run", "Not a directory: "
    else:
        if _ignores_permissions(tmp_path):
            pytest.skip("this process writes into read-only directories (root with CAP_DAC_OVERRIDE)")
        if case == "read_only_parent":
            root, problem = base / "run", f"Permission denied: '{base / 'run'}'"
            base.chmod(0o555)
        else:
            root, problem = base, f"Permission denied: '{base / '.lock'}'"
            base.chmod(0o555)
    try:
        before = digest(base), sorted(os.listdir(base))
        code, _, err = run_main(cli_fit(root, "--trainer.num_rounds", "1"), capsys)
        assert code == 2
        line = one_line(err)
        assert f"trainer.default_root_dir='{root}' is invalid: expected a writable directory ({problem}" in line, line
        assert (digest(base), sorted(os.listdir(base))) == before
    finally:
        base.chmod(0o755)


def test_unwritable_checkpoint_is_one_line(tmp_path: Path) -> None:
    loop = tiny_loop(tmp_path / "r", num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())
    (tmp_path / "blocker").write_text("a file")
    with pytest.raises(ConfigError, match=r"path='.*blocker/x.ckpt' is invalid: .*\(Not a directory"):
        loop.save_checkpoint(tmp_path / "blocker" / "x.ckpt")


def test_load_checkpoint_gives_the_whole_first_line_of_the_cause(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "x.ckpt"
    torch.save({"w": torch.ones(2)}, path)  # (an intact archive: the failure is torch.load's)
    cause = "PytorchStreamReader failed " + "x" * 300 + " END"

    def fail(*a: Any, **k: Any) -> None:
        raise RuntimeError(cause + "\nsecond line")

    monkeypatch.setattr(torch, "load", fail)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert cause + ")" in str(e.value) and "second line" not in str(e.value)


@pytest.mark.parametrize("content", ["text", "yaml", "flipped"])
def test_a_file_that_is_no_intact_checkpoint_is_one_line(tmp_path: Path, content: str) -> None:
    """A text file (a config given as ``--ckpt_path`` by mistake: torch's legacy loader raises ``KeyError`` or
    ``IndexError`` on it) and a checkpoint with damaged bytes in its weights (``torch.load`` does not check the
    archive's CRCs: it loaded other weights and resumed another run) are refused in one line."""
    path = tmp_path / "x.ckpt"
    if content == "text":
        path.write_text("hello")
    elif content == "yaml":
        path.write_text("seed_everything: 0\ntrainer:\n  num_rounds: 3\n")
    else:
        save_checkpoint(path, {"global_state": {"w": torch.randn(4096)}})
        data = bytearray(path.read_bytes())
        at = len(data) // 2
        data[at:at + 8] = bytes(8) if data[at:at + 8] != bytes(8) else b"\xff" * 8
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    expected = {"text": "not a zip archive, as pl-fed fit writes its checkpoints",
                "yaml": "not a zip archive, as pl-fed fit writes its checkpoints",
                "flipped": "fails its CRC check"}[content]
    assert str(e.value).startswith(f"ckpt_path={str(path)!r} is invalid: expected a readable pl_fedsparse "
                                   "checkpoint (the file is corrupted: ") and expected in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_overwrite_does_not_break_into_a_running_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--trainer.overwrite true` while another run holds the directory: refused, nothing changed."""
    run = tmp_path / "run"
    holder = held_run(run, capsys)
    try:
        before = {k: v for k, v in digest(run).items() if k != ".lock"}
        code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "1", "--trainer.overwrite", "true"), capsys)
        assert code == 2 and "another run" in one_line(err)
        assert {k: v for k, v in digest(run).items() if k != ".lock"} == before
    finally:
        holder.reporter.release()


# ------------------------------------------------------------------------------------------ checkpoint provenance
SIDE_EFFECT = '''
import os
open(os.environ["SIDEFX_MARKER"], "a").write("imported {name}\\n")

class Evil:
    resume_may_change = ("lr",)
'''


def _plant_side_effect_modules(where: Path, marker: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    for name in names:
        (where / f"{name}.py").write_text(SIDE_EFFECT.replace("{name}", name))
    monkeypatch.setenv("SIDEFX_MARKER", str(marker))
    monkeypatch.syspath_prepend(str(where))


def test_config_diff_never_imports_a_class_named_by_the_other_file(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Comparing configurations resolves class paths only through modules already imported: a class path in a
    checkpoint's configuration is text, compared as text."""
    marker = tmp_path / "marker"
    _plant_side_effect_modules(tmp_path, marker, monkeypatch, "sidefx_model", "sidefx_cb")
    old = yaml.safe_dump({"model": {"class_path": "sidefx_model.Evil", "init_args": {"lr": 0.1}},
                          "trainer": {"callbacks": [{"class_path": "sidefx_cb.Evil", "init_args": {"lr": 1}}]}})
    new = yaml.safe_dump({"model": {"class_path": "pl_fedsparse.FederatedModule", "init_args": {"lr": 0.1}},
                          "trainer": {"callbacks": [{"class_path": "sidefx_cb.Evil", "init_args": {"lr": 2}}]}})
    allowed, refused = config_changes(old, new)
    assert not marker.exists(), marker.read_text()
    assert "sidefx_model" not in sys.modules and "sidefx_cb" not in sys.modules
    assert refused["model.class_path"] == ["sidefx_model.Evil", "(absent)"]
    # the callback's declared resumable argument is unknown while its module is not imported: the change is refused
    assert refused["trainer.callbacks.0.init_args.lr"] == [1, 2] and allowed == {}
    # two spellings of one imported class still compare equal (the alias is resolved from loaded modules)
    same = yaml.safe_dump({"model": {"class_path": "pl_fedsparse.module.FederatedModule", "init_args": {"lr": 0.1}}})
    alias = yaml.safe_dump({"model": {"class_path": "pl_fedsparse.FederatedModule", "init_args": {"lr": 0.1}}})
    assert config_changes(same, alias) == ({}, {})


def test_a_crafted_checkpoint_imports_nothing_it_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint from elsewhere whose embedded configuration names modules with side effects (one in the working
    directory, where ``pl-fed`` looks for the user's own modules) is refused with one line; a marker file proves that
    none of them was imported."""
    run = tmp_path / "run"
    assert run_main(cli_fit(run, "--trainer.num_rounds", "1"), capsys)[0] == 0
    marker = tmp_path / "marker"
    work = tmp_path / "work"
    work.mkdir()
    _plant_side_effect_modules(work, marker, monkeypatch, "sidefx", "sidefx_data", "sidefx_cb")
    monkeypatch.chdir(work)
    state = load_checkpoint(run / "checkpoints" / "last.ckpt")
    state.pop("loaded_from", None)
    state.pop("format", None)
    cfg = yaml.safe_load(state["config"])
    cfg["model"] = {"class_path": "sidefx.Evil", "init_args": {"lr": 0.01}}
    cfg["data"] = {"class_path": "sidefx_data.Evil", "init_args": {}}
    cfg["trainer"]["callbacks"] = [{"class_path": "sidefx_cb.Evil", "init_args": {"lr": 1}}]
    state["config"] = yaml.safe_dump(cfg)
    crafted = tmp_path / "crafted.ckpt"
    from pl_fedsparse.run.checkpoint import save_checkpoint
    save_checkpoint(crafted, state)
    before = digest(run)
    code, _, err = run_main(cli_fit(run, "--trainer.num_rounds", "2", "--ckpt_path", str(crafted)), capsys)
    assert code == 2
    line = one_line(err)
    assert "model.class_path" in line and "sidefx.Evil" in line, line
    assert not marker.exists(), marker.read_text()
    assert not {"sidefx", "sidefx_data", "sidefx_cb"} & set(sys.modules)
    assert digest(run) == before


# ------------------------------------------------------------------------------------------------ links
@pytest.mark.parametrize("entry", [".lock", "run.json", "config.yaml", "summary.json", "metrics.jsonl", "checkpoints",
                                   "tensorboard", "checkpoints/last.ckpt"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_run_directory_whose_own_entries_are_links_is_refused_and_nothing_outside_is_touched(
        tmp_path: Path, entry: str, overwrite: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """Each special entry as a symlink to the user's files elsewhere: one line naming it, exit 2, the target (a file
    or a folder with a TensorBoard-looking file and engine-looking temporary files) unchanged to the byte."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "events.out.tfevents.123.host").write_bytes(b"the user's events")
    (outside / ".last.ckpt.0a1b2c3d.tmp").write_bytes(b"the user's file")
    (outside / "target.txt").write_text("precious")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    link = run / entry
    if link.exists():
        link.rmdir()
    link.symlink_to(outside if entry in ("checkpoints", "tensorboard") else outside / "target.txt")
    before = digest(outside)
    args = cli_fit(run, "--trainer.num_rounds", "1") + (["--trainer.overwrite", "true"] if overwrite else [])
    code, _, err = run_main(args, capsys)
    assert code == 2, err
    line = one_line(err)
    assert f"its {entry} is a symbolic link" in line
    assert digest(outside) == before
    assert link.is_symlink()


def test_a_symlinked_tmp_file_and_a_link_to_a_directory_are_never_followed_when_cleaning(tmp_path: Path) -> None:
    """An engine-named temporary file that is a link is left alone (the link and its target)."""
    tiny_loop(tmp_path / "r", num_rounds=1).fit(tiny_module(), tiny_datamodule())
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep")
    link = tmp_path / "r" / ".summary.json.0a1b2c3d.tmp"
    link.symlink_to(target)
    tiny_loop(tmp_path / "r", num_rounds=2).fit(tiny_module(), tiny_datamodule(),
                                                ckpt_path=str(tmp_path / "r" / "checkpoints/last.ckpt"))
    assert target.read_bytes() == b"keep" and link.is_symlink()


def test_a_checkpoints_folder_that_takes_no_file_is_refused_before_a_round(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only ``checkpoints/`` (injected: the suite may run as root, who writes anyway) is refused when the run
    starts, not after a round computed for nothing."""
    import tempfile

    loop = tiny_loop(tmp_path, num_rounds=1)
    loop.fit(tiny_module(), tiny_datamodule())
    real = tempfile.mkstemp

    def read_only(*a: Any, **k: Any) -> Any:
        if Path(k.get("dir", "")).name == "checkpoints":
            raise PermissionError(13, "Permission denied", str(k["dir"]))
        return real(*a, **k)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    again = tiny_loop(tmp_path, num_rounds=2)
    with pytest.raises(ConfigError, match=r"is invalid: expected a writable directory \(.*Permission denied"):
        again.fit(tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert len(again.history) <= 1  # (no round was run)
    assert [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0]


class _GlobalDraws(FederatedCallback):
    """User code drawing from numpy's and Python's global generators once per round: normal draws come in pairs,
    the second kept for the next call, so the state between two rounds holds a kept draw every other round."""

    scratch_attributes = ("seen",)  # (what the test reads: not the federation's state)

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []

    def on_round_end(self, loop: Any, round_idx: int, metrics: dict[str, Any]) -> None:
        import random

        import numpy as np
        self.seen.append((round_idx, float(np.random.normal()), random.gauss(0.0, 1.0)))


def test_resume_continues_numpy_and_python_normal_draws_exactly(tmp_path: Path) -> None:
    """The checkpoint keeps the generators' kept normal draw (numpy's ``has_gauss``/``cached_gaussian``, Python's
    ``gauss_next``): after a resume the global streams go on as in the run that was not stopped."""
    import random

    import numpy as np

    def run(folder: str, cut: bool) -> list[tuple[int, float, float]]:
        np.random.seed(3)
        random.seed(3)
        draws = _GlobalDraws()
        loop = tiny_loop(tmp_path / folder, num_rounds=3, callbacks=[draws])
        if not cut:
            loop.fit(tiny_module(), tiny_datamodule())
            return draws.seen
        fit_until_interrupted(loop, 1, tiny_module(), tiny_datamodule())  # one round done: a draw kept
        np.random.seed(99)  # (the resumed process's generators start elsewhere)
        random.seed(99)
        again = _GlobalDraws()
        tiny_loop(tmp_path / folder, num_rounds=3, callbacks=[again]).fit(
            tiny_module(), tiny_datamodule(), ckpt_path=str(tmp_path / folder / "checkpoints" / "last.ckpt"))
        return draws.seen + again.seen

    whole, resumed = run("whole", cut=False), run("cut", cut=True)
    assert [r for r, _, _ in resumed] == [0, 1, 2]
    assert resumed == whole


def test_a_checkpoint_without_the_kept_normal_draws_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before the kept draws were saved resume as they did (no draw kept)."""
    run = tmp_path / "run"
    tiny_loop(run, num_rounds=1).fit(tiny_module(), tiny_datamodule())
    ckpt = run / "checkpoints" / "last.ckpt"
    state = load_checkpoint(ckpt)
    for key in ("python_gauss", "numpy_gauss"):
        del state["rng"][key]
    state.pop("format")
    state.pop("loaded_from", None)
    save_checkpoint(ckpt, state)
    summary = tiny_loop(run, num_rounds=2).fit(tiny_module(), tiny_datamodule(), ckpt_path=str(ckpt))
    assert summary["resumes"][0]["round"] == 1
