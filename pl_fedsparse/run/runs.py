"""Finished (or running) runs read back from their run directories, and grouped: runs of one experiment that differ
only in their seeds form a :class:`SeedGroup`.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.run.stats import _mean_std

__all__ = ["LOCATION_KEYS", "Run", "SEED_KEYS", "SeedGroup", "load_run", "seed_curve", "seed_groups"]

log = logging.getLogger(__name__)


#: configuration keys that tell runs of one experiment apart without changing it: the seeds and where it was written
SEED_KEYS = ("seed_everything", "data.seed")

LOCATION_KEYS = ("trainer.default_root_dir", "trainer.overwrite")


@dataclass
class Run:
    """One run directory's records.

    Attributes:
        path: the run directory.
        name: its label in the table and the legends (the directory name unless given).
        method: its callbacks' class names joined by ``+``, less the library's evaluation-only ones
            (``evaluation_only``, e.g. ``ShiftEvaluation``); ``FedAvg`` when none is left; ``?`` without a config.
        rows: the evaluated rows of ``metrics.jsonl``.
        summary: ``summary.json`` (empty while the run is unfinished).
    """

    path: Path
    name: str
    method: str
    rows: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def final(self) -> dict[str, Any]:
        """The last evaluated row (the summary's final row when finished)."""
        return dict(self.summary.get("final") or (self.rows[-1] if self.rows else {}))

    @property
    def finished(self) -> bool:
        return bool(self.summary)


def _method(config_path: Path) -> str:
    try:
        cfg = yaml.safe_load(config_path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return "?"
    callbacks = ((cfg or {}).get("trainer") or {}).get("callbacks") or []
    paths = [str(c.get("class_path", "?")) for c in callbacks if isinstance(c, dict)]
    names = [p.rsplit(".", 1)[-1] for p in paths if not _evaluation_only(p)]
    return " + ".join(names) or "FedAvg"


def _evaluation_only(class_path: str) -> bool:
    """Whether ``class_path`` is one of the library's callbacks that only evaluate. Only ``pl_fedsparse``'s own
    classes are looked up: reading someone's records must not import the modules their config names."""
    module, _, name = class_path.rpartition(".")
    if not (module == "pl_fedsparse" or module.startswith("pl_fedsparse.")):
        return False
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return bool(getattr(cls, "evaluation_only", False))


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Read a run directory; a one-line :class:`~pl_fedsparse.errors.ConfigError` when it is not one."""
    p = Path(path)
    metrics = p / "metrics.jsonl"
    if not p.is_dir():
        what = "a file" if p.exists() else "no such directory"
        raise ConfigError(f"run_dir={str(path)!r} is invalid: {what}; expected a run directory "
                          "(what pl-fed fit writes to --trainer.default_root_dir)")
    if not metrics.is_file():
        raise ConfigError(f"run_dir={str(path)!r} is invalid: it has no metrics.jsonl; expected a run directory "
                          "with at least one evaluated round")
    rows = []
    text = metrics.read_text(encoding="utf-8")
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) and not text.endswith("\n"):  # (a run stopped mid-append: its resume rewrites it)
                log.warning("%s: the last line of metrics.jsonl is cut off (a run stopped while writing it); "
                            "read without it", metrics)
                break
            raise ConfigError(f"run_dir={str(path)!r} is invalid: metrics.jsonl line {i} is not JSON; expected "
                              "the file pl-fed fit writes") from None
        if isinstance(row, dict) and row.get("evaluated", True):  # a round without evaluation has no accuracy
            rows.append(row)
    summary: dict[str, Any] = {}
    if (p / "summary.json").is_file():
        try:
            summary = json.loads((p / "summary.json").read_text(encoding="utf-8"))
        except ValueError:
            raise ConfigError(f"run_dir={str(path)!r} is invalid: summary.json is not JSON") from None
    return Run(p, name or p.resolve().name, _method(p / "config.yaml"), rows, summary)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _experiment(run: Run) -> dict[str, Any] | None:
    """The run's configuration, flattened, without its seeds and location (``None`` without a readable config)."""
    try:
        cfg = yaml.safe_load((run.path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(cfg, dict):
        return None
    return {k: v for k, v in _flat(cfg).items() if k not in SEED_KEYS + LOCATION_KEYS}


def _same_experiment(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal in every key both have. A key only one has is a parameter added by a later version, which writes it
    with its default, so it is not compared."""
    return all(json.dumps(a[k], sort_keys=True, default=str) == json.dumps(b[k], sort_keys=True, default=str)
               for k in a.keys() & b.keys())


@dataclass
class SeedGroup:
    """Runs of one configuration that differ only in their seeds.

    Attributes:
        runs: the runs, in the order given.
        seeds: each run's ``seed_everything`` (``None`` where the config does not say).
    """

    runs: list[Run]
    seeds: list[Any]

    def values(self, key: str) -> list[float]:
        return [float(v) for v in (_value(r, key) for r in self.runs) if v is not None]


def seed_groups(runs: Sequence[Run]) -> list[SeedGroup]:
    """Group ``runs`` whose configurations are equal but for the seeds and the output directory (first-seen order;
    keys only one configuration has are not compared, see :func:`_same_experiment`). A run without a readable
    ``config.yaml`` is a group of its own."""
    out: list[tuple[dict[str, Any] | None, SeedGroup]] = []
    for r in runs:
        exp = _experiment(r)
        try:
            seed = (yaml.safe_load((r.path / "config.yaml").read_text(encoding="utf-8")) or {}).get("seed_everything")
        except (OSError, yaml.YAMLError, AttributeError):
            seed = None
        group = next((g for e, g in out if e is not None and exp is not None and _same_experiment(e, exp)), None)
        if group is None:
            group = SeedGroup([], [])
            out.append((exp, group))
        group.runs.append(r)
        group.seeds.append(seed)
    return [g for _, g in out]


def seed_curve(group: SeedGroup, key: str = "acc_mean") -> tuple[list[int], list[float], list[float]]:
    """``key`` over the rounds for a seed group: the rounds every seed evaluated (1-based), the mean over the seeds
    and the sample standard deviation (0 with one seed) — the line and the band of ``acc_vs_round_seeds.png``.

    Example: seeds reaching 0.60 and 0.70 at round 10 give ``([10], [0.65], [0.0707…])``.
    """
    per_run = [{row["round"]: float(row[key]) for row in r.rows if row.get(key) is not None} for r in group.runs]
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    means, stds = [], []
    for rnd in common:
        mean, std = _mean_std([d[rnd] for d in per_run])
        means.append(mean)
        stds.append(std or 0.0)
    return [rnd + 1 for rnd in common], means, stds


def _seed_key(run: Run) -> tuple[tuple[str, Any], ...] | None:
    """The run's seeds (:data:`SEED_KEYS` that its config sets), what pairs it with another group's run; ``None``
    when it sets none (or ``seed_everything: false``): such a run cannot be paired."""
    try:
        cfg = yaml.safe_load((run.path / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    flat = _flat(cfg) if isinstance(cfg, dict) else {}
    key = tuple((k, flat[k]) for k in SEED_KEYS if flat.get(k) is not None and not isinstance(flat[k], bool))
    return key or None


def _label(group: SeedGroup) -> str:
    return group.runs[0].name + (f" (+{len(group.runs) - 1})" if len(group.runs) > 1 else "")


def _value(run: Run, key: str) -> Any:
    if key in ("comm_cum_bytes_total", "flops_train_cum", "time_cum_s") and key in run.summary:
        return run.summary[key]
    return run.final.get(key)
