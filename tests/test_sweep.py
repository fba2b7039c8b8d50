"""``pl-fed sweep``: a grid run two at a time, ending with the report; a bad entry is one line before anything runs;
a sweep killed midway and started again with the same command ends with every run identical to an uninterrupted
sweep's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import one_line, run_main

REPO = Path(__file__).resolve().parents[1]
GRID = ["--config", "quickstart", "--config", "synthetic_fedavg", "--seeds", "0", "1", "2", "--set",
        "trainer.num_rounds=3", "--set", "data.num_clients=6", "--parallel", "2"]
NAMES = [f"{c}-seed{s}" for c in ("quickstart", "synthetic_fedavg") for s in (0, 1, 2)]


def _rows(run: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time")}
            for x in (run / "metrics.jsonl").read_text().splitlines()]


def _sweep(out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", "sweep", *GRID, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_a_killed_sweep_resumes_to_the_uninterrupted_sweeps_runs(tmp_path: Path) -> None:
    whole = _sweep(tmp_path / "whole")
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err
    assert "sweep: 6 runs (0 already done), 2 at a time" in out
    assert "Across seeds" in out and (tmp_path / "whole" / "report" / "report.md").is_file()
    # the same sweep, killed (SIGKILL) once a run has finished and others are under way, then started again
    cut = tmp_path / "cut"
    p = _sweep(cut)
    t = time.time()
    while not any((cut / n / "summary.json").is_file() for n in NAMES) and time.time() - t < 300:
        time.sleep(0.1)
    time.sleep(1.0)
    p.send_signal(signal.SIGKILL)
    p.communicate(timeout=60)
    done = [n for n in NAMES if (cut / n / "summary.json").is_file()]
    assert 0 < len(done) < len(NAMES), done
    t = time.time()  # its runs stop too (each checkpoints on the SIGTERM it gets when the sweep dies)
    while any((cut / n / ".lock").exists() and _locked(cut / n) for n in NAMES) and time.time() - t < 120:
        time.sleep(0.2)
    again = _sweep(cut)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err
    assert f"({len(done)} already done)" in out
    for n in NAMES:
        assert _rows(cut / n) == _rows(tmp_path / "whole" / n), n


@pytest.mark.slow
def test_a_sigterm_stops_the_sweep_and_its_run_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGTERM (a scheduler's stop) ends the sweep as Ctrl-C does: its running fit checkpoints, the sweep says so and
    exits 143; the same command then finishes the campaign."""
    grid = ["--config", "synthetic_fedavg", "--seeds", "0", "1", "--set", "trainer.num_rounds=40", "--parallel", "1",
            "--no-report", "--out", str(tmp_path / "out")]
    p = subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", "sweep", *grid], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = tmp_path / "out" / "synthetic_fedavg-seed0"
    t = time.time()
    while not ((first / "metrics.jsonl").is_file() and (first / "metrics.jsonl").read_text().strip()) \
            and time.time() - t < 300:  # (a round finished: it is checkpointed)
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert err.strip().splitlines()[-1] == ("sweep terminated (SIGTERM): its runs stopped with their checkpoints; "
                                            "the same command continues it"), err
    assert (first / "checkpoints" / "last.ckpt").is_file()
    code = subprocess.run([sys.executable, "-m", "pl_fedsparse.cli", "sweep", *grid], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert code.returncode == 0, code.stderr
    assert all((tmp_path / "out" / f"synthetic_fedavg-seed{s}" / "summary.json").is_file() for s in (0, 1))


def _locked(run: Path) -> bool:
    import fcntl

    try:
        fd = os.open(run / ".lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


@pytest.mark.parametrize("bad, expected", [
    (["--config", "no_such_config"], "sweep entry no_such_config-seed0: config"),
    (["--config", "quickstart", "--set", "trainer.num_rounds=0"], "sweep entry quickstart-seed0: trainer.num_rounds"),
    (["--config", "quickstart", "--vary", "trainer.nonsense=1,2"], "sweep entry quickstart-nonsense1-seed0:"),
    (["--config", "quickstart", "--seeds", "1", "1"], "--seeds=[1, 1] is invalid: expected distinct seeds"),
    (["--config", "quickstart", "--set", "num_rounds"], "--set='num_rounds' is invalid: expected KEY=VALUE"),
], ids=["config", "value", "key", "seeds", "assignment"])
@pytest.mark.slow  # each entry is checked in a subprocess (10-30 s a case on 2 cores)
def test_a_bad_grid_entry_is_one_line_and_nothing_runs(tmp_path: Path, bad: list[str], expected: str,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    code, _, err = run_main(["sweep", *bad, "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert expected in one_line(err)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ a plan's own shape
PLAN_GRID = """
configs:
  - {name: fedavg, config: quickstart, set: {trainer.local_epochs: 2}}
  - synthetic_fedavg
seeds: [0, 1]
set: {data.seed: "{seed}", trainer.num_rounds: 3}
overrides: [{}, {trainer.join_ratio: 0.5}]
name: "{config}{setting}_s{seed}"
record: RECORD
"""


def _grid(tmp_path: Path, text: str = PLAN_GRID) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(text.replace("RECORD", str(tmp_path / "record")))
    return path


def test_a_grid_file_names_its_entries_runs_and_seeds(tmp_path: Path) -> None:
    """Entries carry their label and settings, the name pattern names the run directories, ``"{seed}"`` is the
    run's seed; configs × settings × seeds in that order; set < entry < setting."""
    from pl_fedsparse.sweep import campaign

    c = campaign(["--grid", str(_grid(tmp_path)), "--out", str(tmp_path / "out")])
    assert [r.name for r in c.runs] == ["fedavg_s0", "fedavg_s1", "fedavgjoin_ratio0.5_s0", "fedavgjoin_ratio0.5_s1",
                                        "synthetic_fedavg_s0", "synthetic_fedavg_s1",
                                        "synthetic_fedavgjoin_ratio0.5_s0", "synthetic_fedavgjoin_ratio0.5_s1"]
    assert c.record == tmp_path / "record" and c.out == tmp_path / "out"
    by = {r.name: r for r in c.runs}
    assert by["fedavgjoin_ratio0.5_s1"].fit_args() == [
        "--config", "quickstart", "--seed_everything", "1", "--data.seed", "1", "--trainer.num_rounds", "3",
        "--trainer.local_epochs", "2", "--trainer.join_ratio", "0.5"]
    assert by["synthetic_fedavg_s0"].overrides == {"data.seed": 0, "trainer.num_rounds": 3}
    # --set on the command line (a seed too), --only, --seeds
    c = campaign(["--grid", str(_grid(tmp_path)), "--set", "trainer.num_rounds=9", "--only", "synthetic*",
                  "--seeds", "4"])
    assert [(r.name, r.overrides["trainer.num_rounds"], r.overrides["data.seed"]) for r in c.runs] == [
        ("synthetic_fedavg_s4", 9, 4), ("synthetic_fedavgjoin_ratio0.5_s4", 9, 4)]
    # seed_first: every entry and setting at one seed, then the next
    c = campaign(["--grid", str(_grid(tmp_path, PLAN_GRID + "seed_first: true\n")), "--only", "*_s?"])
    assert [r.name for r in c.runs][:5] == ["fedavg_s0", "fedavgjoin_ratio0.5_s0", "synthetic_fedavg_s0",
                                            "synthetic_fedavgjoin_ratio0.5_s0", "fedavg_s1"]


def test_a_dry_run_lists_every_run_and_its_state_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    (tmp_path / "record" / "fedavg_s1").mkdir(parents=True)  # recorded: done wherever its run directory went
    (tmp_path / "record" / "fedavg_s1" / "summary.json").write_text("{}")
    (tmp_path / "out" / "synthetic_fedavg_s0" / "checkpoints").mkdir(parents=True)  # cut short: resumes
    (tmp_path / "out" / "synthetic_fedavg_s0" / "checkpoints" / "last.ckpt").write_text("")
    (tmp_path / "out" / "synthetic_fedavg_s0" / "config.yaml").write_text("")
    grid = _grid(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, out, err = run_main(["sweep", "--grid", str(grid), "--out", str(tmp_path / "out"), "--dry-run"], capsys)
    assert code == 0, err
    lines = out.strip().splitlines()
    parallel = max(1, (os.cpu_count() or 1) // 2)
    assert len(lines) == 9 and lines[-1] == (f"sweep (dry run): 8 runs, 1 done, 7 to run, {parallel} at a time, "
                                             f"in {tmp_path / 'out'}, recorded in {tmp_path / 'record'}")
    assert lines[0] == ("fedavg_s0 [new]: pl-fed fit --config quickstart --seed_everything 0 --data.seed 0 "
                        "--trainer.num_rounds 3 --trainer.local_epochs 2")
    assert lines[1].startswith("fedavg_s1 [done]: ") and lines[4].startswith("synthetic_fedavg_s0 [resume]: ")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_finished_runs_are_recorded_and_a_recorded_run_is_not_run_again(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``record``: a finished run's three record files are copied to ``<record>/<name>/`` (also one that finished
    before this sweep); a run with a record is done even without its run directory (a fresh machine)."""
    from pl_fedsparse.sweep import RECORD_FILES, SweepRun, run_sweep

    out, record = tmp_path / "out", tmp_path / "record"
    runs = [SweepRun("a", "quickstart", 0), SweepRun("b", "quickstart", 1)]
    (out / "a" / "checkpoints").mkdir(parents=True)  # finished here, not yet recorded
    for f in RECORD_FILES:
        (out / "a" / f).write_text(f)
    (out / "a" / "checkpoints" / "last.ckpt").write_text("not a record")
    (record / "b").mkdir(parents=True)  # recorded by an earlier session; its run directory is gone
    (record / "b" / "summary.json").write_text("{}")
    assert [r.state(out) for r in runs] == ["done", "new"]
    assert [r.state(out, record) for r in runs] == ["done", "done"]
    assert run_sweep(runs, out, 1, REPO, record) == []  # nothing to run
    assert "sweep: 2 runs (2 already done)" in capsys.readouterr().out
    assert sorted(p.name for p in (record / "a").iterdir()) == sorted(RECORD_FILES)
    assert [(record / "a" / f).read_text() for f in RECORD_FILES] == list(RECORD_FILES)
    assert not (out / "b").exists()


@pytest.mark.parametrize("grid, expected", [
    ("configs: [quickstart]\nseeds: [0, 1]\nname: '{config}'",
     "name='{config}' is invalid: expected a pattern that names every run apart"),
    ("configs: [quickstart]\nname: '{method}_seed{seed}'",
     "name='{method}_seed{seed}' is invalid: expected a pattern with fields among {config}, {setting}, {seed}"),
    ("configs: [quickstart]\nname: '../{config}'", "name='../{config}' is invalid: expected a pattern with fields"),
    ("configs: [{name: a}]", "configs={'name': 'a'} is invalid: expected a config (a path or a shipped name) or"),
    ("configs: [{config: quickstart, sets: {}}]", "is invalid: expected a config (a path or a shipped name) or"),
    ("configs: [quickstart]\nrecords: x", ("is invalid: expected a mapping with keys among configs, seeds, set, "
                                           "overrides, parallel, out, name, record, seed_first")),
    ("configs: [{config: quickstart, name: ../x}]", "is invalid: expected a name made of letters, digits and _.=+-"),
    ("configs: [quickstart]\nset: [1, 2]", "set=[1, 2] is invalid: expected a mapping {dotted.key: value}"),
    ("configs: [quickstart]\nset: x", "set='x' is invalid: expected a mapping {dotted.key: value}"),
    ("configs: [quickstart]\nseeds: 3", "seeds=3 is invalid: expected a list of ints"),
    ("configs: [quickstart]\nparallel: two", "parallel='two' is invalid: expected an int >= 1"),
    ("configs: [quickstart]\nparallel: 0", "parallel=0 is invalid: expected an int >= 1"),
    ("configs: [quickstart]\nparallel: 2.7", "parallel=2.7 is invalid: expected an int >= 1"),
    ("configs: [quickstart]\nrecord: [a]", "record=['a'] is invalid: expected a folder path"),
], ids=["not-distinct", "field", "path", "no-config", "key", "grid-key", "entry-name", "set-list", "set-str",
        "seeds-int", "parallel-str", "parallel-0", "parallel-float", "record-list"])
def test_a_bad_plan_shape_is_one_line_and_nothing_runs(tmp_path: Path, grid: str, expected: str,
                                                       capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    code, _, err = run_main(["sweep", "--grid", str(_grid(tmp_path, grid)), "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert expected in one_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["file", "under-file"])
@pytest.mark.parametrize("option", ["--out", "--record"])
def test_an_out_or_record_folder_that_cannot_be_made_is_one_line_before_any_run(
        tmp_path: Path, where: str, option: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    (tmp_path / "f").write_text("a file")
    folder = tmp_path / "f" if where == "file" else tmp_path / "f" / "sub"
    other = ["--out", str(tmp_path / "out")] if option == "--record" else []
    code, _, err = run_main(["sweep", "--config", "quickstart", "--set", "trainer.num_rounds=1", "--no-report",
                             *other, option, str(folder)], capsys)
    assert code == 2, err
    assert one_line(err).startswith(f"error: {option}={str(folder)!r} is invalid: expected a writable folder ("), err
    assert "Traceback" not in err and not (tmp_path / "out" / "quickstart").exists()


def test_a_binary_grid_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "g.yaml").write_bytes(bytes(range(256)))
    code, _, err = run_main(["sweep", "--grid", str(tmp_path / "g.yaml"), "--dry-run"], capsys)
    assert code == 2 and one_line(err).startswith(f"error: --grid={str(tmp_path / 'g.yaml')!r} is invalid: cannot "
                                                  "read it"), err


def test_only_must_match_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    code, _, err = run_main(["sweep", "--config", "quickstart", "--only", "nothing*", "--dry-run"], capsys)
    assert code == 2
    assert one_line(err) == ("error: --only=['nothing*'] is invalid: expected globs matching at least one run's "
                             "name (--dry-run lists them)")
