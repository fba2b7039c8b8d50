"""A driver killed with SIGKILL leaves no Ray processes behind: ``ray_sentinel.py`` stops the local instance's
process tree when the driver's pipe closes. Linux only (``/proc``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_CLI

from pl_fedsparse.executors import ray_sentinel as _ray_sentinel

pytestmark = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="the sentinel reads /proc")

SENTINEL = Path(_ray_sentinel.__file__)


def _alive(pid: int) -> bool:
    return _ray_sentinel._alive(pid)


def _wait_dead(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _fake_session(tmp_path: Path) -> tuple[str, subprocess.Popen[bytes], int]:
    """A 'node process' whose command line names a session directory, with a child that does not (a 'worker')."""
    session = str(tmp_path / "session_fake")
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']);"
            " print(c.pid, flush=True); time.sleep(120)")
    node = subprocess.Popen([sys.executable, "-c", code, session], stdout=subprocess.PIPE)
    assert node.stdout is not None
    child = int(node.stdout.readline())
    return session, node, child


def test_the_session_tree_is_found_and_stopped(tmp_path: Path) -> None:
    session, node, child = _fake_session(tmp_path)
    try:
        assert _ray_sentinel.session_processes(session) == sorted([node.pid, child])
        _ray_sentinel.stop(session, grace_s=2.0)
        node.wait(timeout=10)
        assert not _wait_dead([child], 10)
    finally:
        for p in (node.pid, child):
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_sigkilled_driver_takes_the_session_with_it(tmp_path: Path) -> None:
    session, node, child = _fake_session(tmp_path)
    # the driver holds the sentinel's pipe, like RayExecutor; then it is killed without any chance to clean up
    driver_code = ("import subprocess, sys, time; s = subprocess.Popen([sys.executable, '-S', sys.argv[1], sys.argv[2]],"
                   " stdin=subprocess.PIPE, start_new_session=True); print(s.pid, flush=True); time.sleep(120)")
    driver = subprocess.Popen([sys.executable, "-c", driver_code, str(SENTINEL), session], stdout=subprocess.PIPE)
    try:
        assert driver.stdout is not None
        sentinel = int(driver.stdout.readline())
        time.sleep(0.5)
        assert _alive(node.pid) and _alive(child) and _alive(sentinel)  # the driver lives: nothing is touched
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        node.wait(timeout=15)
        assert not _wait_dead([child, sentinel], 15)
    finally:
        for p in (node.pid, child):
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    ppids = _ray_sentinel._ppids()
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for c, pp in ppids.items():
            if pp == p and c not in found:
                found.add(c)
                todo.append(c)
    return sorted(found)


def _ray_run_in_progress(tmp_path: Path, workers: int) -> tuple[Path, subprocess.Popen[str]]:
    """A ``pl-fed fit`` on Ray in a subprocess (stderr to ``tmp_path/stderr.txt``: a pipe nobody reads could fill
    and stall it), returned once two rounds are in ``metrics.jsonl``."""
    run = tmp_path / "run"
    args = ["fit", *TINY_CLI, "--trainer.num_rounds", "200", "--trainer.default_root_dir", str(run),
            "--trainer.executor", "pl_fedsparse.executors.RayExecutor", "--trainer.executor.num_workers", str(workers)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}
    driver = subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", *args], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=(tmp_path / "stderr.txt").open("w"), text=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and driver.poll() is None:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    assert driver.poll() is None, "the run ended before it could be stopped"
    return run, driver


@pytest.mark.slow
def test_no_ray_process_outlives_a_sigkilled_run(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    run, driver = _ray_run_in_progress(tmp_path, workers=1)
    tree: list[int] = []
    try:
        assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["round"] == 0
        tree = [p for p in _descendants(driver.pid) if _alive(p)]
        assert len(tree) >= 3, tree  # GCS, raylet, a worker (and the sentinel) run below the driver
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        assert not _wait_dead(tree, 30), [(p, _ray_sentinel._cmdline(p)[:80]) for p in tree if _alive(p)]
    finally:
        for p in tree:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_sigterm_on_ray_stops_the_workers_and_exits_143(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from pl_fedsparse.run.checkpoint import load_checkpoint

    run, driver = _ray_run_in_progress(tmp_path, workers=2)
    tree: list[int] = []
    try:
        tree = [p for p in _descendants(driver.pid) if _alive(p)]
        driver.send_signal(signal.SIGTERM)  # while the workers fit a round
        driver.wait(timeout=120)
        err = (tmp_path / "stderr.txt").read_text()
        assert driver.returncode == 143, err[-3000:]
        lines = [x for x in err.splitlines() if x.startswith("terminated (SIGTERM): resume with `pl-fed fit")]
        assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert not (run / ".lock").exists()
        assert load_checkpoint(run / "checkpoints" / "last.ckpt")["round"] >= 1
        assert not _wait_dead(tree, 30), [(p, _ray_sentinel._cmdline(p)[:80]) for p in tree if _alive(p)]
    finally:
        for p in tree:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
