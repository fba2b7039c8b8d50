"""Distribution-shifted personal test sets (DM-PFL).

DM-PFL evaluates personalised models under test-time distribution shift: a fraction ``shift`` of a client's test
samples is replaced by samples from the *global* test distribution. ``shift=0`` is the client's own test set,
``shift=1`` a uniform sample of the global test pool of the same size.

:func:`shifted_test_split` returns the kept client indices and the drawn pool indices separately (they may index
different arrays, e.g. a client's held-out train samples and the global test split); :func:`shifted_test_indices`
concatenates them for the case where both index the same array. :func:`label_matched_rows` finds base test samples
standing in for samples the published CIFAR-10-C arrays do not contain (a client's own test samples taken from the
base train split).
"""

from __future__ import annotations

import numpy as np

from pl_fedsparse.errors import check

__all__ = ["label_matched_rows", "shifted_test_split", "shifted_test_indices"]


def shifted_test_split(client_test_idx: np.ndarray, pool_size: int, shift: float,
                       seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Choose which client test samples to keep and which global-pool samples replace the others.

    ``round(shift * n)`` of the ``n`` client indices (chosen at random) are dropped and as many pool indices are
    drawn uniformly from ``range(pool_size)`` (without replacement when the pool is large enough).

    Args:
        client_test_idx: the client's test indices.
        pool_size: size of the global test pool.
        shift: fraction in ``[0, 1]`` to replace.
        seed: random seed.

    Returns:
        ``(kept, drawn)``: sorted kept client indices and sorted pool indices; ``len(kept) + len(drawn) == n``.

    Example:
        >>> kept, drawn = shifted_test_split(np.arange(10), pool_size=100, shift=0.3, seed=0)
        >>> len(kept), len(drawn), bool(np.isin(kept, np.arange(10)).all())
        (7, 3, True)
    """
    check(isinstance(shift, (int, float)) and not isinstance(shift, bool) and 0.0 <= shift <= 1.0, "shift", shift,
          "a number in [0, 1]")
    idx = np.asarray(client_test_idx, dtype=np.int64)
    check(idx.ndim == 1, "client_test_idx", f"array{idx.shape}", "a 1-d index array")
    n = len(idx)
    m = int(round(shift * n))
    check(isinstance(pool_size, (int, np.integer)) and (pool_size >= 1 or m == 0), "pool_size", pool_size,
          "an int >= 1 (a non-empty global test pool)")
    rng = np.random.default_rng(seed)
    drop = rng.choice(n, size=m, replace=False)
    keep_mask = np.ones(n, dtype=bool)
    keep_mask[drop] = False
    drawn = rng.choice(int(pool_size), size=m, replace=m > pool_size) if m else np.empty(0, np.int64)
    return np.sort(idx[keep_mask]), np.sort(drawn.astype(np.int64))


def shifted_test_indices(client_test_idx: np.ndarray, pool_size: int, shift: float, seed: int) -> np.ndarray:
    """Replace a fraction ``shift`` of a client's test indices by uniform draws from the global test pool.

    For client and pool indices into the same array (``test_mode="global"``); the result has the same length as
    ``client_test_idx`` and may contain an index twice (a kept sample that is drawn again from the pool), as in
    DM-PFL where the global part is sampled independently.

    Example:
        >>> shifted_test_indices(np.arange(4), pool_size=10, shift=0.0, seed=0).tolist()
        [0, 1, 2, 3]
        >>> len(shifted_test_indices(np.arange(4), pool_size=10, shift=1.0, seed=0))
        4
    """
    kept, drawn = shifted_test_split(client_test_idx, pool_size, shift, seed)
    return np.sort(np.concatenate([kept, drawn]))


def label_matched_rows(labels: np.ndarray, pool_labels: np.ndarray, seed: int) -> np.ndarray:
    """For every sample of label ``labels[i]``, a row of the pool with the same label.

    The published CIFAR-10-C arrays corrupt the 10,000 CIFAR-10 test images only; a client's own test samples in
    ``test_mode="split"`` (DM-PFL: each client's data split 0.75 / 0.25) are base *train* images, so a corruption view
    read from the arrays stands each of them in by a test image of the same label: per class, rows drawn uniformly
    without replacement (with replacement only where a class has fewer pool rows than samples). The client's test set
    keeps its size and label distribution; the stand-ins depend on ``seed`` only, so every corruption and severity of
    one evaluation sees the same images.

    Args:
        labels: ``int [n]`` labels of the samples to stand in for.
        pool_labels: ``int [M]`` labels of the pool (the base test split).
        seed: random seed.

    Returns:
        ``int64 [n]`` pool rows, ``pool_labels[out] == labels``.

    Example:
        >>> rows = label_matched_rows(np.array([1, 0, 1]), np.array([0, 1, 0, 1, 1]), seed=0)
        >>> np.array([0, 1, 0, 1, 1])[rows].tolist(), len(set(rows.tolist()))
        ([1, 0, 1], 3)
    """
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    pool_labels = np.asarray(pool_labels, dtype=np.int64).reshape(-1)
    out = np.empty(len(labels), dtype=np.int64)
    rng = np.random.default_rng(seed)
    for c in np.unique(labels):
        where = np.flatnonzero(labels == c)
        pool = np.flatnonzero(pool_labels == c)
        check(len(pool) > 0, "label", int(c), "a label that the base test split holds (no test sample has it)")
        out[where] = rng.choice(pool, size=len(where), replace=len(where) > len(pool))
    return out
