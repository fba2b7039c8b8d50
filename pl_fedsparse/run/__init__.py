"""A run on disk and what is read back from it.

* :mod:`~pl_fedsparse.run.directory` — the run directory: created or reopened, locked, its files and checkpoints;
* :mod:`~pl_fedsparse.run.names` — the names of the files the engine owns there;
* :mod:`~pl_fedsparse.run.config_diff` — a resumed run's configuration compared with the run's own, as text;
* :mod:`~pl_fedsparse.run.atomic` — atomic writes (every file of a run);
* :mod:`~pl_fedsparse.run.checkpoint` — a federation's checkpoint: saved, loaded safely, restored;
* :mod:`~pl_fedsparse.run.writer` — what a run writes each round: ``metrics.jsonl``, TensorBoard, ``summary.json``;
* :mod:`~pl_fedsparse.run.runs`, :mod:`~pl_fedsparse.run.stats`, :mod:`~pl_fedsparse.run.report`,
  :mod:`~pl_fedsparse.run.figures` — ``pl-fed report``: runs read back, grouped by seeds, compared with paired
  statistics, tabulated and drawn.
"""
