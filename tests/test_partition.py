"""Properties of the client partitions (pl_fedsparse.data.partition) and shifted test sets (data.shift)."""

from __future__ import annotations

import numpy as np
import pytest

from pl_fedsparse.data.partition import (
    client_test_from_global,
    dirichlet,
    iid,
    noniid_ratio,
    partition,
    pathological,
    shards,
)
from pl_fedsparse.data.shift import shifted_test_indices, shifted_test_split
from pl_fedsparse.errors import ConfigError


def balanced_labels(num_classes: int = 10, per_class: int = 100, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


LABELS = balanced_labels()


def assert_disjoint(parts: list[np.ndarray], n: int) -> np.ndarray:
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "clients overlap"
    assert allidx.min() >= 0 and allidx.max() < n
    for p in parts:
        assert p.dtype == np.int64 and (np.diff(p) > 0).all(), "each client's indices are sorted"
    return allidx


def num_classes_per_client(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> list[int]:
    return [len(np.unique(labels[p])) for p in parts]


def test_iid_equal_sizes_cover_everything() -> None:
    parts = iid(LABELS, 7, seed=0)
    assert sorted({len(p) for p in parts}) == [142, 143]
    assert len(assert_disjoint(parts, len(LABELS))) == len(LABELS)


@pytest.mark.parametrize("alpha", [0.1, 1.0, 100.0])
def test_dirichlet_equal_sizes_disjoint(alpha: float) -> None:
    parts = dirichlet(LABELS, 8, alpha=alpha, seed=1)
    assert [len(p) for p in parts] == [len(LABELS) // 8] * 8
    assert_disjoint(parts, len(LABELS))


def test_dirichlet_concentrates_for_small_alpha() -> None:
    small = np.mean(num_classes_per_client(dirichlet(LABELS, 10, alpha=0.1, seed=0)))
    large = np.mean(num_classes_per_client(dirichlet(LABELS, 10, alpha=10.0, seed=0)))
    assert small < 5 < large
    assert large >= 9


def test_dirichlet_proportions_track_prior() -> None:
    """The dealt label proportions follow the client's prior p_k ~ Dir(alpha), re-drawn here with the same rng."""
    labels = balanced_labels(num_classes=5, per_class=2000)
    parts = dirichlet(labels, 4, alpha=1.0, seed=3)
    rng = np.random.default_rng(3)
    for c in range(5):  # same draws as _class_indices
        rng.permutation(np.flatnonzero(labels == c))
    prior = rng.dirichlet(np.ones(5), size=4)
    for k, p in enumerate(parts):
        props = np.bincount(labels[p], minlength=5) / len(p)
        # classes are plentiful (2000 each, 2500 per client), so few get exhausted: proportions ~ p_k
        assert np.abs(props - prior[k]).max() < 0.12, (props, prior[k])


def test_dirichlet_quantity_skew_and_min_samples() -> None:
    parts = dirichlet(LABELS, 10, alpha=0.3, seed=0, quantity_skew=True, min_samples=20)
    assert len(assert_disjoint(parts, len(LABELS))) == len(LABELS)  # every sample used
    sizes = [len(p) for p in parts]
    assert min(sizes) >= 20 and len(set(sizes)) > 1


def test_dirichlet_min_samples_impossible() -> None:
    with pytest.raises(ConfigError, match=r"^data\.min_samples=60 is invalid"):
        dirichlet(LABELS, 20, alpha=0.5, seed=0, min_samples=60)
    with pytest.raises(ConfigError, match=r"data\.min_samples=.*fewer clients"):
        dirichlet(balanced_labels(2, 10), 4, alpha=0.01, seed=0, quantity_skew=True, min_samples=5)


@pytest.mark.parametrize("alpha", [0.0, -1.0, float("nan"), float("inf")])
def test_dirichlet_bad_alpha(alpha: float) -> None:
    with pytest.raises(ConfigError, match=r"^data\.alpha=.* is invalid: expected a number > 0$"):
        dirichlet(LABELS, 4, alpha=alpha, seed=0)


def test_pathological_exact_classes_balanced() -> None:
    parts = pathological(LABELS, 10, classes_per_client=3, seed=0)
    assert num_classes_per_client(parts) == [3] * 10
    assert len(assert_disjoint(parts, len(LABELS))) == len(LABELS)
    holders = np.bincount(np.concatenate([np.unique(LABELS[p]) for p in parts]), minlength=10)
    assert holders.tolist() == [3] * 10  # 10 clients * 3 classes over 10 classes: each held by 3
    with pytest.raises(ConfigError, match=r"^data\.classes_per_client=11 is invalid"):
        pathological(LABELS, 10, classes_per_client=11, seed=0)


def test_shards_at_most_s_classes() -> None:
    parts = shards(LABELS, 10, shards_per_client=2, seed=0)
    assert [len(p) for p in parts] == [100] * 10
    assert max(num_classes_per_client(parts)) <= 2
    assert len(assert_disjoint(parts, len(LABELS))) == len(LABELS)
    with pytest.raises(ConfigError, match=r"^data\.shards_per_client=200 is invalid"):
        shards(LABELS, 10, shards_per_client=200, seed=0)


def test_noniid_ratio_extremes() -> None:
    sorted_parts = noniid_ratio(LABELS, 10, ratio=1.0, seed=0)
    assert [np.unique(LABELS[p]).tolist() for p in sorted_parts] == [[c] for c in range(10)]
    iid_parts = noniid_ratio(LABELS, 10, ratio=0.0, seed=0)
    assert min(num_classes_per_client(iid_parts)) >= 8
    half = noniid_ratio(LABELS, 10, ratio=0.5, seed=0)
    assert len(assert_disjoint(half, len(LABELS))) == len(LABELS)
    with pytest.raises(ConfigError, match=r"^data\.noniid_ratio=1\.5 is invalid"):
        noniid_ratio(LABELS, 10, ratio=1.5, seed=0)


@pytest.mark.parametrize("scheme,kw", [("iid", {}), ("dirichlet", {"alpha": 0.5}),
                                       ("dirichlet", {"alpha": 0.5, "quantity_skew": True}),
                                       ("pathological", {"classes_per_client": 2}),
                                       ("shards", {"shards_per_client": 2}), ("noniid_ratio", {"ratio": 0.5})])
def test_deterministic_by_seed(scheme: str, kw: dict) -> None:
    fn = {"iid": iid, "dirichlet": dirichlet, "pathological": pathological, "shards": shards,
          "noniid_ratio": noniid_ratio}[scheme]
    a, b, c = fn(LABELS, 5, seed=7, **kw), fn(LABELS, 5, seed=7, **kw), fn(LABELS, 5, seed=8, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_num_clients_validation() -> None:
    with pytest.raises(ConfigError, match=r"^data\.num_clients=2000 is invalid: expected at most the number"):
        iid(LABELS, 2000, seed=0)
    with pytest.raises(ConfigError, match=r"^data\.num_clients=0 is invalid"):
        partition(LABELS, "iid", 0, seed=0)


def test_empty_client_is_an_error() -> None:
    # 3 classes with 1 sample each, 3 clients, 1 class each... but 2 clients share a class of 1 sample
    labels = np.array([0, 1, 1, 1])
    with pytest.raises(ConfigError, match=r"^data\.num_clients=4 is invalid: client \d .*0 samples.*fewer clients"):
        pathological(labels, 4, classes_per_client=1, seed=0)


def test_partition_dispatch_memo_and_validation() -> None:
    a = partition(LABELS, "dirichlet", 6, seed=2, alpha=0.4)
    b = partition(LABELS, "dirichlet", 6, seed=2, alpha=0.4)
    assert all(x is y for x, y in zip(a, b))  # memoised
    assert not a[0].flags.writeable
    direct = dirichlet(LABELS, 6, alpha=0.4, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, direct))
    c = partition(LABELS.copy(), "dirichlet", 6, seed=2, alpha=0.4)  # equal labels, other object: still a hit
    assert all(x is y for x, y in zip(a, c))
    d = partition(LABELS[::-1].copy(), "dirichlet", 6, seed=2, alpha=0.4)
    assert not all(np.array_equal(x, y) for x, y in zip(a, d))
    with pytest.raises(ConfigError, match=r"^data\.partition='nope' is invalid: expected one of iid, dirichlet"):
        partition(LABELS, "nope", 6, seed=0)
    with pytest.raises(ConfigError, match=r"^data\.alpha=0\.4 is invalid: expected no such option"):
        partition(LABELS, "iid", 6, seed=0, alpha=0.4)


def test_client_test_from_global() -> None:
    test_labels = balanced_labels(10, 50, seed=1)
    parts = dirichlet(LABELS, 5, alpha=0.3, seed=0)
    train_labels = [LABELS[p] for p in parts]
    tests = client_test_from_global(test_labels, train_labels, 10, per_client=None, seed=0)
    for y, t in zip(train_labels, tests):
        assert len(np.unique(t)) == len(t) and len(t) >= 100  # ceil(500 / 5) at least, no repeats
        held = np.unique(y)
        assert set(np.unique(test_labels[t])) == set(held)
        train_prop = np.bincount(y, minlength=10) / len(y)
        test_prop = np.bincount(test_labels[t], minlength=10) / len(t)
        assert np.abs(train_prop - test_prop).max() < 0.05
    again = client_test_from_global(test_labels, train_labels, 10, per_client=None, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(tests, again))
    small = client_test_from_global(test_labels, train_labels, 10, per_client=20, seed=0)
    assert all(20 <= len(t) <= 30 for t in small)
    with pytest.raises(ConfigError, match=r"^data\.test_per_client=0 is invalid"):
        client_test_from_global(test_labels, train_labels, 10, per_client=0, seed=0)


def test_shifted_test_indices() -> None:
    idx = np.arange(100, 200)
    assert np.array_equal(shifted_test_indices(idx, 1000, 0.0, seed=0), idx)
    kept, drawn = shifted_test_split(idx, 1000, 0.3, seed=0)
    assert len(kept) == 70 and len(drawn) == 30 and np.isin(kept, idx).all() and drawn.max() < 1000
    full = shifted_test_indices(idx, 1000, 1.0, seed=0)
    assert len(full) == 100 and (full < 1000).all()
    assert np.array_equal(full, shifted_test_indices(idx, 1000, 1.0, seed=0))
    assert not np.array_equal(full, shifted_test_indices(idx, 1000, 1.0, seed=1))
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"^shift=.* is invalid: expected a number in \[0, 1\]"):
            shifted_test_indices(idx, 1000, bad, seed=0)
