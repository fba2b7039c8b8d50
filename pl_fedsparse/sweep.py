"""``pl-fed sweep``: a campaign of runs — configs × settings × seeds — run several at a time, resumable, reported.

Every claim needs seeds × methods × settings. A sweep names them once and runs them as one campaign:

* **the grid**: every ``--config`` (a path or a shipped name) × every alternative setting (``--vary KEY=V1,V2`` on
  the command line, or ``overrides:`` in a grid file, each a set of dotted keys) × every ``--seeds`` value, with
  ``--set KEY=VALUE`` applied to all. Each run is an ordinary run directory ``<out>/<config>[-<setting>]-seed<s>``
  made by ``pl-fed fit`` (its ``config.yaml``, ``metrics.jsonl``, checkpoints, log ``<out>/<name>.log``);
* **checked first**: every distinct (config, setting) is parsed and its classes built (model, data module, loop and
  callbacks, with every argument check) before anything runs; a bad entry is one line naming it, and nothing is
  started or written;
* **packed on the machine**: ``--parallel N`` runs at a time (default: one per two CPU cores, at least one), each
  with ``OMP_NUM_THREADS`` = its share of the cores;
* **resumable**: started again with the same command, a sweep skips the runs that finished (``summary.json``),
  resumes the unfinished ones from their last checkpoint (with their own ``config.yaml``: the same run, the same
  numbers as without the interruption) and starts the rest. A killed sweep takes its runs with it (Linux: each run
  gets SIGTERM when the sweep dies, and stops with a checkpoint);
* **one progress view**: a line per run started or ended and, every 30 s, the campaign's state;
* **the report**: at the end, ``pl-fed report`` over every run (seeds grouped; with ``--out``'s ``report/``).

Why processes and not Ray Tune: every run is already a resumable, self-contained ``pl-fed fit`` with its own
checkpoints and one-line errors; on one machine, a pool of processes sized to the cores packs them with nothing
more to install, and the runs' directories are the campaign's state (no second store to keep in step). A cluster
campaign can run the same runs as scheduler jobs (the README's SLURM recipe).

Example::

    pl-fed sweep --config quickstart --config synthetic_fedspa --seeds 0 1 2 --set trainer.num_rounds=5 \\
        --parallel 2 --out runs/sweep
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pl_fedsparse.errors import ConfigError, check

__all__ = ["SweepRun", "plan", "main"]

#: the per-entry check, in a process of its own (the entry's user modules): pl_fedsparse.cli.check_entry
_CHECK = "import sys; from pl_fedsparse.cli import check_entry; sys.exit(check_entry(sys.argv[1:]))"

#: how often the campaign's state is printed while runs go on (seconds)
STATUS_EVERY_S = 30.0


@dataclass
class SweepRun:
    """One run of the campaign.

    Attributes:
        name: its directory's name under the sweep's ``out``.
        config: the config it runs (a path or a shipped name).
        seed: its ``seed_everything``.
        overrides: dotted keys and values given to ``pl-fed fit`` (``--set`` and its setting).
    """

    name: str
    config: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)

    def state(self, out: Path) -> str:
        """``done`` (it has a ``summary.json``), ``resume`` (a checkpoint, unfinished) or ``new``."""
        run = out / self.name
        if (run / "summary.json").is_file():
            return "done"
        if (run / "checkpoints" / "last.ckpt").is_file() and (run / "config.yaml").is_file():
            return "resume"
        return "new"

    def command(self, out: Path) -> list[str]:
        """The ``pl-fed fit`` command of this run (a resume when it has a checkpoint)."""
        run = out / self.name
        base = [sys.executable, "-m", "pl_fedsparse.cli", "fit"]
        tail = ["--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"]
        if self.state(out) == "resume":  # the run's own configuration: the same run
            return [*base, "--config", str(run / "config.yaml"), *tail, "--ckpt_path",
                    str(run / "checkpoints" / "last.ckpt")]
        return [*base, "--config", self.config, "--seed_everything", str(self.seed),
                *_override_args(self.overrides), *tail]


def _override_args(overrides: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in overrides.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def _parse_assignment(text: str, option: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    check(bool(sep) and bool(key) and not key.startswith("-"), option, text, "KEY=VALUE (e.g. trainer.num_rounds=5)")
    return key, yaml.safe_load(value) if value != "" else ""


def _tag(overrides: dict[str, Any]) -> str:
    """A short directory-name tag of a setting: ``local_epochs2-lr0.05``."""
    parts = [f"{k.rsplit('.', 1)[-1]}{v}" for k, v in overrides.items()]
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", "-".join(parts))[:80]


def _config_stem(config: str) -> str:
    return Path(config).name.removesuffix(".yaml").removesuffix(".yml")


def plan(configs: Sequence[str], seeds: Sequence[int], settings: Sequence[dict[str, Any]],
         common: dict[str, Any]) -> list[SweepRun]:
    """The campaign's runs: configs × settings × seeds, in that order, with ``common`` set on every run.

    Example:
        >>> [r.name for r in plan(["a.yaml", "b"], [0, 1], [{}, {"trainer.local_epochs": 2}], {})]
        ['a-seed0', 'a-seed1', 'a-local_epochs2-seed0', 'a-local_epochs2-seed1', 'b-seed0', 'b-seed1', 'b-local_epochs2-seed0', 'b-local_epochs2-seed1']
    """
    check(len(configs) > 0, "--config", list(configs), "at least one config")
    check(len(seeds) > 0 and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds),
          "--seeds", list(seeds), "one or more ints >= 0")
    check(len(set(seeds)) == len(seeds), "--seeds", list(seeds), "distinct seeds")
    runs, names = [], set()
    for config, setting, seed in itertools.product(configs, settings or [{}], seeds):
        tag = _tag(setting)
        name = f"{_config_stem(config)}{'-' + tag if tag else ''}-seed{seed}"
        check(name not in names, "--config", config, "configs and settings that name distinct runs")
        names.add(name)
        runs.append(SweepRun(name, config, seed, {**common, **setting}))
    return runs


def _settings(vary: Sequence[str], grid_overrides: Any) -> list[dict[str, Any]]:
    """The alternative settings: the product of ``--vary KEY=V1,V2`` options, or a grid file's ``overrides``."""
    if grid_overrides is not None:
        check(isinstance(grid_overrides, list) and all(isinstance(o, dict) for o in grid_overrides), "overrides",
              grid_overrides, "a list of {dotted.key: value} settings")
        return [dict(o) for o in grid_overrides] or [{}]
    axes = []
    for text in vary:
        key, sep, values = text.partition("=")
        check(bool(sep) and bool(key) and bool(values), "--vary", text, "KEY=V1,V2,... (e.g. trainer.local_epochs=1,2)")
        axes.append([(key, yaml.safe_load(v)) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def _validate(runs: Sequence[SweepRun], cwd: Path) -> None:
    """Build every distinct (config, setting) as ``pl-fed fit`` would, without running it
    (:func:`pl_fedsparse.cli.check_entry`, in parallel processes); the first bad one is one line."""
    seen: dict[tuple[str, str], SweepRun] = {}
    for r in runs:
        key = (r.config, json.dumps(r.overrides, sort_keys=True, default=str))
        seen.setdefault(key, r)
    procs = []
    for r in seen.values():
        cmd = [sys.executable, "-c", _CHECK, "--config", r.config, "--seed_everything", str(r.seed),
               *_override_args(r.overrides)]
        procs.append((r, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                          cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})))
    failed = []
    for r, p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            lines = [x for x in err.splitlines() if x.strip()]
            why = lines[-1].removeprefix("error: ") if lines else f"exit status {p.returncode}"
            failed.append(f"{r.name}: {why}")
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise ConfigError(f"sweep entry {failed[0]}{more}; nothing was run")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGTERM when the sweep dies (even by SIGKILL), and stops with a checkpoint."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the sweep died before the call: do not run orphaned
        os._exit(143)


def run_sweep(runs: Sequence[SweepRun], out: Path, parallel: int, cwd: Path) -> list[str]:
    """Run the campaign; returns the names of runs that failed (empty when all finished)."""
    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if r.state(out) != "done"]
    done_before = len(runs) - len(todo)
    cpus = os.cpu_count() or 1
    threads = str(max(1, cpus // parallel))
    running: dict[str, tuple[SweepRun, subprocess.Popen[bytes], float, Any]] = {}
    failed: list[str] = []
    finished = done_before
    start, last_status = time.monotonic(), time.monotonic()
    print(f"sweep: {len(runs)} runs ({done_before} already done), {parallel} at a time, {threads} thread(s) each, "
          f"in {out}", flush=True)
    try:
        while todo or running:
            while todo and len(running) < parallel:
                r = todo.pop(0)
                how = "resuming" if r.state(out) == "resume" else "starting"
                log = open(out / f"{r.name}.log", "ab")  # noqa: SIM115 - closed when the run ends
                env = {**os.environ, "OMP_NUM_THREADS": threads}
                p = subprocess.Popen(r.command(out), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                     preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
                running[r.name] = (r, p, time.monotonic(), log)
                print(f"sweep: {how} {r.name}", flush=True)
            for name, (r, p, t0, log) in list(running.items()):
                code = p.poll()
                if code is None:
                    continue
                log.close()
                del running[name]
                finished += 1
                took = time.monotonic() - t0
                if code == 0:
                    print(f"sweep: {name} done in {took:.0f} s ({finished}/{len(runs)})", flush=True)
                else:
                    failed.append(name)
                    tail = _last_line(out / f"{name}.log")
                    print(f"sweep: {name} failed (exit {code}): {tail} (log {out / (name + '.log')})", flush=True)
            now = time.monotonic()
            if now - last_status >= STATUS_EVERY_S:
                last_status = now
                print(f"sweep: {finished}/{len(runs)} ended, {len(running)} running, {len(todo)} waiting, "
                      f"{now - start:.0f} s", flush=True)
            time.sleep(0.2)
    finally:
        for _, p, _, log in running.values():  # an interrupted sweep stops its runs cleanly (checkpoints)
            p.send_signal(signal.SIGTERM)
        for _, p, _, log in running.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
            log.close()
    return failed


def _last_line(path: Path) -> str:
    try:
        lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def main(argv: Sequence[str] | None = None) -> int:
    """``pl-fed sweep``: parse, check every entry, run, report. Exit status 0 when every run finished."""
    ap = argparse.ArgumentParser(prog="pl-fed sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], help="a config (path or shipped name); repeat for more")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seed_everything of each run (default: 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="set on every run")
    ap.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                    help="alternative values of a key; several --vary give their product")
    ap.add_argument("--grid", default=None, help="a YAML file with configs, seeds, set, overrides, parallel, out")
    ap.add_argument("--parallel", type=int, default=None, help="runs at a time (default: CPU cores // 2, >= 1)")
    ap.add_argument("--out", default=None, help="the sweep's folder (default: runs/sweep)")
    ap.add_argument("--no-report", action="store_true", help="skip pl-fed report at the end")
    a = ap.parse_args(argv)
    cwd = Path.cwd()
    try:
        grid: dict[str, Any] = {}
        if a.grid is not None:
            try:
                grid = yaml.safe_load(Path(a.grid).read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise ConfigError(f"--grid={a.grid!r} is invalid: cannot read it ({' '.join(str(e).split())}); "
                                  "expected a YAML file") from None
            check(isinstance(grid, dict) and set(grid) <= {"configs", "seeds", "set", "overrides", "parallel", "out"},
                  "--grid", a.grid, "a mapping with keys among configs, seeds, set, overrides, parallel, out")
        configs = list(a.config) or list(grid.get("configs") or [])
        seeds = a.seeds if a.seeds is not None else list(grid.get("seeds") or [0])
        common = dict(grid.get("set") or {})
        for text in a.set:
            key, value = _parse_assignment(text, "--set")
            common[key] = value
        settings = _settings(a.vary, None if a.vary else grid.get("overrides"))
        parallel = a.parallel if a.parallel is not None else int(grid.get("parallel") or
                                                                  max(1, (os.cpu_count() or 1) // 2))
        check(isinstance(parallel, int) and parallel >= 1, "--parallel", parallel, "an int >= 1")
        out = Path(a.out or grid.get("out") or "runs/sweep")
        runs = plan(configs, seeds, settings, common)
        _validate(runs, cwd)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    try:
        failed = run_sweep(runs, out, parallel, cwd)
    except KeyboardInterrupt:
        sys.stderr.write("sweep interrupted: its runs stopped with their checkpoints; the same command "
                         "continues it\n")
        return 130
    if not a.no_report:
        from pl_fedsparse.report import main as report_main

        done = [str(out / r.name) for r in runs if r.state(out) == "done"]
        if done:
            report_main([*done, "--out", str(out / "report")])
    if failed:
        sys.stderr.write(f"error: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)} (their logs are in "
                         f"{out}); the same command retries them\n")
        return 1
    return 0
