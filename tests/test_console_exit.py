"""The console script's last second: a SIGTERM that arrives after ``pl-fed fit`` finished its work (while the
interpreter shuts down) ends the process with the command's own status and one line, not a silent -15."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import TINY_CLI

REPO = Path(__file__).resolve().parents[1]

# a user module that keeps the interpreter busy for a while at exit (as threads and caches do), so that the signal
# reliably lands in that window
LINGER = '''
import atexit, os, time
from pl_fedsparse import FederatedCallback

atexit.register(lambda: (open(os.environ["EXITING_FILE"], "w").close(), time.sleep(20)))

class Nothing(FederatedCallback):
    pass
'''


@pytest.mark.slow
def test_a_sigterm_while_exiting_keeps_the_exit_status_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "lingercb.py").write_text(LINGER)
    exiting = tmp_path / "exiting"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXITING_FILE": str(exiting),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", "fit", *TINY_CLI, "--trainer.num_rounds", "1",
                          "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.callbacks+",
                          "lingercb.Nothing"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         cwd=REPO)
    t = time.time()
    while not exiting.exists() and time.time() - t < 180 and p.poll() is None:
        time.sleep(0.05)
    assert exiting.exists(), p.communicate()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (p.returncode, err)
    assert "final results" in out
    assert "pl-fed: SIGTERM while exiting: ignored, the command had finished (exit status 0)" in err


def _catches(pid: int, *signums: int) -> bool:
    """Whether process ``pid`` has a handler for every one of ``signums`` (``SigCgt`` in ``/proc/<pid>/status``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return all(caught >> (s - 1) & 1 for s in signums)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the handlers from /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_torch_is_imported_is_one_line(tmp_path: Path, signum: int) -> None:
    """The console script's handlers are in place before torch and Lightning are imported (seconds): a Ctrl-C or a
    SIGTERM then is one line and 128 + the signal number, not a KeyboardInterrupt traceback or a silent -15."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-m", "pl_fedsparse.cli", "fit", *TINY_CLI,
                          "--trainer.default_root_dir", str(tmp_path / "run")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    t = time.time()
    while not _catches(p.pid, signal.SIGTERM, signal.SIGHUP) and time.time() - t < 60 and p.poll() is None:
        time.sleep(0.002)
    assert "libtorch" not in Path(f"/proc/{p.pid}/maps").read_text()  # still importing: torch's libraries not loaded
    p.send_signal(signum)
    out, err = p.communicate(timeout=60)
    name = signal.Signals(signum).name
    assert (p.returncode, err) == (128 + signum, f"pl-fed: {name} while starting: stopped before anything was run "
                                                 f"(exit status {128 + signum})\n")
    assert out == "" and not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_in_a_command_without_its_own_handling_is_one_line(tmp_path: Path, signum: int) -> None:
    """``pl-fed report`` (no signal handling of its own) stopped by a signal while it works: the console script
    says so in one line with 128 + the signal number (its files are written atomically, so none is left half)."""
    code = textwrap.dedent(f"""
        import os, sys, time
        import pl_fedsparse.run.report as report
        def working(args):
            os.kill(os.getpid(), {int(signum)})
            time.sleep(60)
            return 0
        report.main = working
        sys.argv = ["pl-fed", "report", "some-run"]
        from pl_fedsparse.cli.entry import console_main
        console_main()
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    word = "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)"
    assert (res.returncode, res.stderr) == (128 + signum, f"pl-fed: {word} (exit status {128 + signum})\n")
