"""FedPSE's data protocol (App. C.1, §5.1 of ``shared/papers/002_4df165fcd9405f7c.txt``): the λ split of the Flower
code the paper follows (``data.noniid_order: halves``, the FMNIST configs' default) — its client label sets, its
personal test sets, what a constant predictor scores on them — and the literal label-sorted reading
(``noniid_order: sorted``, the library's default), still reachable, on which a constant predictor scores 100 %.

Synthetic data throughout (a datamodule subclass with exactly balanced labels); the Fashion-MNIST check skips when
``apt-get install -y dataset-fashion-mnist`` has not been run."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import torch
import yaml
from conftest import run_main

from pl_fedsparse.data import FederatedDataModule
from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.data.partition import noniid_ratio, partition
from pl_fedsparse.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FMNIST_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("fmnist_*.yaml"))
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
C = 10
LABELS = np.repeat(np.arange(C), 60)  # 600 samples, 60 per class


def flower_partitions(labels: np.ndarray, num_clients: int, lam: float, seed: int) -> list[np.ndarray]:
    """Flower's ``create_partitions`` (Beutel et al. 2020, ``flwr_experimental/baseline/dataset/dataset.py``) as
    that code does it with equal class sizes, re-written here on sample indices: shuffle; sort by label; reorder into
    repeating label groups by a reshape to ``[classes, n / classes]`` and a transpose; the first ``1 − λ`` share is
    the i.i.d. part; the rest is sorted by label, cut at the middle and each half shuffled (``shift``); both parts are
    cut into ``K`` equal pieces and client k takes piece k of each. The random draws are ``default_rng(seed)``'s in
    Flower's order (Flower uses numpy's global state)."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    idx = np.arange(n)[rng.permutation(n)]
    idx = idx[np.argsort(labels[idx], kind="stable")]
    idx = idx.reshape(C, n // C).T.reshape(n)
    cut = n - round(lam * n)
    homo, het = idx[:cut], idx[cut:]
    het = het[np.argsort(labels[het], kind="stable")]
    lo, hi = het[:len(het) // 2], het[len(het) // 2:]
    het = np.concatenate([lo[rng.permutation(len(lo))], hi[rng.permutation(len(hi))]])
    return [np.sort(np.concatenate([a, b])) for a, b in zip(np.split(homo, num_clients), np.split(het, num_clients))]


def label_sets(parts: list[np.ndarray], labels: np.ndarray = LABELS) -> list[list[int]]:
    return [np.unique(labels[p]).tolist() for p in parts]


# --------------------------------------------------------------------------------------------- the partition
@pytest.mark.parametrize("num_clients", [2, 5, 10])
@pytest.mark.parametrize("lam", [1.0, 0.5, 0.0])
def test_halves_is_flowers_split(num_clients: int, lam: float) -> None:
    ours = noniid_ratio(LABELS, num_clients, ratio=lam, seed=3, order="halves")
    ref = flower_partitions(LABELS, num_clients, lam, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(ours, ref))
    assert sorted(np.concatenate(ours).tolist()) == list(range(len(LABELS)))  # disjoint, every sample used


def test_halves_at_lambda_1_gives_five_labels_per_client_whatever_the_number_of_clients() -> None:
    low, high = list(range(5)), list(range(5, 10))
    assert label_sets(noniid_ratio(LABELS, 10, 1.0, seed=0, order="halves")) == [low] * 5 + [high] * 5
    assert label_sets(noniid_ratio(LABELS, 2, 1.0, seed=0, order="halves")) == [low, high]
    # 5 clients: the middle one straddles the two halves
    assert label_sets(noniid_ratio(LABELS, 5, 1.0, seed=0, order="halves")) == [low, low, low + high, high, high]
    # inside a half the labels are shuffled, not sorted: no client of ten holds a single label
    counts = [np.bincount(LABELS[p], minlength=C) for p in noniid_ratio(LABELS, 10, 1.0, seed=0, order="halves")]
    assert max(c.max() / c.sum() for c in counts) < 0.5


def test_halves_homogeneous_share_is_label_balanced() -> None:
    """λ = 0.5: the i.i.d. half comes from the repeating label order, so each client gets exactly 3 of every label
    from it (300 samples / 10 clients / 10 labels) on top of its heterogeneous half."""
    parts = noniid_ratio(LABELS, 10, 0.5, seed=0, order="halves")
    counts = np.array([np.bincount(LABELS[p], minlength=C) for p in parts])
    assert (counts[:5, 5:] == 3).all() and (counts[5:, :5] == 3).all()
    assert (counts[:5, :5].sum(axis=1) == 45).all()  # 15 balanced + 30 heterogeneous samples of labels 0-4


def test_sorted_is_still_the_literal_reading() -> None:
    """The old protocol: λ = 1 with as many clients as labels gives every client one label; it is the default of
    :func:`noniid_ratio` and of the datamodule."""
    assert label_sets(noniid_ratio(LABELS, 10, 1.0, seed=0)) == [[c] for c in range(C)]
    default, explicit = noniid_ratio(LABELS, 10, 0.5, seed=4), noniid_ratio(LABELS, 10, 0.5, seed=4, order="sorted")
    assert all(np.array_equal(a, b) for a, b in zip(default, explicit))


def test_bad_order_is_a_one_line_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^data\.noniid_order='shuffled' is invalid: expected one of sorted, halves"):
        noniid_ratio(LABELS, 10, 1.0, seed=0, order="shuffled")
    with pytest.raises(ConfigError, match=r"^data\.noniid_order='x' is invalid: expected one of sorted, halves$"):
        FederatedDataModule(partition="noniid_ratio", noniid_order="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^data\.noniid_order='halves' is invalid: .*no such option for partition "
                                          r"'iid'"):
        partition(LABELS, "iid", 10, seed=0, order="halves")


# --------------------------------------------------------------------------------------------- the datamodule
class Balanced(FederatedDataModule):
    """Float features with exactly balanced labels: 1,000 train and 500 test samples of 10 classes."""

    def load_base_dataset(self) -> BaseDataset:
        gen = torch.Generator().manual_seed(0)
        x_train, x_test = torch.randn(1000, 4, generator=gen), torch.randn(500, 4, generator=gen)
        return BaseDataset("balanced", x_train, torch.arange(1000) % C, x_test, torch.arange(500) % C, num_classes=C)


def fedpse_data(order: Literal["sorted", "halves"], lam: float = 1.0,
                num_clients: int = 10) -> FederatedDataModule:
    """The FMNIST configs' data protocol on the balanced task."""
    dm = Balanced(num_clients=num_clients, partition="noniid_ratio", noniid_ratio=lam, noniid_order=order,
                  test_mode="partition", split_ratios=(1.0, 0.0, 0.0))
    dm.setup()
    return dm


def best_constant_accuracy(dm: FederatedDataModule) -> float:
    """Mean over clients of the best accuracy any constant predictor (even one personal constant per client) can
    reach on the client's test set: its largest label share."""
    shares = [(c := dm.client_label_counts(k, "test")).max() / c.sum() for k in range(dm.num_clients)]
    return float(np.mean(shares))


def test_personal_test_sets_follow_the_training_labels_and_cover_the_test_split_once() -> None:
    """App. C.1: "we combine the above-mentioned homogeneous part and heterogeneous part into the individual
    training/test dataset of each client": every client's test set is its share of the base test split, split the
    same way as the training data, so it holds the labels its training data holds."""
    dm = fedpse_data("halves")
    tests = [dm.client_indices(k, "test") for k in range(10)]
    assert sorted(np.concatenate(tests).tolist()) == list(range(500))
    for k in range(10):
        train = set(np.flatnonzero(dm.client_label_counts(k, "train")).tolist())
        test = set(np.flatnonzero(dm.client_label_counts(k, "test")).tolist())
        assert train == test == set(range(5) if k < 5 else range(5, 10))
        assert dm.num_samples(k, "train") == 100 and dm.num_samples(k, "test") == 50


def test_a_constant_predictor_no_longer_scores_100_percent() -> None:
    """The literal reading at λ = 1 and 10 clients is won by a constant predictor; the paper's protocol is not: about
    a fifth (the largest of five label shares of a client) — and at λ = 0.5 still less than half."""
    assert best_constant_accuracy(fedpse_data("sorted")) == 1.0
    assert best_constant_accuracy(fedpse_data("halves")) < 0.4
    assert best_constant_accuracy(fedpse_data("halves", lam=0.5)) < 0.4
    assert best_constant_accuracy(fedpse_data("halves", lam=0.0)) == pytest.approx(0.1)


def test_the_option_changes_the_fingerprint_only_when_set() -> None:
    """Existing runs (no ``noniid_order`` in their config) keep their data fingerprint; the new split has its own."""
    old = Balanced(partition="noniid_ratio").fingerprint()
    assert "noniid_order" not in old and old == Balanced(partition="noniid_ratio", noniid_order="sorted").fingerprint()
    new = Balanced(partition="noniid_ratio", noniid_order="halves").fingerprint()
    assert new["noniid_order"] == "halves" and new != old
    assert "noniid_order" not in Balanced(partition="iid", noniid_order="halves").fingerprint()


# --------------------------------------------------------------------------------------------- the configs
@pytest.mark.parametrize("config", FMNIST_CONFIGS)
def test_fmnist_configs_default_to_the_paper_protocol_and_keep_the_old_one_as_an_option(
        config: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert len(FMNIST_CONFIGS) == 6
    for extra, order in (([], "halves"), (["--data.noniid_order", "sorted"], "sorted")):
        code, out, err = run_main(["fit", "--config", str(REPO / "configs" / config), *extra, "--print_config"],
                                  capsys)
        assert code == 0, err
        data = yaml.safe_load(out)["data"]
        assert (data["partition"], data["noniid_order"], data["test_mode"]) == ("noniid_ratio", order, "partition")


@pytest.mark.skipif(not (FASHION_DIR / "train-labels-idx1-ubyte.gz").exists(),
                    reason="apt-get install -y dataset-fashion-mnist")
def test_fashion_mnist_under_the_paper_protocol() -> None:
    """The FMNIST configs' data (whole training split, 10 clients, λ = 1): five labels per client, 6,000 training and
    1,000 test samples each, and the best constant predictor far from 100 % (the old split: exactly 100 %)."""
    cfg = yaml.safe_load((REPO / "configs" / "fmnist_fedpse.yaml").read_text())["data"]
    cfg["max_train_samples"] = None
    scores = {}
    for order in ("halves", "sorted"):
        dm = FederatedDataModule(**{**cfg, "noniid_order": order})
        dm.setup()
        scores[order] = best_constant_accuracy(dm)
        if order == "halves":
            for k in range(10):
                train = np.flatnonzero(dm.client_label_counts(k, "train")).tolist()
                test = np.flatnonzero(dm.client_label_counts(k, "test")).tolist()
                assert train == test == (list(range(5)) if k < 5 else list(range(5, 10)))
                assert dm.num_samples(k, "train") == 6000 and dm.num_samples(k, "test") == 1000
    assert scores["sorted"] == 1.0 and scores["halves"] < 0.25
