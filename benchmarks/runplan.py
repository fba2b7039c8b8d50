"""A resumable plan of ``pl-fed fit`` runs shared by several workers and several sessions.

Each run has a name and its ``pl-fed fit`` arguments. ``run_plan`` takes the runs whose record does not exist yet,
one at a time:

* **claims** — a worker claims a run by creating ``<runs>/<name>.claim`` (O_EXCL) holding its host and pid; a claim
  whose process is gone (a session that ended, a killed worker) is taken over, so a new session simply starts
  workers again;
* **resumes** — a run directory with ``checkpoints/last.ckpt`` is continued from it (``--ckpt_path``), so a long run
  cut by the end of a session loses at most ``checkpoint_every`` rounds;
* **records** — a finished run's ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` are copied to
  ``<record>/<name>/`` (small, kept in git); run directories stay under ``benchmarks/_runs`` (ignored);
* **continues** — a run with ``start_from`` (the run directory of another plan's finished run) starts as a copy of
  that directory, less its ``summary.json``, and resumes from its last checkpoint with its own arguments (more
  rounds, say); until that run has finished it is skipped;
* **parks** — ``park`` copies the last checkpoint of every unfinished run to ``<record>/_parked/<name>.ckpt`` (kept in
  git, a few MB each), so a run of many hours survives a session that ends on one machine and a next session that
  starts on a fresh one: a run with no checkpoint of its own resumes from its parked one (the checkpoint carries the
  rows of ``metrics.jsonl``), and the parked file is removed once the run is recorded; a continuation that has not
  started parks the checkpoint it would start from; a checkpoint over ``PARK_LIMIT_MB`` is not parked (said so);
* **pins the code** — ``code`` may be another checkout (``git worktree add ../bench <commit>``), so hours of runs use
  one version of the code while this tree changes; every run log starts with that commit.

Used by ``papers/fedspa/long_horizon.py`` and the other plans of ``benchmarks/`` that import it.

Why this is not ``pl-fed sweep``: a plan that is only a grid — configs, settings, seeds, named run directories,
records copied into git — is a sweep (``configs/sweeps/``, e.g. ``dmpfl_table.yaml``). This module keeps what the sweep
does not do, for the plans that need it: workers on several machines and sessions claiming runs from one folder,
a run that starts as a copy of another finished run (``start_from``: FedPSE's 100-round stage continues its 20-round
runs), unfinished runs' checkpoints parked in git so that a fresh machine resumes them, and a pinned code checkout
whose commit heads every run log.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    """One ``pl-fed fit``: its name and its arguments after ``fit`` (``--trainer.default_root_dir`` is added)."""

    name: str
    args: list[str]
    meta: dict = field(default_factory=dict)
    #: a finished run's directory this run continues (copied, then resumed from its ``checkpoints/last.ckpt``)
    start_from: Path | None = None


def commit_of(path: Path) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=path, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _alive(claim: Path) -> bool:
    try:
        host, pid = claim.read_text().split()
    except (OSError, ValueError):
        return False  # an empty or unreadable claim (an older runner, or a crash while writing): stale
    if host != socket.gethostname():
        return True  # another machine's worker: never taken over
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def claim(runs_dir: Path, name: str) -> bool:
    """Claim ``name`` for this process (taking over a claim whose process is gone)."""
    marker = runs_dir / f"{name}.claim"
    marker.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _alive(marker):
                return False
            marker.unlink(missing_ok=True)  # stale: take it over
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(f"{socket.gethostname()} {os.getpid()}\n")
        return True
    return False


def record(runs_dir: Path, record_dir: Path, name: str) -> None:
    """Copy a finished run's record files to ``<record>/<name>/``; its parked checkpoint is no longer needed."""
    out = record_dir / name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("config.yaml", "metrics.jsonl", "summary.json"):
        shutil.copy2(runs_dir / name / f, out / f)
    parked(record_dir, name).unlink(missing_ok=True)


PARKED = "_parked"
#: the largest checkpoint ``park`` puts in git (MB): a LeNet federation's is a few MB; a run whose client state is
#: hundreds of MB (FedPSE's ten personal CNNs and residuals: ~200 MB) must finish within a session instead
PARK_LIMIT_MB = 16


def parked(record_dir: Path, name: str) -> Path:
    """Where :func:`park` keeps run ``name``'s last checkpoint."""
    return record_dir / PARKED / f"{name}.ckpt"


def _copy_whole(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` through a temporary file and a rename: ``dst`` is whole or absent."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".copying")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def park(runs: Sequence[Run], runs_dir: Path, record_dir: Path) -> list[str]:
    """Copy the last checkpoint of every run of ``runs`` that has started and has no record yet to
    :func:`parked` (safe while a worker runs it: the engine replaces ``last.ckpt`` by a rename, the copy reads one
    whole file). A continuation that has not started yet parks its starting point instead (the finished run it
    continues), so a next session on a fresh machine continues it too. Returns the parked runs' names."""
    done = []
    for run in runs:
        last = runs_dir / run.name / "checkpoints" / "last.ckpt"
        if not last.exists() and run.start_from is not None and (run.start_from / "summary.json").exists():
            last = run.start_from / "checkpoints" / "last.ckpt"
        if (record_dir / run.name / "summary.json").exists() or not last.exists():
            continue
        size = last.stat().st_size / 1e6
        if size > PARK_LIMIT_MB:
            print(f"not parked {run.name}: its checkpoint is {size:.0f} MB, more than PARK_LIMIT_MB={PARK_LIMIT_MB} "
                  "that git should hold; expected a run that finishes within a session (or on a GPU)", flush=True)
            continue
        _copy_whole(last, parked(record_dir, run.name))
        done.append(run.name)
    return done


def report_parked(names: Sequence[str], record_dir: Path) -> None:
    """Print what :func:`park` kept and the ``git add`` that keeps it."""
    for name in names:
        print(f"parked {name}: {parked(record_dir, name)}")
    if names:
        print(f"commit them: git add {record_dir / PARKED}")
    else:
        print("nothing parked")


def _unpark(run: Run, run_dir: Path, record_dir: Path) -> bool:
    """A run without a checkpoint of its own takes its parked one (True when it did)."""
    last, kept = run_dir / "checkpoints" / "last.ckpt", parked(record_dir, run.name)
    if last.exists() or not kept.exists():
        return False
    _copy_whole(kept, last)
    return True


def _start_from(run: Run, run_dir: Path) -> bool:
    """Prepare ``run_dir`` as a copy of ``run.start_from``; False while that run has not finished."""
    base = run.start_from
    if base is None or run_dir.exists():
        return True
    if not (base / "summary.json").exists() or not (base / "checkpoints" / "last.ckpt").exists():
        return False
    tmp = run_dir.with_name(run_dir.name + ".copying")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp, ignore=shutil.ignore_patterns("summary.json"))
    tmp.rename(run_dir)  # whole or not at all: a cut copy is redone
    return True


def run_plan(runs: Sequence[Run], runs_dir: Path, record_dir: Path, code: Path) -> int:
    """Run every run of ``runs`` that has no record yet and that no live worker holds (see the module doc).

    Returns:
        How many runs this call finished (0: nothing left that it could run now; a failed run counts only once it
        succeeds, so a caller that repeats while runs finish stops on a run that always fails).
    """
    finished = 0
    for run in runs:
        if (record_dir / run.name / "summary.json").exists():
            continue
        run_dir = runs_dir / run.name
        if (run_dir / "summary.json").exists():  # written when a run ends: finished, not yet recorded
            record(runs_dir, record_dir, run.name)
            continue
        if not claim(runs_dir, run.name):
            continue
        if not _unpark(run, run_dir, record_dir) and not _start_from(run, run_dir):
            (runs_dir / f"{run.name}.claim").unlink(missing_ok=True)
            continue
        cmd = [sys.executable, "-m", "pl_fedsparse.cli", "fit", *run.args, "--trainer.default_root_dir", str(run_dir),
               "--trainer.enable_progress_bar", "false"]
        last = run_dir / "checkpoints" / "last.ckpt"
        resumed = last.exists()
        cmd += ["--ckpt_path", str(last)] if resumed else ["--trainer.overwrite", "true"]
        print(("resuming " if resumed else "running ") + run.name, flush=True)
        log = runs_dir / f"{run.name}.log"
        with log.open("a") as fh:
            fh.write(f"# code: {code} at {commit_of(code)}{' (resumed)' if resumed else ''}\n")
            fh.flush()
            rc = subprocess.call(cmd, cwd=code, stdout=fh, stderr=subprocess.STDOUT)
        (runs_dir / f"{run.name}.claim").unlink(missing_ok=True)
        if rc != 0:
            print(f"FAILED {run.name} (rc {rc}, log {log})", flush=True)
            continue
        if (run_dir / "summary.json").exists():
            record(runs_dir, record_dir, run.name)
            finished += 1
    return finished


def percent_spread(values: Sequence[float]) -> str:
    """Fractions as ``mean ± sample std`` in percent, two decimals (``mean`` alone for one value): a table cell over
    the recorded seeds."""
    m = statistics.fmean(values) * 100
    return f"{m:.2f}" if len(values) < 2 else f"{m:.2f} ± {statistics.stdev(values) * 100:.2f}"


def resolve(run: Run) -> dict:
    """The configuration ``run`` would fit with (``pl-fed fit ... --print_config``: nothing is trained, no data is
    read), as a dict; ``SystemExit`` with a one-line message when its arguments do not resolve."""
    from contextlib import redirect_stderr, redirect_stdout
    from io import StringIO

    import yaml

    from pl_fedsparse.cli import main as cli_main

    out, err = StringIO(), StringIO()
    try:
        with redirect_stdout(out), redirect_stderr(err):
            code = cli_main(["fit", *run.args, "--print_config"])
    except SystemExit as e:  # the parser's own errors
        code = e.code
    if code not in (0, None):
        last = (err.getvalue().strip().splitlines() or ["(no message)"])[-1]
        raise SystemExit(f"error: run {run.name}: its arguments do not resolve: {last}")
    return yaml.safe_load(out.getvalue())


def check(runs: Sequence[Run]) -> None:
    """Every run's arguments resolve (see :func:`resolve`): a plan that would fail hours into its workers fails now."""
    for run in runs:
        resolve(run)
        print(f"{run.name}: resolves", flush=True)


def main(doc: str, plan: Callable[[], list[Run]], table: Callable[[], None], runs_dir: Path, record_dir: Path,
         code: Path) -> None:
    """The command line every plan script shares: ``run`` (a worker), ``plan`` (the commands), ``check`` (they
    resolve, without training or data), ``park`` (the unfinished runs' checkpoints into git), ``table``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("verb", choices=["run", "plan", "check", "park", "table"])
    args = ap.parse_args()
    if args.verb == "run":
        run_plan(plan(), runs_dir, record_dir, code)
    elif args.verb == "plan":
        for run in plan():
            print(f"{run.name}: pl-fed fit {' '.join(run.args)}")
    elif args.verb == "check":
        check(plan())
    elif args.verb == "park":
        report_parked(park(plan(), runs_dir, record_dir), record_dir)
    else:
        table()
