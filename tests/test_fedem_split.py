"""FedEM's label-Dirichlet split as pFedGate uses it (train+test pooled, one cluster per class, 6:2:2 per client),
the datamodule's ``test_mode="pooled"``, and pFedGate's Fig. 4 pathological split (``shards``, 10 clients)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_CLI, fit_rows, one_line, run_main

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.data.partition import fedem_client_split, fedem_dirichlet, partition, shards
from pl_fedsparse.errors import ConfigError

LABELS = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 300))  # 3,000 labels, 10 balanced classes
TINY = {"num_train": 400, "num_test": 100, "size": 8, "channels": 1, "num_classes": 4}


def reference_fedem(labels: list[int], num_clients: int, alpha: float, seed: int, frac: float) -> list[list[int]]:
    """FedEM's ``split_dataset_by_labels`` with ``n_clusters = n_classes``, written out step by step from its
    description (method notes §8): shuffle the classes, draw the subset, group by class in draw order, shuffle each
    group, then per group Dir(alpha) weights and multinomial counts from numpy's seeded legacy generator."""
    rng, np_rng = random.Random(seed), np.random.RandomState(seed)
    classes = list(range(max(labels) + 1))
    rng.shuffle(classes)
    group_of = {c: g for g, c in enumerate(classes)}
    chosen = rng.sample(list(range(len(labels))), int(len(labels) * frac))
    groups: list[list[int]] = [[] for _ in classes]
    for i in chosen:
        groups[group_of[labels[i]]].append(i)
    for g in groups:
        rng.shuffle(g)
    clients: list[list[int]] = [[] for _ in range(num_clients)]
    for g in groups:
        counts = np_rng.multinomial(len(g), np_rng.dirichlet(alpha * np.ones(num_clients)))
        start = 0
        for k, c in enumerate(counts):
            clients[k] += g[start:start + c]
            start += c
    return clients


def mean_label_distance(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean total-variation distance between each client's label distribution and the global one."""
    glob = np.bincount(labels, minlength=10) / len(labels)
    return float(np.mean([0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - glob).sum() for p in parts]))


# ------------------------------------------------------------------------------------------- the partition
def test_every_sample_is_dealt_exactly_once() -> None:
    parts = fedem_dirichlet(LABELS, 20, alpha=0.4, seed=12345)
    allidx = np.concatenate(parts)
    assert sorted(allidx.tolist()) == list(range(len(LABELS)))
    assert all((np.diff(p) > 0).all() and p.dtype == np.int64 for p in parts)
    assert len({len(p) for p in parts}) > 5  # client sizes vary (no equal quota as in DisPFL's split)
    sub = np.concatenate(fedem_dirichlet(LABELS, 20, alpha=0.4, seed=12345, sample_fraction=0.25))
    assert len(sub) == len(np.unique(sub)) == 750  # FedEM's int(N * s_frac), each drawn sample once


@pytest.mark.parametrize("seed,frac,alpha", [(12345, 1.0, 0.4), (0, 0.3, 0.4), (7, 1.0, 5.0)])
def test_replays_fedems_random_streams(seed: int, frac: float, alpha: float) -> None:
    labels = np.random.default_rng(seed).integers(0, 7, 700)
    ordered = fedem_dirichlet(labels, 6, alpha=alpha, seed=seed, sample_fraction=frac, ordered=True)
    ref = reference_fedem(labels.tolist(), 6, alpha, seed, frac)
    assert [p.tolist() for p in ordered] == ref
    assert [p.tolist() for p in fedem_dirichlet(labels, 6, alpha=alpha, seed=seed, sample_fraction=frac)] == \
        [sorted(r) for r in ref]


def test_hand_checkable_tiny_cases() -> None:
    y = np.array([0, 0, 1, 1, 1, 2])
    assert [p.tolist() for p in fedem_dirichlet(y, 1, alpha=0.4, seed=3)] == [[0, 1, 2, 3, 4, 5]]  # one client
    # FedEM's order: class by class, in one shuffled class order shared by every client
    labels = np.repeat(np.arange(5), 40)
    runs = []
    for p in fedem_dirichlet(labels, 4, alpha=1.0, seed=5, ordered=True):
        y = labels[p]
        run = [int(c) for i, c in enumerate(y) if i == 0 or c != y[i - 1]]
        assert len(run) == len(set(run))  # each class held is one contiguous run
        runs.append(run)
    for a in range(5):
        for b in range(a + 1, 5):
            assert len({r.index(a) < r.index(b) for r in runs if a in r and b in r}) <= 1, runs


def test_label_counts_do_not_depend_on_the_order_of_the_samples() -> None:
    """Only the class sizes and the seed matter: any copy of a dataset gets the authors' per-client label counts."""
    other = np.random.default_rng(1).permutation(LABELS)

    def counts(y: np.ndarray) -> np.ndarray:
        return np.stack([np.bincount(y[p], minlength=10) for p in fedem_dirichlet(y, 15, alpha=0.4, seed=12345)])

    assert np.array_equal(counts(LABELS), counts(other))


def test_label_skew_grows_as_alpha_shrinks() -> None:
    for seed in (0, 1):
        tv = [mean_label_distance(fedem_dirichlet(LABELS, 10, alpha=a, seed=seed), LABELS) for a in (0.1, 1.0, 100.0)]
        assert tv[0] > tv[1] > tv[2] and tv[0] > 0.5 and tv[2] < 0.15, tv


def test_seeded_and_memoised() -> None:
    a = fedem_dirichlet(LABELS, 8, alpha=0.4, seed=1)
    b = fedem_dirichlet(LABELS, 8, alpha=0.4, seed=1)
    c = fedem_dirichlet(LABELS, 8, alpha=0.4, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    d = partition(LABELS, "fedem_dirichlet", 8, seed=1, alpha=0.4)
    assert all(np.array_equal(x, y) for x, y in zip(a, d))
    assert all(x is y for x, y in zip(d, partition(LABELS, "fedem_dirichlet", 8, seed=1, alpha=0.4)))


@pytest.mark.parametrize("kw,match", [
    ({"alpha": 0.0}, r"^data\.alpha=0\.0 is invalid: expected a number > 0$"),
    ({"alpha": 0.4, "sample_fraction": 0.0}, r"^data\.sample_fraction=0\.0 is invalid: expected a number in \(0, 1\]$"),
    ({"alpha": 0.4, "sample_fraction": 1.5}, r"^data\.sample_fraction=1\.5 is invalid: expected a number in \(0, 1\]$"),
    ({"alpha": 0.4, "sample_fraction": 0.001}, r"^data\.sample_fraction=0\.001 is invalid: expected at least "),
    ({"alpha": 0.4, "seed": 2**32}, r"^data\.seed=4294967296 is invalid: expected an int in \[0, 2\*\*32 - 1\]"),
    ({"alpha": 1e-3}, r"^data\.num_clients=10 is invalid: client \d+ .*0 samples.*larger data\.alpha"),
])
def test_bad_values_are_one_line_errors(kw: dict, match: str) -> None:
    kw = {"seed": 0, **kw}
    with pytest.raises(ConfigError, match=match) as err:
        fedem_dirichlet(LABELS[:200], 10, **kw)
    assert "\n" not in str(err.value)


def test_partition_dispatch_refuses_foreign_options() -> None:
    with pytest.raises(ConfigError, match=r"^data\.sample_fraction=0\.5 is invalid: expected no such option for "
                                          r"partition 'iid'"):
        partition(LABELS, "iid", 4, seed=0, sample_fraction=0.5)
    with pytest.raises(ConfigError, match=r"^data\.partition='fedem' is invalid: expected one of .*fedem_dirichlet"):
        partition(LABELS, "fedem", 4, seed=0)


# ------------------------------------------------------------------------------------------- the per-client split
@pytest.mark.parametrize("n,sizes", [(10, (6, 2, 2)), (7, (3, 2, 2)), (4, (2, 1, 1)), (3, (1, 1, 1)),
                                     (100, (60, 20, 20)), (101, (60, 20, 21))])
def test_client_split_sizes_by_hand(n: int, sizes: tuple[int, int, int]) -> None:
    """test = n - floor(0.8 n); train = floor(0.75 (n - test)); val = the rest (sklearn's train_size rounding)."""
    idx = np.arange(1000, 1000 + n)
    train, val, test = fedem_client_split(idx, (0.6, 0.2, 0.2), seed=12345)
    assert (len(train), len(val), len(test)) == sizes
    assert sorted(np.concatenate([train, val, test]).tolist()) == idx.tolist()


def test_client_split_no_validation_and_too_small() -> None:
    train, val, test = fedem_client_split(np.arange(10), (0.75, 0.0, 0.25), seed=0)
    assert (len(train), len(val), len(test)) == (7, 0, 3)  # floor(7.5) kept for training
    with pytest.raises(ConfigError, match=r"^data\.split_ratios=\[0\.6, 0\.2, 0\.2\] is invalid: a client has only 2 "
                                          r"samples"):
        fedem_client_split(np.arange(2), (0.6, 0.2, 0.2), seed=0)
    with pytest.raises(ConfigError, match=r"^data\.split_ratios=\[0\.5, 0\.2, 0\.2\] is invalid: expected three"):
        fedem_client_split(np.arange(20), (0.5, 0.2, 0.2), seed=0)


def test_client_split_is_622_within_rounding_and_seeded() -> None:
    for n in range(3, 300, 7):
        train, val, test = fedem_client_split(np.arange(n), (0.6, 0.2, 0.2), seed=12345)
        assert 0 <= len(test) - 0.2 * n < 1 and -0.25 < len(val) - 0.2 * n < 1 and -1.75 < len(train) - 0.6 * n <= 0
    a = fedem_client_split(np.arange(50), (0.6, 0.2, 0.2), seed=1)
    b = fedem_client_split(np.arange(50), (0.6, 0.2, 0.2), seed=1)
    c = fedem_client_split(np.arange(50), (0.6, 0.2, 0.2), seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b)) and not np.array_equal(a[2], c[2])
    # the split follows the order of the client's list (FedEM's order matters, not just the set)
    d = fedem_client_split(np.arange(50)[::-1].copy(), (0.6, 0.2, 0.2), seed=1)
    assert not np.array_equal(a[2], d[2])


# ------------------------------------------------------------------------------------------- the datamodule
def pooled_dm(**kw: object) -> FederatedDataModule:
    args: dict = {"name": "synthetic", "num_clients": 4, "partition": "fedem_dirichlet", "alpha": 0.4,
                  "test_mode": "pooled", "split_ratios": (0.6, 0.2, 0.2), "synthetic": TINY, "seed": 12345,
                  "batch_size": 16}
    args.update(kw)
    return FederatedDataModule(**args)


def test_pooled_mode_covers_train_and_test_once() -> None:
    dm = pooled_dm()
    dm.setup()
    pooled_y = np.concatenate([dm.base.train_y.numpy(), dm.base.test_y.numpy()])
    every = np.concatenate([dm.client_indices(k, s) for k in range(4) for s in ("train", "val", "test")])
    assert sorted(every.tolist()) == list(range(500))  # 400 train + 100 test images, each in one client split
    tests = np.concatenate([dm.client_indices(k, "test") for k in range(4)])
    assert (tests >= 400).any() and (tests < 400).any()  # personal test sets mix base train and base test images
    for k in range(4):
        n = sum(dm.num_samples(k, s) for s in ("train", "val", "test"))
        n_test = n - math.floor(0.8 * n)
        assert (dm.num_samples(k, "test"), dm.num_samples(k, "train")) == (n_test, math.floor(0.75 * (n - n_test)))
        for split in ("train", "val", "test"):
            assert np.array_equal(dm.client_label_counts(k, split),
                                  np.bincount(pooled_y[dm.client_indices(k, split)], minlength=4))
        got = np.concatenate([b[1].numpy() for b in dm.eval_loader(k, "test")])
        assert np.array_equal(got, pooled_y[dm.client_indices(k, "test")])
    fp = dm.fingerprint()
    assert fp["test_mode"] == "pooled" and fp["partition"] == "fedem_dirichlet" and fp["sample_fraction"] == 1.0
    assert fp != pooled_dm(sample_fraction=0.5).fingerprint()


def test_pooled_mode_is_fedem_generate_data() -> None:
    """The datamodule = fedem_dirichlet over the pool, in FedEM's order, then fedem_client_split with the same seed;
    splitting the sorted client sets instead would give other test sets."""
    dm = pooled_dm(num_clients=5, sample_fraction=0.6)
    dm.setup()
    pooled_y = np.concatenate([dm.base.train_y.numpy(), dm.base.test_y.numpy()])
    ordered = fedem_dirichlet(pooled_y, 5, alpha=0.4, seed=12345, sample_fraction=0.6, ordered=True)
    assert sum(len(p) for p in ordered) == 300
    differs = False
    for k, idx in enumerate(ordered):
        expected = fedem_client_split(idx, (0.6, 0.2, 0.2), seed=12345)
        for split, arr in zip(("train", "val", "test"), expected):
            assert np.array_equal(dm.client_indices(k, split), arr), (k, split)
        differs |= not np.array_equal(fedem_client_split(np.sort(idx), (0.6, 0.2, 0.2), seed=12345)[2], expected[2])
    assert differs


def test_pooled_mode_with_other_schemes_and_subsample() -> None:
    dm = pooled_dm(partition="iid", max_train_samples=250)
    dm.setup()
    every = np.concatenate([dm.client_indices(k, s) for k in range(4) for s in ("train", "val", "test")])
    assert len(every) == len(np.unique(every)) == 250 and every.max() < 500
    assert sorted(dm.num_samples(k, "test") for k in range(4)) == [13, 13, 13, 13]  # 62 or 63 each: 13 = n - floor(.8n)


def test_fig4_pathological_split_is_shards_of_the_pool() -> None:
    """pFedGate Fig. 4: CIFAR-10 pooled (10 classes x 6,000), 10 clients, 2 label-sorted shards each (FedEM's
    pathological split): every client has 6,000 samples of at most 2 classes, each shard a single class."""
    labels = np.random.default_rng(2).permutation(np.repeat(np.arange(10), 6000))
    parts = shards(labels, 10, shards_per_client=2, seed=12345)
    assert sorted(np.concatenate(parts).tolist()) == list(range(60000))
    for p in parts:
        counts = sorted(c for c in np.bincount(labels[p], minlength=10).tolist() if c)
        assert counts in ([6000], [3000, 3000])
    dm = FederatedDataModule(name="synthetic", num_clients=10, partition="shards", shards_per_client=2,
                             test_mode="pooled", split_ratios=(0.6, 0.2, 0.2), seed=12345,
                             synthetic={"num_train": 500, "num_test": 100, "size": 8, "channels": 1,
                                        "num_classes": 10})
    dm.setup()
    for k in range(10):
        assert [dm.num_samples(k, s) for s in ("train", "val", "test")] == [36, 12, 12]  # 60 = 6:2:2
        held = np.flatnonzero(sum(dm.client_label_counts(k, s) for s in ("train", "val", "test")))
        assert 1 <= len(held) <= 2 and set(np.flatnonzero(dm.client_label_counts(k, "test"))) <= set(held)


@pytest.mark.parametrize("kwargs,param", [
    ({"sample_fraction": 0.0}, "data.sample_fraction"), ({"sample_fraction": 2}, "data.sample_fraction"),
    ({"sample_fraction": True}, "data.sample_fraction"), ({"test_mode": "pool"}, "data.test_mode"),
    ({"seed": 2**32}, "data.seed"),
])
def test_datamodule_bad_values(kwargs: dict, param: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{param.replace('.', r'.')}=.* is invalid: expected ") as err:
        pooled_dm(**kwargs)
    assert "\n" not in str(err.value)
    if param == "data.test_mode":
        assert "'pooled'" in str(err.value)


def test_cli_pooled_run_and_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [*TINY_CLI, "--data.partition", "fedem_dirichlet", "--data.test_mode", "pooled",
            "--data.split_ratios", "[0.6, 0.2, 0.2]", "--data.seed", "12345", "--trainer.num_rounds", "1"]
    rows = fit_rows([*base, "--trainer.default_root_dir", str(tmp_path / "run")], capsys)
    assert 0.0 <= rows[-1]["acc_mean"] <= 1.0
    code, _, err = run_main(["fit", *base, "--data.sample_fraction", "0",
                             "--trainer.default_root_dir", str(tmp_path / "bad")], capsys)
    assert code != 0
    assert one_line(err).startswith("error: data.sample_fraction=0.0 is invalid: expected a number in (0, 1]")
