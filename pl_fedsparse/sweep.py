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
* **the report**: at the end, ``pl-fed report`` over every run (seeds grouped; with ``--out``'s ``report/``);
* **a plan's own shape** (grid file): a ``configs`` entry may be ``{config, name, set}`` (a method: its config, its
  label, its own settings), ``name`` is the run directories' pattern (``"{config}_seed{seed}"``: fields ``config``,
  ``setting``, ``seed``), a value ``"{seed}"`` is the run's seed (``data.seed: "{seed}"``), ``seed_first: true``
  runs every entry at the first seed before the next seed, and ``record`` is a folder (kept in git) that receives
  each finished run's ``config.yaml``, ``metrics.jsonl`` and ``summary.json`` as ``<record>/<name>/``: a run
  recorded there counts as done, wherever its run directory went;
* **a look first**: ``--dry-run`` lists every run (name, state, its ``pl-fed fit`` arguments) and changes nothing;
  ``--only GLOB`` keeps the runs whose name matches.

Why processes and not Ray Tune: every run is already a resumable, self-contained ``pl-fed fit`` with its own
checkpoints and one-line errors; on one machine, a pool of processes sized to the cores packs them with nothing
more to install, and the runs' directories are the campaign's state (no second store to keep in step). A cluster
campaign can run the same runs as scheduler jobs (the SLURM recipe of ``docs/usage.md``).

Example::

    pl-fed sweep --config quickstart --config synthetic_fedspa --seeds 0 1 2 --set trainer.num_rounds=5 \\
        --parallel 2 --out runs/sweep
    pl-fed sweep --grid configs/sweeps/cifar10_baselines.yaml --set data.root=data/cifar10 --dry-run
"""

from __future__ import annotations

import argparse
import ctypes
import fnmatch
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pl_fedsparse.errors import ConfigError, check
from pl_fedsparse.signals import exit_status, stop_on_signals, stop_word

__all__ = ["Campaign", "Entry", "SweepRun", "campaign", "main", "plan"]

#: the per-entry check, in a process of its own (the entry's user modules): pl_fedsparse.cli.check_entry
_CHECK = "import sys; from pl_fedsparse.cli import check_entry; sys.exit(check_entry(sys.argv[1:]))"

#: how often the campaign's state is printed while runs go on (seconds)
STATUS_EVERY_S = 30.0
#: a finished run's files copied to a sweep's ``record`` folder
RECORD_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
#: a setting value replaced by the run's seed
SEED = "{seed}"
#: the keys of a grid file
GRID_KEYS = ("configs", "seeds", "set", "overrides", "parallel", "out", "name", "record", "seed_first")


@dataclass
class Entry:
    """A config of the grid with a label and settings of its own (a method of a plan: its config and callbacks).

    Attributes:
        config: a path or a shipped name.
        name: its label in run names (``{config}`` of the name pattern; default: the config's file stem).
        overrides: dotted keys set on its runs only (over the sweep's ``set``, under a setting of ``overrides``).
    """

    config: str
    name: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name or _config_stem(self.config)


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
    #: its (config, settings) before the seed is filled in: runs that differ only by seed are checked once
    group: str = field(default="", repr=False, compare=False)

    def state(self, out: Path, record: Path | None = None) -> str:
        """``done`` (a ``summary.json`` in its run directory or its record), ``resume`` (a checkpoint, unfinished)
        or ``new``."""
        run = out / self.name
        if (run / "summary.json").is_file() or (record is not None and (record / self.name / "summary.json").is_file()):
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
        return [*base, *self.fit_args(), *tail]

    def fit_args(self) -> list[str]:
        """Its ``pl-fed fit`` arguments: the config, the seed, every override (in the order set, entry, setting)."""
        return ["--config", self.config, "--seed_everything", str(self.seed), *_override_args(self.overrides)]


def _override_args(overrides: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in overrides.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def _parse_assignment(text: str, option: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    check(bool(sep) and bool(key) and not key.startswith("-"), option, text, "KEY=VALUE (e.g. trainer.num_rounds=5)")
    if value == SEED:  # the run's seed (YAML would read it as a mapping)
        return key, SEED
    return key, yaml.safe_load(value) if value != "" else ""


def _tag(overrides: dict[str, Any]) -> str:
    """A short directory-name tag of a setting: ``local_epochs2-lr0.05``."""
    parts = [f"{k.rsplit('.', 1)[-1]}{v}" for k, v in overrides.items()]
    return re.sub(r"[^A-Za-z0-9_.=+-]", "_", "-".join(parts))[:80]


def _config_stem(config: str) -> str:
    return Path(config).name.removesuffix(".yaml").removesuffix(".yml")


def plan(configs: Sequence[str | Entry], seeds: Sequence[int], settings: Sequence[dict[str, Any]],
         common: dict[str, Any], name: str | None = None, seed_first: bool = False) -> list[SweepRun]:
    """The campaign's runs: configs × settings × seeds, in that order, with ``common`` set on every run.

    Args:
        configs: configs (paths or shipped names) or :class:`Entry` (a config with its label and settings).
        seeds: each run's ``seed_everything``.
        settings: the alternative settings (``{dotted.key: value}``); ``[{}]``: one.
        common: set on every run (under an entry's and a setting's own values).
        name: the run directories' pattern, fields ``{config}`` (the entry's label), ``{setting}`` (a tag of the
            setting), ``{seed}``; default ``<config>[-<setting>]-seed<seed>``.
        seed_first: seeds × configs × settings instead: every config and setting at the first seed, then at the
            next (a campaign stopped midway still has whole tables).

    A value ``"{seed}"`` becomes the run's seed.

    Example:
        >>> [r.name for r in plan(["a.yaml", "b"], [0, 1], [{}, {"trainer.local_epochs": 2}], {})]
        ['a-seed0', 'a-seed1', 'a-local_epochs2-seed0', 'a-local_epochs2-seed1', 'b-seed0', 'b-seed1', 'b-local_epochs2-seed0', 'b-local_epochs2-seed1']
        >>> r = plan([Entry("a.yaml", "fedavg", {"data.seed": "{seed}"})], [3], [{}], {}, name="{config}_seed{seed}")
        >>> r[0].name, r[0].overrides
        ('fedavg_seed3', {'data.seed': 3})
    """
    check(len(configs) > 0, "--config", list(configs), "at least one config")
    check(len(seeds) > 0 and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds),
          "--seeds", list(seeds), "one or more ints >= 0")
    check(len(set(seeds)) == len(seeds), "--seeds", list(seeds), "distinct seeds")
    entries = [c if isinstance(c, Entry) else Entry(c) for c in configs]
    runs, names = [], set()
    grid: Iterable[tuple[Entry, dict[str, Any], int]] = itertools.product(entries, settings or [{}], seeds)
    if seed_first:
        grid = ((e, st, sd) for sd, e, st in itertools.product(seeds, entries, settings or [{}]))
    for entry, setting, seed in grid:
        tag = _tag(setting)
        if name is None:
            run_name = f"{entry.label}{'-' + tag if tag else ''}-seed{seed}"
            check(run_name not in names, "--config", entry.config, "configs and settings that name distinct runs")
        else:
            run_name = _format_name(name, entry.label, tag, seed)
            check(run_name not in names, "name", name, "a pattern that names every run apart (e.g. "
                  "'{config}-{setting}-seed{seed}')")
        names.add(run_name)
        template = {**common, **entry.overrides, **setting}
        overrides = {k: seed if isinstance(v, str) and v == SEED else v for k, v in template.items()}
        runs.append(SweepRun(run_name, entry.config, seed, overrides,
                             group=json.dumps([entry.config, template], sort_keys=True, default=str)))
    return runs


def _format_name(pattern: str, label: str, tag: str, seed: int) -> str:
    """A run's directory name from the grid's ``name`` pattern."""
    try:
        text = pattern.format(config=label, setting=tag, seed=seed)
    except (KeyError, IndexError, ValueError, AttributeError):
        text = ""
    check(re.fullmatch(r"[A-Za-z0-9_.=+-]+", text) is not None and text not in (".", ".."), "name", pattern,
          "a pattern with fields among {config}, {setting}, {seed} giving a folder name (letters, digits, _.=+-)")
    return text


def _entries(items: Any) -> list[str | Entry]:
    """A grid file's ``configs``: configs, or ``{config, name, set}`` entries."""
    check(isinstance(items, list), "configs", items, "a list of configs or {config, name, set} entries")
    out: list[str | Entry] = []
    for item in items:
        if isinstance(item, str):
            out.append(item)
            continue
        ok = (isinstance(item, dict) and set(item) <= {"config", "name", "set"} and isinstance(item.get("config"), str)
              and isinstance(item.get("name", ""), str) and isinstance(item.get("set") or {}, dict))
        check(ok, "configs", item, "a config (a path or a shipped name) or {config: ..., name: ..., set: {...}}")
        check(item.get("name") is None or re.fullmatch(r"[A-Za-z0-9_.=+-]+", item["name"]) is not None
              and item["name"] not in (".", ".."), "configs", item, "a name made of letters, digits and _.=+-")
        out.append(Entry(item["config"], item.get("name"), dict(item.get("set") or {})))
    return out


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
    seen: dict[str, SweepRun] = {}
    for r in runs:
        seen.setdefault(r.group or json.dumps([r.config, r.overrides], sort_keys=True, default=str), r)
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


def record_run(out: Path, record: Path, name: str) -> bool:
    """Copy a finished run's :data:`RECORD_FILES` to ``<record>/<name>/`` (True when it did; a run without a
    ``summary.json`` is not finished)."""
    if not (out / name / "summary.json").is_file():
        return False
    (record / name).mkdir(parents=True, exist_ok=True)
    for f in RECORD_FILES:
        if (out / name / f).is_file():
            shutil.copy2(out / name / f, record / name / f)
    return True


def run_sweep(runs: Sequence[SweepRun], out: Path, parallel: int, cwd: Path,
              record: Path | None = None) -> list[str]:
    """Run the campaign; returns the names of runs that failed (empty when all finished). With ``record``, every
    finished run's record files are copied there (also those of runs that finished before this call)."""
    out.mkdir(parents=True, exist_ok=True)
    if record is not None:
        for r in runs:
            if not (record / r.name / "summary.json").is_file():
                record_run(out, record, r.name)
    todo = [r for r in runs if r.state(out, record) != "done"]
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
                    if record is not None:
                        record_run(out, record, name)
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


@dataclass
class Campaign:
    """A sweep as its command line names it (:func:`campaign`).

    Attributes:
        runs: the runs, in the order they start.
        out: the folder of their run directories and logs.
        record: where finished runs' record files are copied (``None``: nowhere).
        parallel: runs at a time.
    """

    runs: list[SweepRun]
    out: Path
    record: Path | None
    parallel: int


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pl-fed sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", action="append", default=[], help="a config (path or shipped name); repeat for more")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="seed_everything of each run (default: 0)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="set on every run")
    ap.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                    help="alternative values of a key; several --vary give their product")
    ap.add_argument("--grid", default=None, help=f"a YAML file with keys among {', '.join(GRID_KEYS)}")
    ap.add_argument("--parallel", type=int, default=None, help="runs at a time (default: CPU cores // 2, >= 1)")
    ap.add_argument("--out", default=None, help="the sweep's folder (default: runs/sweep)")
    ap.add_argument("--name", default=None, metavar="PATTERN",
                    help="run directory names, fields {config}, {setting}, {seed} (e.g. '{config}_seed{seed}')")
    ap.add_argument("--record", default=None, metavar="DIR",
                    help="copy each finished run's config.yaml, metrics.jsonl, summary.json to DIR/<name>/")
    ap.add_argument("--only", action="append", default=[], metavar="GLOB",
                    help="keep the runs whose name matches (repeat for more)")
    ap.add_argument("--seed-first", action="store_true", default=None,
                    help="every config and setting at the first seed, then the next (default: config by config)")
    ap.add_argument("--dry-run", action="store_true", help="list the runs and their pl-fed fit arguments; run nothing")
    ap.add_argument("--no-report", action="store_true", help="skip pl-fed report at the end")
    return ap


def campaign(argv: Sequence[str]) -> Campaign:
    """The campaign that ``pl-fed sweep ARGV`` runs, without checking or running anything.

    Raises:
        ConfigError: a bad grid file or value (one line naming it).

    Example:
        >>> c = campaign(["--config", "quickstart", "--seeds", "0", "1", "--set", "trainer.num_rounds=2"])
        >>> [(r.name, r.fit_args()[-2:]) for r in c.runs]
        [('quickstart-seed0', ['--trainer.num_rounds', '2']), ('quickstart-seed1', ['--trainer.num_rounds', '2'])]
    """
    a = _parser().parse_args(list(argv))
    return _campaign(a)


def _campaign(a: argparse.Namespace) -> Campaign:
    grid: dict[str, Any] = {}
    if a.grid is not None:
        try:
            grid = yaml.safe_load(Path(a.grid).read_text()) or {}
        except (OSError, yaml.YAMLError, UnicodeDecodeError) as e:
            raise ConfigError(f"--grid={a.grid!r} is invalid: cannot read it ({' '.join(str(e).split())}); "
                              "expected a YAML file") from None
        check(isinstance(grid, dict) and set(grid) <= set(GRID_KEYS), "--grid", a.grid,
              f"a mapping with keys among {', '.join(GRID_KEYS)}")
        _check_grid_values(grid, a.grid)
    configs = list(a.config) or _entries(grid.get("configs") or [])
    seeds = a.seeds if a.seeds is not None else list(grid.get("seeds") or [0])
    common = dict(grid.get("set") or {})
    for text in a.set:
        key, value = _parse_assignment(text, "--set")
        common[key] = value
    settings = _settings(a.vary, None if a.vary else grid.get("overrides"))
    parallel = a.parallel if a.parallel is not None else grid.get("parallel", max(1, (os.cpu_count() or 1) // 2))
    check(isinstance(parallel, int) and parallel >= 1, "--parallel", parallel, "an int >= 1")
    name = a.name if a.name is not None else grid.get("name")
    check(name is None or isinstance(name, str), "name", name, "a pattern such as '{config}_seed{seed}'")
    seed_first = a.seed_first if a.seed_first is not None else grid.get("seed_first", False)
    check(isinstance(seed_first, bool), "seed_first", seed_first, "true or false")
    runs = plan(configs, seeds, settings, common, name, seed_first)
    if a.only:
        runs = [r for r in runs if any(fnmatch.fnmatchcase(r.name, g) for g in a.only)]
        check(bool(runs), "--only", a.only, "globs matching at least one run's name (--dry-run lists them)")
    record = a.record if a.record is not None else grid.get("record")
    return Campaign(runs, Path(a.out or grid.get("out") or "runs/sweep"),
                    Path(record) if record is not None else None, parallel)


def _check_grid_values(grid: dict[str, Any], path: str) -> None:
    """A grid file's values, each of its type, in one line naming the file and the key (before they are used)."""
    def bad(key: str, allowed: str) -> None:
        raise ConfigError(f"--grid={path!r}: {key}={grid[key]!r} is invalid: expected {allowed}")

    if "set" in grid and not isinstance(grid["set"], (dict, type(None))):
        bad("set", "a mapping {dotted.key: value}")
    if "seeds" in grid and not (grid["seeds"] is None or isinstance(grid["seeds"], list) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in grid["seeds"])):
        bad("seeds", "a list of ints")
    if "parallel" in grid and not (isinstance(grid["parallel"], int) and not isinstance(grid["parallel"], bool)
                                   and grid["parallel"] >= 1):
        bad("parallel", "an int >= 1")
    for key in ("record", "out"):
        if key in grid and not (grid[key] is None or isinstance(grid[key], str)):
            bad(key, "a folder path")
    if "configs" in grid and not (grid["configs"] is None or isinstance(grid["configs"], list)):
        bad("configs", "a list of config files or names")


def _writable_folder(option: str, folder: Path) -> None:
    """``folder`` made (or found) and writable, else one line naming ``option`` — before any run starts."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option}={str(folder)!r} is invalid: expected a writable folder ({e.strerror or e})"
                          ) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{option}={str(folder)!r} is invalid: expected a writable folder (Permission denied)")


def _list(c: Campaign) -> None:
    """``--dry-run``: one line per run (name, state, ``pl-fed fit`` arguments), then a count."""
    states = [r.state(c.out, c.record) for r in c.runs]
    for r, state in zip(c.runs, states):
        print(f"{r.name} [{state}]: pl-fed fit {' '.join(_quote(x) for x in r.fit_args())}")
    todo = sum(s != "done" for s in states)
    print(f"sweep (dry run): {len(c.runs)} runs, {len(c.runs) - todo} done, {todo} to run, {c.parallel} at a time, "
          f"in {c.out}" + (f", recorded in {c.record}" if c.record is not None else ""))


def _quote(arg: str) -> str:
    return arg if re.fullmatch(r"[\w./=:,+@%-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def main(argv: Sequence[str] | None = None) -> int:
    """``pl-fed sweep``: parse, check every entry, run, report. Exit status 0 when every run finished."""
    a = _parser().parse_args(argv)
    cwd = Path.cwd()
    try:
        c = _campaign(a)
        if a.dry_run:
            _list(c)
            return 0
        _validate(c.runs, cwd)
        for option, folder in (("--out", c.out), ("--record", c.record)):
            if folder is not None:
                _writable_folder(option, folder)
    except ConfigError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    runs, out = c.runs, c.out
    try:
        with stop_on_signals():  # (SIGTERM, as Ctrl-C: the runs stop with their checkpoints)
            failed = run_sweep(runs, out, c.parallel, cwd, c.record)
    except KeyboardInterrupt as e:
        sys.stderr.write(f"sweep {stop_word(e)}: its runs stopped with their checkpoints; the same command continues it\n")
        return exit_status(e)
    except OSError as e:  # (a record folder that stopped taking files mid-campaign)
        sys.stderr.write(f"error: {e.filename or out}: {e.strerror or e}; the same command continues the sweep\n")
        return 74
    if not a.no_report:
        from pl_fedsparse.run.report import main as report_main

        done = [str(out / r.name) if c.record is None or (out / r.name / "summary.json").is_file()
                else str(c.record / r.name)
                for r in runs if r.state(out, c.record) == "done"]
        if done:
            report_main([*done, "--out", str(out / "report")])
    if failed:
        sys.stderr.write(f"error: {len(failed)} of {len(runs)} runs failed: {', '.join(failed)} (their logs are in "
                         f"{out}); the same command retries them\n")
        return 1
    return 0
