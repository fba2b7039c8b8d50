"""``pl-fed report RUN_DIR…``: compare finished (or running) runs — a table of their final metrics and figures.

Reads each run directory's ``metrics.jsonl`` (one row per round; the report uses the evaluated ones), ``summary.json`` (when the run finished)
and ``config.yaml`` (the method's callbacks), and writes next to each other in ``--out``:

* ``report.md`` and ``report.csv`` — one row per run: method, rounds, personal accuracy (mean / weighted / bottom
  decile), global accuracy, the shift and corruption averages and F1/ECE when the run has them, total MB, training
  FLOPs and wall time;
* ``seeds.md`` and ``seeds.csv`` when some runs differ only in their seeds (``seed_everything``, ``data.seed``):
  one row per such group with each column's mean ± sample standard deviation over the seeds and the count, so a
  gap between two methods can be read against the seeds' spread;
* ``pairs.md`` and ``pairs.csv`` when two such groups can be compared: per pair of groups, the gap in final
  accuracy (and in each ``--metrics`` key) ``a − b`` in points with its 95 % interval from Student's t, p and a
  verdict (``holds``: the interval lies above 0; ``reversed``: below; ``not shown``: it holds 0). Runs that share a
  seed are paired (a paired t-test over the shared seeds, at least 2); groups with fewer shared seeds but 2 runs
  or more each get Welch's unpaired test. See :func:`seed_pairs`;
* with matplotlib (``pip install 'pl_fedsparse[plots]'``): ``acc_vs_round.png``, ``acc_vs_traffic.png`` (mean
  personal accuracy against cumulative bytes, the papers' efficiency plot) and ``client_acc.png`` (the per-client
  accuracy distribution at the end). Without matplotlib the table is still written and one line says why the
  figures are not.

Example::

    pl-fed report runs/fedavg runs/fedpse --out runs/compare
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pl_fedsparse.errors import ConfigError

__all__ = ["Run", "SeedGroup", "load_run", "seed_curve", "seed_groups", "seed_table", "seed_pairs", "pair_table",
           "paired_difference", "welch_difference", "t_cdf", "t_quantile", "table_rows", "markdown_table",
           "write_report", "main"]

#: configuration keys that tell runs of one experiment apart without changing it: the seeds and where it was written
SEED_KEYS = ("seed_everything", "data.seed")
LOCATION_KEYS = ("trainer.default_root_dir", "trainer.overwrite")

#: (column, key in the final row, kind) — columns shown when at least one run has the key
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("acc mean %", "acc_mean", "pct"),
    ("acc weighted %", "acc_weighted", "pct"),
    ("acc bottom decile %", "acc_bottom10", "pct"),
    ("global acc %", "global_acc", "pct"),
    ("consensus acc %", "consensus_acc", "pct"),
    ("shift avg acc %", "shift_avg/acc_mean", "pct"),
    ("corruption avg acc %", "corruption_avg/acc_mean", "pct"),
    ("adaptive acc %", "adaptive_acc", "pct"),
    ("F1 macro %", "f1_macro_mean", "pct"),
    ("ECE", "ece_mean", "num"),
    ("total MB", "comm_cum_bytes_total", "mb"),
    ("train FLOPs", "flops_train_cum", "sci"),
    ("time s", "time_cum_s", "sec"),
)


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
        raise ConfigError(f"run_dir={str(path)!r} is invalid: no such directory; expected a run directory "
                          "(what pl-fed fit writes to --trainer.default_root_dir)")
    if not metrics.is_file():
        raise ConfigError(f"run_dir={str(path)!r} is invalid: it has no metrics.jsonl; expected a run directory "
                          "with at least one evaluated round")
    rows = []
    for i, line in enumerate(metrics.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
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


def _mean_std(xs: list[float]) -> tuple[float, float | None]:
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return mean, None
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


# --- paired statistics: Student's t without scipy (the library has no scipy dependency; the tests check against it)

#: two-sided confidence level of the intervals in ``pairs.md``
CONFIDENCE = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function, by the modified Lentz method (Numerical Recipes
    §6.4, ``betacf``); it converges fast for ``x < (a + 1) / (a + b + 2)``."""
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """The regularized incomplete beta function I_x(a, b); ``y`` is ``1 - x``, passed in so that a tail near
    ``x = 1`` keeps its precision. The fraction runs on whichever side converges, I_x(a, b) = 1 - I_y(b, a)."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, y) / b


def _t_two_sided(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom: I_{df/(df+t²)}(df/2, 1/2), computed directly
    (not as 1 - CDF) so that a small p keeps its relative precision."""
    if math.isinf(t):
        return 0.0
    t2 = t * t
    return _betainc(df / 2.0, 0.5, df / (df + t2), t2 / (df + t2))


def t_cdf(t: float, df: float) -> float:
    """Student's t cumulative distribution function P(T <= t) with ``df > 0`` degrees of freedom (not necessarily
    an integer: Welch's are not), from the regularized incomplete beta function.

    Example:
        >>> round(t_cdf(2.0, 3), 10)
        0.9303370157
        >>> t_cdf(0.0, 7)
        0.5
    """
    if not df > 0:
        raise ValueError(f"df={df!r} is invalid; expected a positive number")
    half_tail = 0.5 * _t_two_sided(t, df)
    return 1.0 - half_tail if t >= 0 else half_tail


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile of Student's t with ``df > 0`` degrees of freedom: :func:`t_cdf` inverted by bisection
    (to the last few bits of a float; the CDF is monotone, so bisection cannot miss).

    Example:
        ``t_quantile(0.975, df)`` is the factor of a two-sided 95 % interval — 12.706 with two seeds, 2.776 with
        five, tending to the normal's 1.960:

        >>> [round(t_quantile(0.975, df), 3) for df in (1, 4, 1e6)]
        [12.706, 2.776, 1.96]
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q!r} is invalid; expected a probability strictly between 0 and 1")
    if not df > 0:
        raise ValueError(f"df={df!r} is invalid; expected a positive number")
    if q == 0.5:
        return 0.0
    if q < 0.5:  # symmetric
        return -t_quantile(1.0 - q, df)
    target = 2.0 * (1.0 - q)  # the two-sided tail beyond the quantile; it decreases as t grows
    lo, hi = 0.0, 1.0
    while _t_two_sided(hi, df) > target:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):  # adjacent floats
            break
        if _t_two_sided(mid, df) > target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _verdict(lo: float | None, hi: float | None) -> str:
    """``holds`` when the interval lies above 0, ``reversed`` when below, ``not shown`` when it holds 0 (or there is
    none)."""
    if lo is None or hi is None:
        return "not shown"
    return "holds" if lo > 0 else "reversed" if hi < 0 else "not shown"


def _rounding(xs: Sequence[float]) -> float:
    """What float rounding leaves in a difference of values of ``xs``' size: a spread below it is no spread (0.7 −
    0.6 and 0.8 − 0.7 are not equal as floats, but are the same gap)."""
    return 1e-12 * max((abs(x) for x in xs), default=0.0)


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """The mean of ``a[i] - b[i]`` over pairs (e.g. two methods' accuracies on the same seeds) with Student's t:
    its two-sided interval and the paired t-test's two-sided p (``scipy.stats.ttest_rel``'s).

    Args:
        a: one value per pair.
        b: the other side's value of each pair, in the same order.
        confidence: the interval's two-sided level.

    Returns:
        ``n`` (pairs), ``mean`` (of a − b), ``std`` (sample std of the differences; ``None`` with n < 2), ``df``
        (n − 1), ``t``, ``lo`` and ``hi`` (the interval; ``None`` with n < 2), ``p`` (``None`` with n < 2) and
        ``verdict``: ``"holds"`` when the interval lies above 0, ``"reversed"`` when below, ``"not shown"``
        otherwise and with n < 2.

        When all differences are equal (to float rounding) the spread is 0: the interval is the point itself and
        ``p`` is 0.0 where the difference is not 0 and 1.0 where it is (a difference within rounding of 0 counts as
        0); ``t`` is ±inf or 0.

    Example:
        Three seeds on which ``a`` beats ``b`` by 1, 2 and 3 points:

        >>> r = paired_difference([0.71, 0.72, 0.73], [0.70, 0.70, 0.70])
        >>> round(r["mean"], 6), round(r["lo"], 6), round(r["hi"], 6), round(r["p"], 4), r["verdict"]
        (0.02, -0.004841, 0.044841, 0.0742, 'not shown')
    """
    if len(a) != len(b):
        raise ValueError(f"a and b are invalid: {len(a)} and {len(b)} values; expected one pair per index")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is invalid; expected a level strictly between 0 and 1")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    out: dict[str, Any] = {"n": n, "mean": math.fsum(d) / n if n else math.nan, "std": None, "df": n - 1, "t": None,
                           "lo": None, "hi": None, "p": None, "verdict": "not shown"}
    if n < 2:
        return out
    mean = out["mean"]
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
    out["std"] = std
    tol = _rounding([*a, *b])
    if std <= tol:  # no spread: nothing to estimate it from, the gap is what it is
        mean = out["mean"] = 0.0 if abs(mean) <= tol else mean
        out["std"], out["lo"], out["hi"] = 0.0, mean, mean
        out["t"], out["p"] = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        se = std / math.sqrt(n)
        half = t_quantile(0.5 + confidence / 2, n - 1) * se
        out.update(t=mean / se, lo=mean - half, hi=mean + half, p=_t_two_sided(mean / se, n - 1))
    out["verdict"] = _verdict(out["lo"], out["hi"])
    return out


def welch_difference(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE) -> dict[str, Any]:
    """The difference of the means of two unpaired groups (e.g. two methods run on different seeds) with Welch's
    t: its two-sided interval on the Welch–Satterthwaite degrees of freedom and the two-sided p
    (``scipy.stats.ttest_ind(a, b, equal_var=False)``'s).

    Args:
        a: one group's values.
        b: the other group's values.
        confidence: the interval's two-sided level.

    Returns:
        ``n_a``, ``n_b``, ``mean`` (mean of a − mean of b), ``df``, ``t``, ``lo``, ``hi``, ``p`` and ``verdict`` as
        :func:`paired_difference`'s. With fewer than 2 values on either side there is no interval (``None``s) and the
        verdict is ``"not shown"``. When neither group varies (to float rounding) the interval is the point itself,
        ``df`` is nan and ``p`` is 0.0 or 1.0 as in :func:`paired_difference`.

    Example:
        >>> r = welch_difference([0.70, 0.72, 0.74], [0.60, 0.65, 0.61, 0.62])
        >>> round(r["mean"], 4), round(r["df"], 3), round(r["lo"], 4), round(r["hi"], 4), f"{r['p']:.2e}", r["verdict"]
        (0.1, 4.655, 0.0584, 0.1416, '1.89e-03', 'holds')
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r} is invalid; expected a level strictly between 0 and 1")
    xa, xb = [float(x) for x in a], [float(x) for x in b]
    na, nb = len(xa), len(xb)
    mean = (math.fsum(xa) / na if na else math.nan) - (math.fsum(xb) / nb if nb else math.nan)
    out: dict[str, Any] = {"n_a": na, "n_b": nb, "mean": mean, "df": None, "t": None, "lo": None, "hi": None,
                           "p": None, "verdict": "not shown"}
    if na < 2 or nb < 2:
        return out
    va, vb = (math.fsum((x - math.fsum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1) for xs in (xa, xb))
    tol = _rounding([*xa, *xb])
    if max(va, vb) <= tol * tol:
        mean = out["mean"] = 0.0 if abs(mean) <= tol else mean
        out.update(df=math.nan, lo=mean, hi=mean)
        out["t"], out["p"] = (0.0, 1.0) if mean == 0 else (math.copysign(math.inf, mean), 0.0)
    else:
        sa, sb = va / na, vb / nb
        df = (sa + sb) ** 2 / (sa ** 2 / (na - 1) + sb ** 2 / (nb - 1))
        se = math.sqrt(sa + sb)
        half = t_quantile(0.5 + confidence / 2, df) * se
        out.update(df=df, t=mean / se, lo=mean - half, hi=mean + half, p=_t_two_sided(mean / se, df))
    out["verdict"] = _verdict(out["lo"], out["hi"])
    return out


def seed_table(runs: Sequence[Run], metrics: Sequence[str] = ()) -> tuple[str, str]:
    """Markdown and CSV of the seed groups: per column ``mean ± std (n)`` (sample std over the seeds).

    Example:
        A group of three seeds with final accuracies 0.6670, 0.6301 and 0.6485 shows ``64.85 ± 1.85 (3)``.
    """
    cols = [c for c in COLUMNS + tuple(_extra_column(k) for k in metrics if k not in {c[1] for c in COLUMNS})
            if any(_value(r, c[1]) is not None for r in runs) and c[2] in ("pct", "num", "mb")]
    header = ["runs", "method", "seeds", "rounds"] + [c[0] for c in cols]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["runs", "method", "seeds", "rounds"] + [f"{c[0]} {s}" for c in cols for s in ("mean", "std", "n")])
    for g in seed_groups(runs):
        rounds = sorted({int(r.final.get("round", -1)) + 1 for r in g.runs})
        cells, raw = [], []
        for _, key, kind in cols:
            xs = g.values(key)
            if not xs:
                cells.append("-")
                raw += [None, None, 0]
                continue
            mean, std = _mean_std(xs)
            cells.append(_fmt(mean, kind) + ("" if std is None else f" ± {_fmt(std, kind)}") + f" ({len(xs)})")
            raw += [mean, std, len(xs)]
        names = ", ".join(r.name for r in g.runs)
        seeds = ", ".join(str(s) for s in g.seeds)
        md.append("| " + " | ".join([names, g.runs[0].method, seeds, "/".join(map(str, rounds))] + cells) + " |")
        writer.writerow([names, g.runs[0].method, seeds, "/".join(map(str, rounds))] + raw)
    return "\n".join(md) + "\n", buf.getvalue()


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


def _finite(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _label(group: SeedGroup) -> str:
    return group.runs[0].name + (f" (+{len(group.runs) - 1})" if len(group.runs) > 1 else "")


def seed_pairs(runs: Sequence[Run], metrics: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Each two seed groups (:func:`seed_groups`, first-seen order; ``a`` is the earlier) compared on the final
    ``acc_mean`` and on each key of ``metrics`` that some run has.

    Runs are paired by their seeds (``seed_everything`` and ``data.seed`` equal; where a group repeats a seed its
    first run counts): with at least 2 seeds in common the gap is :func:`paired_difference` over them ("paired t",
    the other seeds left out), since a seed's data split and initialisation move both methods alike; otherwise,
    with at least 2 runs on each side, it is :func:`welch_difference` over all runs ("Welch t (unpaired)"). Groups
    with neither are not compared.

    Returns:
        one dict per (pair, metric): ``a`` and ``b`` (labels: the first run's name, ``(+k)`` for the other seeds),
        ``key``, ``column`` (the metric's label, as in the tables), ``kind``, ``test``, ``n`` (seeds paired, or
        ``"n_a vs n_b"`` unpaired) and the statistics' ``mean``, ``lo``, ``hi``, ``p``, ``verdict``.

    Example:
        Methods A and B on seeds 0, 1, 2, A ahead by 3.0, 2.5 and 3.5 points: ``A − B = 3.00`` points, 95 %
        interval ``[1.76, 4.24]``, p = 0.0091, paired t, verdict ``holds``.
    """
    keys = ["acc_mean"] + [k for k in metrics if k != "acc_mean"]
    known = {c[1]: c for c in COLUMNS}
    cols = [known.get(k) or _extra_column(k) for k in dict.fromkeys(keys)]
    cols = [c for c in cols if any(_value(r, c[1]) is not None for r in runs)]
    groups = [g for g in seed_groups(runs) if len(g.runs) > 1]
    by_seed = []
    for g in groups:
        seeds: dict[Any, Run] = {}
        for r in g.runs:
            k = _seed_key(r)
            if k is not None:
                seeds.setdefault(k, r)
        by_seed.append(seeds)
    out = []
    for i, ga in enumerate(groups):
        for j in range(i + 1, len(groups)):
            gb = groups[j]
            shared = [k for k in by_seed[i] if k in by_seed[j]]
            for column, key, kind in cols:
                pairs = [(_finite(_value(by_seed[i][k], key)), _finite(_value(by_seed[j][k], key))) for k in shared]
                pairs = [(x, y) for x, y in pairs if x is not None and y is not None]
                if len(pairs) >= 2:
                    stats = paired_difference([x for x, _ in pairs], [y for _, y in pairs])
                    test, n = "paired t", str(len(pairs))
                else:
                    xa = [x for x in (_finite(_value(r, key)) for r in ga.runs) if x is not None]
                    xb = [x for x in (_finite(_value(r, key)) for r in gb.runs) if x is not None]
                    if len(xa) < 2 or len(xb) < 2:
                        continue
                    stats = welch_difference(xa, xb)
                    test, n = "Welch t (unpaired)", f"{len(xa)} vs {len(xb)}"
                out.append({"a": _label(ga), "b": _label(gb), "key": key, "column": column, "kind": kind,
                            "test": test, "n": n, **{s: stats[s] for s in ("mean", "lo", "hi", "p", "verdict")}})
    return out


def _fmt_p(p: float | None) -> str:
    return "-" if p is None else "< 0.001" if p < 0.001 else f"{p:.3f}"


def pair_table(runs: Sequence[Run], metrics: Sequence[str] = ()) -> tuple[str, str]:
    """Markdown and CSV of :func:`seed_pairs`: per pair of seed groups and metric, the gap ``a − b`` (in points for
    a % column), its 95 % interval, p, the test and the verdict (``holds``: the interval lies above 0, ``a`` is
    ahead; ``reversed``: below 0; ``not shown``: it holds 0). The CSV has the raw values (fractions, as
    ``report.csv``).

    Example:
        ``| A (+2) | B (+2) | acc mean % | 3 | 3.00 | [1.76, 4.24] | 0.009 | paired t | holds |``
    """
    header = ["a", "b", "metric", "n", "gap a − b", "95 % interval", "p", "test", "verdict (a > b)"]
    md = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["a", "b", "metric", "n", "gap", "ci low", "ci high", "p", "test", "verdict"])
    for row in seed_pairs(runs, metrics):
        kind = row["kind"]
        ci = "-" if row["lo"] is None else f"[{_fmt(row['lo'], kind)}, {_fmt(row['hi'], kind)}]"
        md.append("| " + " | ".join([row["a"], row["b"], row["column"], row["n"], _fmt(row["mean"], kind), ci,
                                     _fmt_p(row["p"]), row["test"], row["verdict"]]) + " |")
        writer.writerow([row["a"], row["b"], row["key"], row["n"], row["mean"], row["lo"], row["hi"], row["p"],
                         row["test"], row["verdict"]])
    return "\n".join(md) + "\n", buf.getvalue()


def _value(run: Run, key: str) -> Any:
    if key in ("comm_cum_bytes_total", "flops_train_cum", "time_cum_s") and key in run.summary:
        return run.summary[key]
    return run.final.get(key)


def _fmt(v: Any, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return {"pct": lambda x: f"{100 * x:.2f}", "num": lambda x: f"{x:.4f}", "mb": lambda x: f"{x / 1e6:.1f}",
            "sci": lambda x: f"{x:.3e}", "sec": lambda x: f"{x:.0f}"}[kind](float(v))


def _extra_column(key: str) -> tuple[str, str, str]:
    kind = "pct" if "acc" in key.rsplit("/", 1)[-1] else ("mb" if key.endswith("bytes") or "_bytes_" in key else "num")
    return (key + (" %" if kind == "pct" else " MB" if kind == "mb" else ""), key, kind)


def table_rows(runs: Sequence[Run], metrics: Sequence[str] = (), baseline: str | None = None
               ) -> tuple[list[str], list[list[str]], list[list[Any]]]:
    """Header, formatted cells and raw values (for the CSV) of the comparison table.

    Args:
        runs: the runs, one row each.
        metrics: extra columns: keys of the final row (e.g. ``shift50/acc_mean``, ``personal_only_acc``); a key with
            ``acc`` in its last part is shown in %, one with ``bytes`` in MB.
        baseline: the name of one of the runs: adds total bytes and training FLOPs relative to it (``vs <name>``).

    Columns that no run has (e.g. shift averages without ``ShiftEvaluation``) are left out.
    """
    cols = [c for c in COLUMNS + tuple(_extra_column(k) for k in metrics if k not in {c[1] for c in COLUMNS})
            if any(_value(r, c[1]) is not None for r in runs)]
    base = None
    if baseline is not None:
        base = next((r for r in runs if r.name == baseline), None)
        if base is None:
            raise ConfigError(f"baseline={baseline!r} is invalid: no run of that name; expected one of "
                              + ", ".join(r.name for r in runs))
    header = ["run", "method", "rounds"] + [c[0] for c in cols]
    if base is not None:
        header += [f"bytes vs {base.name} %", f"FLOPs vs {base.name} %"]
    cells, raw = [], []
    for r in runs:
        rounds = int(r.final.get("round", -1)) + 1
        status = "" if r.finished else " (unfinished)"
        values = [_value(r, key) for _, key, _ in cols]
        row_cells = [r.name + status, r.method, str(rounds)] + [_fmt(v, kind) for v, (_, _, kind) in zip(values, cols)]
        if base is not None:
            rel = [None if not _value(base, k) or _value(r, k) is None else _value(r, k) / _value(base, k)
                   for k in ("comm_cum_bytes_total", "flops_train_cum")]
            values += rel
            row_cells += [_fmt(v, "pct") for v in rel]
        cells.append(row_cells)
        raw.append([r.name, r.method, rounds] + values)
    return header, cells, raw


def markdown_table(runs: Sequence[Run], metrics: Sequence[str] = (), baseline: str | None = None) -> str:
    """The comparison table in markdown (arguments as :func:`table_rows`)."""
    header, cells, _ = table_rows(runs, metrics, baseline)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def _csv(runs: Sequence[Run], metrics: Sequence[str] = (), baseline: str | None = None) -> str:
    header, _, raw = table_rows(runs, metrics, baseline)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(raw)
    return buf.getvalue()


def _save(fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend, tight layout; write ``fig`` to ``path`` and return it."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _figures(runs: Sequence[Run], out: Path) -> list[Path]:
    # matplotlib's object-oriented API: no pyplot, so no backend or global figure state is touched (safe inside a
    # notebook or a GUI session); savefig renders with Agg
    from matplotlib.figure import Figure

    written = []
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for r in runs:
        ax.plot([row["round"] + 1 for row in r.rows], [100 * row["acc_mean"] for row in r.rows], marker="o", ms=3,
                label=r.name)
    ax.set(xlabel="round", ylabel="personal accuracy, mean over clients (%)", title="accuracy vs round")
    written.append(_save(fig, ax, out / "acc_vs_round.png"))

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for r in runs:
        pts = [(row["comm_cum_bytes_total"] / 1e6, 100 * row["acc_mean"]) for row in r.rows
               if "comm_cum_bytes_total" in row]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=r.name)
    totals = [row["comm_cum_bytes_total"] for r in runs for row in r.rows if row.get("comm_cum_bytes_total")]
    if totals and max(totals) > 20 * min(totals):  # sparse and dense methods differ by orders of magnitude
        ax.set_xscale("log")
    ax.set(xlabel="cumulative traffic (MB)", ylabel="personal accuracy, mean over clients (%)",
           title="accuracy vs communication")
    written.append(_save(fig, ax, out / "acc_vs_traffic.png"))

    repeated = [g for g in seed_groups(runs) if len(g.runs) > 1]
    if repeated:  # one line per group of seeds: their mean, and a band of ± one sample standard deviation
        fig = Figure(figsize=(6, 4))
        ax = fig.subplots()
        for g in repeated:
            rounds, mean, std = seed_curve(g)
            label = f"{g.runs[0].name} ({len(g.runs)} seeds)"
            line = ax.plot(rounds, [100 * m for m in mean], marker="o", ms=3, label=label)[0]
            ax.fill_between(rounds, [100 * (m - s) for m, s in zip(mean, std)],
                            [100 * (m + s) for m, s in zip(mean, std)], color=line.get_color(), alpha=0.2)
        ax.set(xlabel="round", ylabel="personal accuracy, mean over clients (%)",
               title="accuracy vs round: mean ± std over seeds")
        written.append(_save(fig, ax, out / "acc_vs_round_seeds.png"))

    with_clients = [r for r in runs if r.summary.get("client_acc")]
    if with_clients:
        fig = Figure(figsize=(max(4.0, 1.2 * len(with_clients) + 2), 4))
        ax = fig.subplots()
        data = [[100 * a for a in r.summary["client_acc"]] for r in with_clients]
        ax.boxplot(data, showmeans=True)
        for i, d in enumerate(data, 1):
            ax.scatter([i] * len(d), d, s=8, alpha=0.5)
        ax.set_xticks(range(1, len(with_clients) + 1), [r.name for r in with_clients], rotation=20, fontsize=8)
        ax.set(ylabel="personal accuracy per client (%)", title="per-client accuracy at the end")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        written.append(out / "client_acc.png")
        fig.savefig(written[-1], dpi=110)
    return written


def write_report(runs: Sequence[Run], out: str | Path, figures: bool = True, metrics: Sequence[str] = (),
                 baseline: str | None = None) -> dict[str, Any]:
    """Write ``report.md``, ``report.csv`` (and ``seeds.*``, ``pairs.*`` where seeds repeat) and (with matplotlib)
    the figures to ``out``; return what was written
    (``{"table": path, "csv": path, "figures": [paths], "figures_skipped": reason or None}``). ``metrics`` and
    ``baseline`` as :func:`table_rows`."""
    out_dir = Path(out)
    table, table_csv = markdown_table(runs, metrics, baseline), _csv(runs, metrics, baseline)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "report.md").write_text(table, encoding="utf-8")
        (out_dir / "report.csv").write_text(table_csv, encoding="utf-8")
        if any(len(g.runs) > 1 for g in seed_groups(runs)):
            seeds_md, seeds_csv = seed_table(runs, metrics)
            (out_dir / "seeds.md").write_text(seeds_md, encoding="utf-8")
            (out_dir / "seeds.csv").write_text(seeds_csv, encoding="utf-8")
        if seed_pairs(runs, metrics):
            pairs_md, pairs_csv = pair_table(runs, metrics)
            (out_dir / "pairs.md").write_text(pairs_md, encoding="utf-8")
            (out_dir / "pairs.csv").write_text(pairs_csv, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"out={str(out)!r} is invalid: {e.strerror or e}; expected a writable directory") from None
    result: dict[str, Any] = {"table": out_dir / "report.md", "csv": out_dir / "report.csv", "figures": [],
                              "figures_skipped": None}
    if not figures:
        result["figures_skipped"] = "--no-figures"
        return result
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        result["figures_skipped"] = "matplotlib is not installed (pip install 'pl_fedsparse[plots]')"
        return result
    result["figures"] = _figures(runs, out_dir)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``pl-fed report``'s entry point; returns the exit code (2 on a bad argument, with a one-line error)."""
    parser = argparse.ArgumentParser(prog="pl-fed report", description="Compare run directories: a table of their "
                                     "final metrics (markdown + CSV) and figures.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (pl-fed fit's output)")
    parser.add_argument("--out", default="report", help="where to write report.md, report.csv and the figures "
                        "(default: ./report)")
    parser.add_argument("--names", nargs="+", default=None, help="labels of the runs (default: directory names)")
    parser.add_argument("--metrics", nargs="+", default=[], metavar="KEY",
                        help="extra columns: keys of the final metrics row (e.g. shift50/acc_mean)")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="add bytes and FLOPs relative to the run of this name")
    parser.add_argument("--no-figures", action="store_true", help="write the table only")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        if args.names is not None and len(args.names) != len(args.run_dirs):
            raise ConfigError(f"names={args.names!r} is invalid: {len(args.names)} names for "
                              f"{len(args.run_dirs)} runs; expected one name per RUN_DIR")
        names = args.names or [None] * len(args.run_dirs)
        runs = [load_run(d, n) for d, n in zip(args.run_dirs, names)]
        result = write_report(runs, args.out, figures=not args.no_figures, metrics=args.metrics,
                              baseline=args.baseline)
    except ConfigError as e:
        print(f"pl-fed report: error: {e}", file=sys.stderr)
        return 2
    print(markdown_table(runs, args.metrics, args.baseline), end="")
    if any(len(g.runs) > 1 for g in seed_groups(runs)):
        print("\nAcross seeds (mean ± sample std (n)):\n" + seed_table(runs, args.metrics)[0], end="")
    if seed_pairs(runs, args.metrics):
        print("\nPairs of seed groups (gap a − b with its 95 % interval; paired t on shared seeds):\n"
              + pair_table(runs, args.metrics)[0], end="")
    print(f"\ntable: {result['table']}, {result['csv']}")
    if result["figures"]:
        print("figures: " + ", ".join(str(p) for p in result["figures"]))
    else:
        print(f"figures: none ({result['figures_skipped']})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
