"""The names of a run directory's files: what the engine owns there, and nothing else."""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["LOCK_FILE", "RUN_FILE", "RUN_FORMAT", "SPECIAL_ENTRIES", "round_checkpoint_name", "round_checkpoints"]


RUN_FILE = "run.json"

LOCK_FILE = ".lock"

#: entries of a run directory the engine opens, writes or removes: none of them may be a symbolic link
SPECIAL_ENTRIES = (LOCK_FILE, RUN_FILE, "config.yaml", "summary.json", "metrics.jsonl", "results.md", "checkpoints",
                   "tensorboard", "checkpoints/last.ckpt")


#: the temporary files the engine's atomic writes make (``.<file>.<8 random characters>.tmp``), and only those are
#: removed as stale: a user's own ``.*.tmp`` file is left alone
_ENGINE_TMP = re.compile(r"^\.(run\.json|config\.yaml|summary\.json|metrics\.jsonl|results\.md|last\.ckpt|round-\d{6}\.ckpt)\."
                         r"[A-Za-z0-9_]{8}\.tmp$")


RUN_FORMAT = "pl_fedsparse.run/1"

_ROUND_FILE = re.compile(r"^round-(\d+)\.ckpt$")


def round_checkpoint_name(completed_rounds: int) -> str:
    """``round-<r>.ckpt`` (r = completed rounds, six digits): the name of a round's kept checkpoint."""
    return f"round-{completed_rounds:06d}.ckpt"


def round_checkpoints(directory: Path) -> dict[int, Path]:
    """The round checkpoints in ``directory``, by completed rounds."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {int(m.group(1)): directory / n for n in names if (m := _ROUND_FILE.match(n))}
