"""Reporting: ``metrics.jsonl``, TensorBoard, ``summary.json`` and the printed results table.

Nothing here knows a method. Every round is one row of ``metrics.jsonl`` (and one TensorBoard step): its costs
(bytes, FLOPs, times), its faults and, on evaluated rounds (``"evaluated": true``), its accuracies — a round that is
not evaluated has no accuracy columns. The results table shows the headline accuracies and costs every run has;
callbacks add lines for the metrics they produce through the ``report_rows`` hook (e.g. ``("adaptive acc",
"adaptive_acc")``). Where the run lives on disk (the directory, its lock, ``run.json``, resume checks, checkpoints)
is :mod:`pl_fedsparse.run.directory`.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml

from pl_fedsparse.errors import user_code, with_path
from pl_fedsparse.run.atomic import atomic_write_text, dumps_json
from pl_fedsparse.run.config_diff import RESUME_MAY_CHANGE, _flatten, config_changes
from pl_fedsparse.run.directory import RunDirectory
from pl_fedsparse.run.names import round_checkpoints

if TYPE_CHECKING:
    from pl_fedsparse.view import FederationView

__all__ = [
    "RESUME_MAY_CHANGE",
    "RunReporter",
    "config_changes",
    "results_table",
    "round_checkpoints",
    "run_hparams",
    "tensorboard_tag",
]

log = logging.getLogger(__name__)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def results_table(summary: Mapping[str, Any], rows: Sequence[tuple[str, str]] = (),
                  title: str = "final results") -> str:
    """A small text table of the headline numbers; ``rows`` are extra ``(label, metric key)`` lines shown when the
    metric is present. The rounds trained are counted as the progress lines count them (``rounds_trained``, or the
    row's ``round`` + 1: metrics.jsonl numbers rounds from 0).

    Example:
        >>> print(results_table({"round": 3, "acc_mean": 0.5, "x": 0.25}, [("my metric", "x")], title="t"))
        ... # doctest: +NORMALIZE_WHITESPACE
        == t =====...
        rounds trained                            4
        personal acc (mean over clients)     50.00%
        personal acc (sample-weighted)            -
        personal acc (std)                        -
        personal acc (bottom decile)              -
        global model acc                          -
        my metric                            25.00%
    """
    row = summary.get("final", summary)
    # counted as the progress lines count them (the last row's round is numbered from 0, as in metrics.jsonl)
    trained = row.get("rounds_trained", row["round"] + 1 if isinstance(row.get("round"), int) else "-")
    items = [
        ("rounds trained", str(trained)),
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


_TRAIN_KEYS = ("train_loss", "num_participants", "client_faults")
_ACCURACY_PREFIXES = ("acc_", "loss_", "global_", "f1_", "ece_")


def tensorboard_tag(key: str) -> str:
    """TensorBoard tag of a metric: grouped in sections that read like the metrics table — ``accuracy/``,
    ``comm/``, ``flops/``, ``time/``, ``train/``, one section per evaluation view (``shift20/acc_mean`` stays as it
    is), and ``method/`` for what a callback adds.

    Example:
        >>> [tensorboard_tag(k) for k in ("acc_mean", "comm_bytes_up", "shift20/acc_mean", "global_mask_density")]
        ['accuracy/acc_mean', 'comm/comm_bytes_up', 'shift20/acc_mean', 'method/global_mask_density']
    """
    if "/" in key:
        return key
    for prefix, section in (("comm_", "comm"), ("flops_", "flops"), ("time_", "time")):
        if key.startswith(prefix):
            return f"{section}/{key}"
    if key in _TRAIN_KEYS or key.startswith("client_faults"):
        return f"train/{key}"
    if key.startswith(_ACCURACY_PREFIXES) or key.endswith(("_acc", "_acc_weighted", "_f1_macro", "_ece")):
        if not key.endswith(("_density", "_bytes")):
            return f"accuracy/{key}"
    return f"method/{key}"


def _callback_name(entry: Any) -> str:
    path = entry.get("class_path", "") if isinstance(entry, dict) else type(entry).__name__
    return str(path).rsplit(".", 1)[-1]


def run_hparams(loop: FederationView) -> dict[str, Any]:
    """The run's hyper-parameters for TensorBoard's HPARAMS view: ``method`` (the callbacks, ``FedAvg`` when none),
    every scalar of the resolved config (``model.lr``, ``data.num_clients``, a callback's ``<Class>.<arg>``, …) or,
    without a config (the Python API), the loop's own settings."""
    hp: dict[str, Any] = {}
    cfg = yaml.safe_load(loop.config_text) if loop.config_text else None
    if isinstance(cfg, dict):
        callbacks = (cfg.get("trainer") or {}).get("callbacks") or []
        hp["method"] = " + ".join(_callback_name(c) for c in callbacks) or "FedAvg"
        for cb in callbacks:
            for k, v in (cb.get("init_args") or {}).items() if isinstance(cb, dict) else ():
                if isinstance(v, (int, float, str, bool)):
                    hp[f"{_callback_name(cb)}.{k}"] = v
        for key, v in _flatten({k: v for k, v in cfg.items() if k not in ("trainer",)}).items():
            if isinstance(v, (int, float, str, bool)) and not key.startswith("ckpt"):
                hp[key.replace(".init_args.", ".")] = v  # model.width of a user module, as model.lr
        for k, v in (cfg.get("trainer") or {}).items():
            if isinstance(v, (int, float, str, bool)) and k not in ("default_root_dir", "enable_progress_bar"):
                hp[f"trainer.{k}"] = v
            elif k == "topology" and isinstance(v, dict):
                hp["trainer.topology"] = _callback_name(v)
    else:
        hp["method"] = " + ".join(type(c).__name__ for c in loop.fed_callbacks) or "FedAvg"
        hp.update({"trainer.num_rounds": loop.num_rounds, "trainer.join_ratio": loop.join_ratio,
                   "trainer.local_epochs": loop.local_epochs, "data.num_clients": loop.num_clients})
    return hp


def _fault_counts(history: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """``{client: {fault kind: count}}`` over a run's rows (JSON keys are strings)."""
    out: dict[str, dict[str, int]] = {}
    for row in history:
        for f in row.get("client_fault_kinds", []):
            kinds = out.setdefault(str(f["client"]), {})
            kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    return out


def _quiet_writer_thread() -> None:
    """Let a failed TensorBoard write end in the run's one line only.

    TensorBoard writes its events on a thread of its own; when a write fails there (a full disk), the thread keeps
    the exception, which the writer's next ``add_*``/``flush``/``close`` raises again in the run's thread (where
    :meth:`RunReporter.log_row` and :meth:`RunReporter.finish` turn it into one line, exit status 74) — and the
    thread also ends by printing its own traceback. This hook drops that second account (only for an ``OSError``
    the writer thread keeps for re-raising); any other thread's exception goes to the hook installed before.
    """
    previous = threading.excepthook
    if getattr(previous, "pl_fedsparse_writer_hook", False):
        return

    def hook(args: Any) -> None:
        kept = getattr(args.thread, "exception", None)
        if type(args.thread).__name__ == "_AsyncWriterThread" and kept is args.exc_value \
                and isinstance(kept, OSError):
            return
        previous(args)

    hook.pl_fedsparse_writer_hook = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class RunReporter:
    """Reports a run into its :class:`~pl_fedsparse.run.directory.RunDirectory`: a row per round in ``metrics.jsonl`` and
    TensorBoard, ``summary.json`` at the end, the printed results table; opens and releases the directory.

    A write that fails because the storage stopped taking writes is one :class:`~pl_fedsparse.errors.StorageError`
    line naming the file (the rows of the rounds since the last checkpoint are rewritten from it on resume).
    """

    def __init__(self, loop: FederationView) -> None:
        self.loop = loop
        self.directory = RunDirectory(loop)
        self._writer: Any = None
        self._round_times: list[float] = []
        self._last_line = -math.inf

    def progress_as_lines(self) -> bool:
        """Whether progress is printed as lines (on stdout): the output is not a terminal (a log file, ``nohup``,
        SLURM) and ``trainer.enable_progress_bar`` is left to decide (``null``)."""
        return self.loop.enable_progress_bar is None and not sys.stderr.isatty()

    def round_line(self, row: Mapping[str, Any], seconds: float) -> None:
        """One line per round when progress goes to a log (:meth:`progress_as_lines`): the round, its seconds, the
        accuracy when it was evaluated, the time so far and the estimate to the end; rounds shorter than a second
        are printed at most every 5 s (the evaluated and the last ones always)."""
        if not self.progress_as_lines():
            return
        self._round_times.append(seconds)
        loop, r = self.loop, int(row["round"])
        last = r + 1 == loop.num_rounds
        now = time.monotonic()
        acc = row.get("acc_mean")
        if not (last or acc is not None or now - self._last_line >= 5.0):
            return
        self._last_line = now
        mean = sum(self._round_times) / len(self._round_times)
        left = (loop.num_rounds - r - 1) * mean
        parts = [f"round {r + 1}/{loop.num_rounds}: {seconds:.2f} s"]
        if acc is not None:
            parts.append(f"acc_mean {acc:.4f}")
        parts.append(f"elapsed {sum(self._round_times):.1f} s")
        parts.append("done" if last else f"ETA {_duration(left)}")
        print(", ".join(parts), flush=True)

    @property
    def run_dir(self) -> Path | None:
        return self.directory.run_dir

    @property
    def run_id(self) -> str | None:
        return self.directory.run_id

    @property
    def resumes(self) -> list[dict[str, Any]]:
        return self.directory.resumes

    def path(self, name: str) -> Path:
        return self.directory.path(name)

    # ------------------------------------------------------------------------------------------------ open
    def open(self, resuming: bool, history: Sequence[Mapping[str, Any]], checkpoint: Mapping[str, Any] | None = None,
             ckpt_path: str | None = None) -> Path:
        """Open the run directory (:meth:`RunDirectory.open <pl_fedsparse.run.directory.RunDirectory.open>`), then write
        the rows of ``history`` and open TensorBoard — all before the first round, nothing when refused."""
        self.close()

        def start(completed: int) -> None:
            loop = self.loop
            lines = [dumps_json(r) for r in history]
            self._write("metrics.jsonl", "".join(line + "\n" for line in lines), atomic=True)
            if loop.logger:
                from torch.utils.tensorboard import SummaryWriter

                # a resumed run drops the events of the rounds it runs again
                purge = {"purge_step": completed} if checkpoint is not None else {}
                _quiet_writer_thread()
                try:
                    self._writer = SummaryWriter(log_dir=str(self.path("tensorboard")), **purge)
                    if loop.config_text is not None:
                        self._writer.add_text("config", "```yaml\n" + loop.config_text + "\n```", completed)
                except OSError as e:
                    raise self.directory.unwritable(with_path(e, self.path("tensorboard")),
                                                    "writing the TensorBoard events") from None

        return self.directory.open(resuming, checkpoint, ckpt_path, start=start)

    def _write(self, name: str, text: str, atomic: bool = False) -> None:
        try:
            if atomic:
                atomic_write_text(self.path(name), text)
            else:
                with open(self.path(name), "a", encoding="utf-8") as f:
                    f.write(text)
        except OSError as e:
            raise self.directory.unwritable(with_path(e, self.path(name)), f"writing {name}") from None

    def log_row(self, row: Mapping[str, Any]) -> None:
        """Append the round's row to ``metrics.jsonl``; every numeric entry to TensorBoard (step = round)."""
        self._write("metrics.jsonl", dumps_json(row) + "\n")
        if self._writer is not None:
            try:
                for k, v in row.items():
                    if k not in ("round", "evaluated") and isinstance(v, (int, float)) and not isinstance(v, bool):
                        if not (isinstance(v, float) and math.isnan(v)):
                            self._writer.add_scalar(tensorboard_tag(k), v, row["round"])
                if row.get("evaluated") and self.loop.last_client_acc:  # the per-client accuracy distribution
                    self._writer.add_histogram("clients/acc", np.asarray(self.loop.last_client_acc, dtype=np.float64),
                                               row["round"])
                self._writer.flush()
            except OSError as e:
                self._writer = None  # its event file is unusable; close() must not write to it again
                raise self.directory.unwritable(e, "writing the TensorBoard events") from None

    def summary(self) -> dict[str, Any]:
        """The final row, per-client figures and cumulative costs."""
        loop, acc = self.loop, self.loop.accounting
        evaluated = [r for r in loop.history if r.get("evaluated")]
        return {
            "run_dir": str(self.run_dir),
            "run_id": self.run_id,
            "resumes": list(self.resumes),
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
            "client_faults_total": sum(int(r.get("client_faults", 0)) for r in loop.history),
            "client_faults": _fault_counts(loop.history),
            **_client_ids(loop.datamodule),
        }

    def extra_rows(self) -> list[tuple[str, str]]:
        """``(label, key)`` lines contributed by the callbacks (``report_rows``)."""
        rows = []
        for cb in self.loop.fed_callbacks:
            with user_code(cb, "report_rows", "printing the results table"):
                rows.extend(cb.report_rows(self.loop))
        return rows

    def finish(self) -> dict[str, Any]:
        """Write ``summary.json``, close TensorBoard, print the table; return the summary."""
        summary = self.summary()
        self._write("summary.json", dumps_json(summary) + "\n", atomic=True)
        try:
            self._write_hparams(summary)
            self.close()
        except OSError as e:
            self._writer = None
            raise self.directory.unwritable(e, "writing the TensorBoard events") from None
        print(results_table(summary, self.extra_rows()))
        return summary

    def _write_hparams(self, summary: Mapping[str, Any]) -> None:
        """The run's hyper-parameters with its final metrics (``hparams/…``) for TensorBoard's HPARAMS view."""
        if self._writer is None:
            return
        final = summary.get("final") or {}
        metrics = {f"hparams/{k}": float(v) for k, v in final.items()
                   if k not in ("round", "evaluated") and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and not (isinstance(v, float) and math.isnan(v))
                   and k.startswith(("acc_", "global_acc", "loss_mean", "f1_macro", "ece", "comm_cum_bytes_total"))}
        metrics["hparams/comm_cum_bytes_total"] = float(summary.get("comm_cum_bytes_total", 0))
        metrics["hparams/flops_train_cum"] = float(summary.get("flops_train_cum", 0.0))
        self._writer.add_hparams(run_hparams(self.loop), metrics, run_name=".",
                                 global_step=int(final.get("round", self.loop.num_rounds - 1)))

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def save_checkpoint(self, state: dict[str, Any], path: str | Path | None = None) -> Path:
        """Write a federation checkpoint (:meth:`RunDirectory.save_checkpoint
        <pl_fedsparse.run.directory.RunDirectory.save_checkpoint>`)."""
        return self.directory.save_checkpoint(state, path)

    def release(self) -> None:
        """Give the run directory up (end of the run, or an error; idempotent): close TensorBoard (a failure to
        flush its last events is logged, not raised: the run is ending anyway), then unlock the directory."""
        try:
            self.close()
        except Exception as e:  # noqa: BLE001 - e.g. a full disk while flushing; the lock must still go
            log.warning("closing the TensorBoard writer failed: %s", e)
        finally:
            self.directory.release()

    def progress(self, it: Any, desc: str, leave: bool) -> Any:
        if self.progress_as_lines() and desc != "rounds":  # (rounds: round_line)
            return _lines(it, desc)
        show = self.loop.enable_progress_bar if self.loop.enable_progress_bar is not None else sys.stderr.isatty()
        if not show:
            return it
        from tqdm.auto import tqdm

        return tqdm(it, desc=desc, leave=leave, dynamic_ncols=True)


def _duration(seconds: float) -> str:
    """``42 s``, ``3.5 min``, ``2.1 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _lines(it: Any, desc: str, every: float = 30.0) -> Any:
    """``it``, with a line on stdout every ``every`` seconds while it runs (a long evaluation in a log file)."""
    items = list(it)
    start = last = time.monotonic()
    for i, x in enumerate(items):
        now = time.monotonic()
        if now - last >= every:
            last = now
            print(f"{desc}: {i}/{len(items)} ({now - start:.0f} s)", flush=True)
        yield x


def _client_ids(datamodule: Any) -> dict[str, Any]:
    """``{"client_ids": [...]}``: the data's own id of each client index, when the partition is the data's own
    (``partition: natural``; the clients are its ids in sorted order), else nothing."""
    ids = getattr(datamodule, "client_ids", None)
    if not ids:
        return {}
    return {"client_ids": [i.item() if hasattr(i, "item") else i for i in ids]}
