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
import io
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.run.atomic import atomic_write_text
from pl_fedsparse.run.figures import _figures
from pl_fedsparse.run.runs import Run, _label, _seed_key, _value, load_run, seed_groups
from pl_fedsparse.run.stats import _mean_std, paired_difference, welch_difference

__all__ = ["main", "markdown_table", "pair_table", "seed_pairs", "seed_table", "table_rows", "write_report"]


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
        cells: list[str] = []
        raw: list[float | int | None] = []
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


def _finite(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


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
                both = [(_finite(_value(by_seed[i][k], key)), _finite(_value(by_seed[j][k], key))) for k in shared]
                pairs = [(x, y) for x, y in both if x is not None and y is not None]
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
        atomic_write_text(out_dir / "report.md", table)
        atomic_write_text(out_dir / "report.csv", table_csv)
        if any(len(g.runs) > 1 for g in seed_groups(runs)):
            seeds_md, seeds_csv = seed_table(runs, metrics)
            atomic_write_text(out_dir / "seeds.md", seeds_md)
            atomic_write_text(out_dir / "seeds.csv", seeds_csv)
        if seed_pairs(runs, metrics):
            pairs_md, pairs_csv = pair_table(runs, metrics)
            atomic_write_text(out_dir / "pairs.md", pairs_md)
            atomic_write_text(out_dir / "pairs.csv", pairs_csv)
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
        if args.names is not None and len(set(args.names)) != len(args.names):
            twice = sorted({n for n in args.names if args.names.count(n) > 1})
            raise ConfigError(f"names={args.names!r} is invalid: {', '.join(map(repr, twice))} given twice; "
                              "expected distinct names")
        names = args.names or [None] * len(args.run_dirs)
        runs = [load_run(d, n) for d, n in zip(args.run_dirs, names)]
        found = {k for r in runs for k in (r.final or {})} | {k for r in runs for k in r.summary}
        unknown = [m for m in args.metrics if m not in found]
        if unknown:
            keys = sorted(k for k in found if not k.startswith("time"))
            which = "that key" if len(unknown) == 1 else "these keys"
            raise ConfigError(f"metrics={unknown!r} is invalid: no run has {which} in its final row; expected keys "
                              f"such as {', '.join(keys[:12])}")
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
