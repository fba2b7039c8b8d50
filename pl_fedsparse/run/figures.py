"""The figures of ``pl-fed report``: accuracy by round, accuracy by traffic, and each seed group's mean ± std curve."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pl_fedsparse.run.atomic import atomic_write_bytes
from pl_fedsparse.run.runs import Run, seed_curve, seed_groups


def _save(fig: Any, ax: Any, path: Path) -> Path:
    """Grid, legend, tight layout; write ``fig`` to ``path`` and return it."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _write_png(fig, path)


def _write_png(fig: Any, path: Path) -> Path:
    """``fig`` as a PNG at ``path``, written whole or not at all (an interrupt leaves the previous file)."""
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    atomic_write_bytes(path, image.getvalue())
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
        written.append(_write_png(fig, out / "client_acc.png"))
    return written
