"""What the user-data sources share: the image size option, a held-out test split by class (and client), and a
sorted walk of a folder.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from pl_fedsparse.errors import check

__all__ = ["held_out_split", "image_size_pair"]


def image_size_pair(image_size: Any) -> tuple[int, int] | None:
    """Validate ``data.image_size`` (``None``, an int or ``[height, width]``) and return ``(height, width)``.

    Example:
        >>> image_size_pair(32), image_size_pair([24, 32]), image_size_pair(None)
        ((32, 32), (24, 32), None)
    """
    if image_size is None:
        return None
    pair = (image_size, image_size) if not isinstance(image_size, (list, tuple)) else tuple(image_size)
    check(len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair),
          "data.image_size", image_size, "None, an int >= 1 or [height, width]")
    return int(pair[0]), int(pair[1])


def held_out_split(groups: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``round(test_fraction * n)`` random samples of every group (class or client) as a test split.

    A group of ``n >= 2`` samples keeps at least one sample on each side; a single sample stays in training.

    Returns:
        Sorted train and test indices.

    Example:
        >>> train, test = held_out_split(np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1]), 0.25, seed=0)
        >>> len(train), len(test), sorted(np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])[test].tolist())
        (7, 3, [0, 1, 1])
    """
    groups = np.asarray(groups)
    rng = np.random.default_rng([seed, 7])
    test: list[np.ndarray] = []
    for g in np.unique(groups):
        members = rng.permutation(np.flatnonzero(groups == g))
        n = len(members)
        n_test = min(max(round(test_fraction * n), 1), n - 1) if n >= 2 else 0
        test.append(members[:n_test])
    test_idx = np.sort(np.concatenate(test)) if test else np.empty(0, np.int64)
    mask = np.ones(len(groups), dtype=bool)
    mask[test_idx] = False
    return np.flatnonzero(mask), test_idx


def _size_extra(classes: list[str], size: tuple[int, int] | None) -> str:
    return "|".join(classes) + ("" if size is None else f"|size={size[0]}x{size[1]}")


# ----------------------------------------------------------------------------------------------- torchvision
def _walk(folder: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return out
