"""Reporting: the run directory, ``metrics.jsonl``, TensorBoard, ``summary.json`` and the printed results table.

Nothing here knows a method. The results table shows the headline accuracies and costs every run has; callbacks add
lines for the metrics they produce through the ``report_rows`` hook (e.g. ``("adaptive acc", "adaptive_acc")``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pl_fedsparse.checkpoint import atomic_write_text, dumps_json, save_checkpoint
from pl_fedsparse.errors import ConfigError

if TYPE_CHECKING:
    from pl_fedsparse.loop import FederatedLoop

__all__ = ["RunReporter", "results_table"]


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def results_table(summary: Mapping[str, Any], rows: Sequence[tuple[str, str]] = (),
                  title: str = "final results") -> str:
    """A small text table of the headline numbers; ``rows`` are extra ``(label, metric key)`` lines shown when the
    metric is present.

    Example:
        >>> print(results_table({"round": 3, "acc_mean": 0.5, "x": 0.25}, [("my metric", "x")], title="t"))
        ... # doctest: +NORMALIZE_WHITESPACE
        == t =====...
        round                                     3
        personal acc (mean over clients)     50.00%
        personal acc (sample-weighted)            -
        personal acc (std)                        -
        personal acc (bottom decile)              -
        global model acc                          -
        my metric                            25.00%
    """
    row = summary.get("final", summary)
    items = [
        ("round", str(row.get("round", "-"))),
        ("personal acc (mean over clients)", _pct(row.get("acc_mean"))),
        ("personal acc (sample-weighted)", _pct(row.get("acc_weighted"))),
        ("personal acc (std)", _pct(row.get("acc_std"))),
        ("personal acc (bottom decile)", _pct(row.get("acc_bottom10"))),
        ("global model acc", _pct(row.get("global_acc"))),
    ]
    items += [(label, _pct(row[key])) for label, key in rows if row.get(key) is not None]
    if "comm_cum_bytes_total" in summary:
        items += [
            ("communication total (MB)", f"{summary['comm_cum_bytes_total'] / 1e6:.2f}"),
            ("busiest node (MB)", f"{summary['comm_cum_busiest_node_bytes'] / 1e6:.2f}"),
            ("training FLOPs (total)", f"{summary['flops_train_cum']:.3e}"),
            ("wall time (s)", f"{summary['time_cum_s']:.1f}"),
        ]
    width = max(len(k) for k, _ in items)
    lines = [f"== {title} " + "=" * max(0, width + 12 - len(title))]
    lines += [f"{k.ljust(width)}  {v:>10}" for k, v in items]
    if summary.get("run_dir"):
        lines.append(f"run directory: {summary['run_dir']}")
    return "\n".join(lines)


class RunReporter:
    """Owns a run directory: creates it (refusing one that holds another run), writes ``config.yaml``, appends
    evaluated rows to ``metrics.jsonl`` and TensorBoard, writes ``summary.json`` and prints the results table."""

    def __init__(self, loop: FederatedLoop) -> None:
        self.loop = loop
        self.run_dir: Path | None = None
        self._writer: Any = None

    def path(self, name: str) -> Path:
        assert self.run_dir is not None
        return self.run_dir / name

    def open(self, resuming: bool, history: Sequence[Mapping[str, Any]], checkpoint: Mapping[str, Any] | None = None
             ) -> Path:
        """Create (or reopen, when resuming) the run directory, write the config and the rows of ``history``."""
        loop = self.loop
        root = loop.default_root_dir or f"runs/run-{datetime.now():%Y%m%d-%H%M%S}"
        self.run_dir = Path(root)
        if (self.run_dir / "metrics.jsonl").exists() and not resuming and not loop.overwrite:
            raise ConfigError(
                f"trainer.default_root_dir={root!r} is invalid: it already holds a run; expected a new directory, "
                f"--ckpt_path {root}/checkpoints/last.ckpt to resume it, or --trainer.overwrite true")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if loop.config_text is not None:
            atomic_write_text(self.path("config.yaml"), loop.config_text)
        lines = [dumps_json(r) for r in history if r.get("evaluated")]
        atomic_write_text(self.path("metrics.jsonl"), "".join(line + "\n" for line in lines))
        if loop.logger:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.path("tensorboard")))
        return self.run_dir

    def log_row(self, row: Mapping[str, Any]) -> None:
        """Append an evaluated row to ``metrics.jsonl``; every numeric entry to TensorBoard (step = round)."""
        if row.get("evaluated"):
            with open(self.path("metrics.jsonl"), "a", encoding="utf-8") as f:
                f.write(dumps_json(row) + "\n")
        if self._writer is not None:
            for k, v in row.items():
                if k not in ("round", "evaluated") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    if not (isinstance(v, float) and math.isnan(v)):
                        self._writer.add_scalar(k, v, row["round"])
            self._writer.flush()

    def summary(self) -> dict[str, Any]:
        """The final row, per-client figures and cumulative costs."""
        loop, acc = self.loop, self.loop.accounting
        evaluated = [r for r in loop.history if r.get("evaluated")]
        return {
            "run_dir": str(self.run_dir),
            "num_rounds": loop.num_rounds,
            "num_clients": loop.num_clients,
            "final": dict(evaluated[-1]) if evaluated else {},
            "best_acc_mean": max((r["acc_mean"] for r in evaluated), default=None),
            "client_acc": list(loop.last_client_acc),
            "client_flops": [acc.client_flops.get(k, 0.0) for k in range(loop.num_clients)],
            "client_comm_bytes": [acc.comm.cum_node.get(k, 0) for k in range(loop.num_clients)],
            "comm_cum_bytes_total": acc.comm.cum["total"],
            "comm_cum_bytes_up": acc.comm.cum["up"],
            "comm_cum_bytes_down": acc.comm.cum["down"],
            "comm_cum_busiest_node_bytes": max(acc.comm.cum_node.values(), default=0),
            "flops_train_cum": acc.flops_cum,
            "flops_train_per_client_mean": float(np.mean(list(acc.client_flops.values()))) if acc.client_flops
            else 0.0,
            "time_cum_s": loop.time_cum,
        }

    def extra_rows(self) -> list[tuple[str, str]]:
        """``(label, key)`` lines contributed by the callbacks (``report_rows``)."""
        return [r for cb in self.loop.fed_callbacks for r in cb.report_rows(self.loop)]

    def finish(self) -> dict[str, Any]:
        """Write ``summary.json``, close TensorBoard, print the table; return the summary."""
        summary = self.summary()
        atomic_write_text(self.path("summary.json"), dumps_json(summary) + "\n")
        self.close()
        print(results_table(summary, self.extra_rows()))
        return summary

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def save_checkpoint(self, state: dict[str, Any], path: str | Path | None = None) -> Path:
        """Write a federation checkpoint atomically (default: ``checkpoints/last.ckpt``)."""
        target = Path(path) if path is not None else self.path("checkpoints") / "last.ckpt"
        save_checkpoint(target, state)
        return target

    def release(self) -> None:
        """Give the run directory up (end of the run, or an error): close TensorBoard."""
        self.close()

    def progress(self, it: Any, desc: str, leave: bool) -> Any:
        show = self.loop.enable_progress_bar if self.loop.enable_progress_bar is not None else sys.stderr.isatty()
        if not show:
            return it
        from tqdm.auto import tqdm

        return tqdm(it, desc=desc, leave=leave, dynamic_ncols=True)
