"""Pure, seeded label-based partitions of a dataset into federated clients.

Every function takes the labels ``int [N]`` of the data to split and returns one sorted ``int64`` index array per
client. They use only ``np.random.default_rng(seed)`` (no global numpy/torch state; :func:`fedem_dirichlet` uses
private ``random.Random(seed)`` and ``np.random.RandomState(seed)`` objects to replay FedEM's streams), so a
partition is a function of its arguments. :func:`partition` dispatches by scheme name and memoises results.

Schemes:

* :func:`iid` — uniform random equal split.
* :func:`dirichlet` — label skew with client label priors ``p_k ~ Dir(alpha)`` and equal sizes, dealt as in DisPFL's
  code (Dai et al., ICML 2022), or with ``quantity_skew=True`` the per-class Dirichlet split of NIID-Bench / FedLab
  used by DM-PFL, where client sizes vary too.
* :func:`pathological` — each client holds exactly ``classes_per_client`` classes (FedAvg-style pathological split).
* :func:`shards` — McMahan et al. (AISTATS 2017): sort by label, cut into shards, deal ``shards_per_client``.
* :func:`noniid_ratio` — FedPSE (App. C.1): a fraction λ of the data is label-ordered, the rest is i.i.d.; either
  sorted by label (``order="sorted"``) or, as the Flower code the paper follows, in two shuffled label halves
  (``order="halves"``).
* :func:`fedem_dirichlet` — FedEM's label-Dirichlet split (Marfoq et al., NeurIPS 2021; ``data/*/utils.py``
  ``split_dataset_by_labels`` with one cluster per class), used by pFedGate (Chen et al., ICML 2023): for every class,
  ``q ~ Dir(alpha * 1_K)`` over clients and multinomial counts. It reproduces FedEM's random streams, so the same
  seed gives the authors' split; :func:`fedem_client_split` is FedEM's per-client train / val / test split.

:func:`client_test_from_global` builds FedSpa/DisPFL-style personal test sets that follow each client's train label
distribution from the global test set.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from pl_fedsparse.errors import ConfigError, check

__all__ = ["SCHEMES", "NONIID_ORDERS", "iid", "dirichlet", "pathological", "shards", "noniid_ratio",
           "fedem_dirichlet", "fedem_client_split", "partition", "client_test_from_global", "clear_partition_memo"]

_MEMO: OrderedDict[tuple, tuple[np.ndarray, ...]] = OrderedDict()
_MEMO_SIZE = 64


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _prepare(labels: np.ndarray, num_clients: int, seed: int) -> np.ndarray:
    labels = np.asarray(labels)
    check(labels.ndim == 1 and (labels.size == 0 or np.issubdtype(labels.dtype, np.integer)), "labels",
          f"array{labels.shape} of {labels.dtype}", "a 1-d integer array")
    check(_is_int(num_clients) and num_clients >= 1, "data.num_clients", num_clients, "an int >= 1")
    check(num_clients <= len(labels), "data.num_clients", num_clients,
          f"at most the number of samples ({len(labels)})")
    check(_is_int(seed) and seed >= 0, "data.seed", seed, "an int >= 0")
    return labels.astype(np.int64, copy=False)


def _finish(parts: list[np.ndarray], hint: str) -> list[np.ndarray]:
    """Sort each client's indices; raise ConfigError if a client is empty."""
    out = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    empty = [k for k, p in enumerate(out) if len(p) == 0]
    if empty:
        raise ConfigError(f"data.num_clients={len(out)} is invalid: client {empty[0]} (of {len(empty)} empty) gets 0 "
                          f"samples; expected every client to get data: use fewer clients{hint}")
    return out


def iid(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Uniform random split into ``num_clients`` parts of equal size (±1).

    Example:
        >>> [len(p) for p in iid(np.zeros(10, dtype=int), 3, seed=0)]
        [4, 3, 3]
    """
    labels = _prepare(labels, num_clients, seed)
    perm = np.random.default_rng(seed).permutation(len(labels))
    return _finish(np.array_split(perm, num_clients), "")


def _class_indices(labels: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    classes = np.unique(labels)
    return classes, [rng.permutation(np.flatnonzero(labels == c)) for c in classes]


def _deal_equal_sizes(prior: np.ndarray, quota: np.ndarray, avail: np.ndarray,
                      rng: np.random.Generator) -> np.ndarray:
    """Vectorised DisPFL dealing: returns counts ``[K, C]`` with row sums ``quota`` and column sums ``<= avail``.

    DisPFL deals one sample at a time to a random client with quota left, drawing its class from ``p_k`` and redrawing
    while the class is exhausted, i.e. from ``p_k`` restricted to the classes left. Here every client draws its whole
    remaining quota from that restricted prior at once; a class asked for more than it has is granted to a uniformly
    random subset of the requests (multivariate hypergeometric, as a random dealing order would), and the round
    repeats for the unserved quota. Each round exhausts a class or finishes, so at most ``C + 1`` rounds run.
    """
    counts = np.zeros_like(prior, dtype=np.int64)
    quota, avail = quota.copy(), avail.copy()
    while quota.sum() > 0:
        open_cls = avail > 0
        p = prior * open_cls
        sums = p.sum(axis=1, keepdims=True)
        p = np.where(sums > 0, p / np.where(sums > 0, sums, 1), open_cls / open_cls.sum())  # all-zero: uniform
        demand = rng.multinomial(quota, p).astype(np.int64)
        grant = demand.copy()
        for c in np.flatnonzero(demand.sum(axis=0) > avail):
            grant[:, c] = rng.multivariate_hypergeometric(demand[:, c], int(avail[c]))
        counts += grant
        quota -= grant.sum(axis=1)
        avail -= grant.sum(axis=0)
    return counts


def dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int, quantity_skew: bool = False,
              min_samples: int = 0) -> list[np.ndarray]:
    """Dirichlet label-skew partition.

    Without quantity skew (DisPFL, Dai et al. 2022, ``partition_data(..., "dir")``): every client gets ``N // K``
    samples (the remainder is unused), draws a label prior ``p_k ~ Dir(alpha * 1_C)`` and receives samples whose
    labels follow ``p_k``, falling back to the classes left when one is exhausted (see :func:`_deal_equal_sizes`).

    With ``quantity_skew=True`` (NIID-Bench / FedLab ``hetero_dir_partition``, as used by DM-PFL): for every class
    ``c`` draw ``q ~ Dir(alpha * 1_K)`` over clients, zero it for clients already holding ``>= N / K`` samples,
    and split class ``c``'s shuffled indices proportionally; redraw everything (up to 1000 times) until every
    client holds ``>= max(min_samples, 1)`` samples. All ``N`` samples are used.

    Args:
        labels: ``int [N]`` labels.
        num_clients: ``K``.
        alpha: Dirichlet concentration (``> 0``; small = more skewed).
        seed: random seed.
        quantity_skew: use the per-class split (unequal client sizes).
        min_samples: the least number of samples per client.

    Example:
        >>> parts = dirichlet(np.repeat(np.arange(4), 25), num_clients=4, alpha=0.5, seed=0)
        >>> [len(p) for p in parts], len(np.unique(np.concatenate(parts)))
        ([25, 25, 25, 25], 100)
    """
    labels = _prepare(labels, num_clients, seed)
    check(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < math.inf, "data.alpha",
          alpha, "a number > 0")
    check(_is_int(min_samples) and min_samples >= 0, "data.min_samples", min_samples, "an int >= 0")
    n, k = len(labels), num_clients
    check(min_samples * k <= n, "data.min_samples", min_samples,
          f"at most N / num_clients = {n // k} ({n} samples, {k} clients)")
    rng = np.random.default_rng(seed)
    classes, by_class = _class_indices(labels, rng)
    hint = ", a larger data.alpha or data.min_samples >= 1"
    if not quantity_skew:
        prior = rng.dirichlet(np.full(len(classes), float(alpha)), size=k)
        prior = np.nan_to_num(prior, nan=0.0)
        quota = np.full(k, n // k, dtype=np.int64)
        counts = _deal_equal_sizes(prior, quota, np.array([len(ix) for ix in by_class]), rng)
        parts: list[list[np.ndarray]] = [[] for _ in range(k)]
        for c, ix in enumerate(by_class):
            for client, chunk in enumerate(np.split(ix, np.cumsum(counts[:, c])[:-1])):
                parts[client].append(chunk)
        return _finish([np.concatenate(p) for p in parts], hint)
    need = max(min_samples, 1)
    for _ in range(1000):
        buckets: list[list[np.ndarray]] = [[] for _ in range(k)]
        sizes = np.zeros(k, dtype=np.int64)
        for ix in by_class:
            q = rng.dirichlet(np.full(k, float(alpha)))
            q = np.nan_to_num(q, nan=0.0) * (sizes < n / k)
            q = q / q.sum() if q.sum() > 0 else np.full(k, 1.0 / k)
            cuts = (np.cumsum(q) * len(ix)).astype(np.int64)[:-1]
            for client, chunk in enumerate(np.split(ix, cuts)):
                buckets[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= need:
            return _finish([np.concatenate(b) for b in buckets], hint)
        by_class = [rng.permutation(ix) for ix in by_class]
    raise ConfigError(f"data.min_samples={min_samples} is invalid: 1000 Dirichlet draws with data.alpha={alpha} "
                      f"left a client with fewer than {need} samples; expected a feasible setting: use fewer "
                      f"clients, a larger data.alpha or a smaller data.min_samples")


def pathological(labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int) -> list[np.ndarray]:
    """Each client gets exactly ``classes_per_client`` distinct classes.

    Classes are assigned greedily in a random client order to the least-used classes (ties broken at random), so
    every class is held by ``ceil`` or ``floor`` of ``K * classes_per_client / C`` clients; each class's shuffled
    samples are split equally among its holders. Disjoint; all samples of used classes are used.

    Example:
        >>> parts = pathological(np.repeat(np.arange(4), 10), num_clients=4, classes_per_client=2, seed=0)
        >>> [len(np.unique(np.repeat(np.arange(4), 10)[p])) for p in parts], sum(len(p) for p in parts)
        ([2, 2, 2, 2], 40)
    """
    labels = _prepare(labels, num_clients, seed)
    rng = np.random.default_rng(seed)
    classes, by_class = _class_indices(labels, rng)
    check(_is_int(classes_per_client) and 1 <= classes_per_client <= len(classes), "data.classes_per_client",
          classes_per_client, f"an int in [1, {len(classes)}] (the number of classes)")
    usage = np.zeros(len(classes), dtype=np.int64)
    holders: list[list[int]] = [[] for _ in classes]
    for client in rng.permutation(num_clients):
        chosen = np.lexsort((rng.random(len(classes)), usage))[:classes_per_client]
        usage[chosen] += 1
        for c in chosen:
            holders[c].append(int(client))
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, ix in enumerate(by_class):
        for client, chunk in zip(holders[c], np.array_split(ix, max(len(holders[c]), 1))):
            parts[client].append(chunk)
    return _finish([np.concatenate(p) if p else np.empty(0, np.int64) for p in parts], " or more data")


def shards(labels: np.ndarray, num_clients: int, shards_per_client: int, seed: int) -> list[np.ndarray]:
    """McMahan et al. (2017) shards: sort by label, cut into ``K * s`` equal shards, deal ``s`` random shards each.

    Samples are shuffled before the stable sort, so the order inside a class is random. Each client holds at most
    ``shards_per_client`` classes when shards do not straddle class boundaries; two shards of one class make a
    one-class client.

    This is also FedEM's ``pathological_non_iid_split`` (``data/cifar10/utils.py``: sort by label, ``K * s`` equal
    shards, shuffled, ``s`` consecutive ones per client), which pFedGate's personalisation study (Fig. 4: CIFAR-10,
    10 clients, the code's default ``--n_shards 2``, train+test pooled, 6:2:2 per client) uses: ``num_clients=10,
    shards_per_client=2`` with the datamodule's ``test_mode="pooled"``. FedEM deals the shards with the unseeded
    global ``random.shuffle``, so its split cannot be replayed; this one is seeded. (:func:`pathological` differs: it
    gives every client exactly ``classes_per_client`` distinct classes.)

    Example:
        >>> parts = shards(np.repeat(np.arange(5), 4), num_clients=5, shards_per_client=2, seed=0)
        >>> sorted(len(p) for p in parts)
        [4, 4, 4, 4, 4]
    """
    labels = _prepare(labels, num_clients, seed)
    check(_is_int(shards_per_client) and shards_per_client >= 1, "data.shards_per_client", shards_per_client,
          "an int >= 1")
    total = num_clients * shards_per_client
    check(total <= len(labels), "data.shards_per_client", shards_per_client,
          f"num_clients * shards_per_client <= number of samples ({len(labels)})")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    order = perm[np.argsort(labels[perm], kind="stable")]
    pieces = np.array_split(order, total)
    deal = rng.permutation(total).reshape(num_clients, shards_per_client)
    return _finish([np.concatenate([pieces[s] for s in row]) for row in deal], "")


#: ``order`` values of :func:`noniid_ratio` (``data.noniid_order``)
NONIID_ORDERS = ("sorted", "halves")


def noniid_ratio(labels: np.ndarray, num_clients: int, ratio: float, seed: int,
                 order: str = "sorted") -> list[np.ndarray]:
    """FedPSE's λ-heterogeneity (App. C.1): a fraction ``ratio`` of the data is the heterogeneous part, label-ordered
    and cut into ``K`` contiguous chunks (client k gets chunk k); the rest is split i.i.d.; client k = union of both.

    FedPSE ("Personalized Sparsification with Element-wise Aggregation", anonymous ICLR submission) describes it in
    one sentence, App. C.1: "the whole training/test samples are separated into two parts, including the
    heterogeneous subset with λ percent and the homogeneous subset with (1.0 − λ) percent. On one hand, the
    homogeneous subset is averaged partitioned into N clients randomly. On the other hand, the heterogeneous subset
    is sorted by labels and split into N clients by order", and §5.1 ("Non-IID Setting") says the ratio "is the same
    with Beutel et al. (2020)" — Flower, whose FMNIST baseline (``flwr_experimental/baseline/dataset/dataset.py``,
    ``create_partitions``) is the code behind that sentence.
    ``order`` picks how literally the heterogeneous part is ordered:

    * ``"sorted"`` — the sentence read literally: the heterogeneous part (a random ``ratio`` share) is sorted by
      label. With ``ratio=1`` and ``K >= C`` classes every client holds one label (two at a chunk border), so a
      constant predictor scores 100 % on a personal test set built the same way.
    * ``"halves"`` — Flower's ``create_partitions``, the paper's protocol: shuffle, order by label in repeating
      groups (0, 1, …, C−1, 0, 1, …: rank within the class, then label), the first ``1 − ratio`` share is the
      homogeneous part (so each of its chunks is label-balanced), the rest the heterogeneous part; that part is
      sorted by label, cut at the middle sample and each half shuffled (Flower's ``shift``: "the first half contains
      only labels 0 to 4 and the second half 5 to 9"). With ``ratio=1`` and 10 balanced classes a client holds about
      five labels, whatever ``K``. This is the only reading that fits the paper's own numbers: FedPSE's FMNIST
      accuracy falls from 0.9466 (2 clients) to 0.8772 (100 clients) at λ = 1 (Table 2, lines 559-564), where
      ``"sorted"`` makes 100 one-label clients, and on two-class IMDB it is 0.995-0.999 at every ``K``, as the halves
      of two classes are one label each.

    ``ratio=0`` is i.i.d. in both orders. Flower's exact-division asserts are replaced by ``np.array_split`` and a
    rounded split point; unequal class sizes only make the tail of the repeating order (the heterogeneous part)
    lean to the larger classes.

    Args:
        labels: ``int [N]`` labels.
        num_clients: ``K``.
        ratio: λ in ``[0, 1]``, the heterogeneous share.
        seed: random seed.
        order: ``"sorted"`` or ``"halves"`` (see above).

    Returns:
        One sorted ``int64`` index array per client.

    Example:
        >>> y = np.repeat(np.arange(4), 5)
        >>> [np.unique(y[p]).tolist() for p in noniid_ratio(y, num_clients=4, ratio=1.0, seed=0)]
        [[0], [1], [2], [3]]
        >>> [np.unique(y[p]).tolist() for p in noniid_ratio(y, num_clients=2, ratio=1.0, seed=0, order="halves")]
        [[0, 1], [2, 3]]
    """
    labels = _prepare(labels, num_clients, seed)
    check(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 <= ratio <= 1.0,
          "data.noniid_ratio", ratio, "a number in [0, 1]")
    check(order in NONIID_ORDERS, "data.noniid_order", order, f"one of {', '.join(NONIID_ORDERS)}")
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    n_het = int(round(ratio * len(labels)))
    if order == "sorted":
        het, homo = perm[:n_het], perm[n_het:]
        het = het[np.argsort(labels[het], kind="stable")]
    else:  # Flower's create_partitions: shuffle, sort_by_label_repeating, split_at_fraction, shift
        by_label = perm[np.argsort(labels[perm], kind="stable")]
        sorted_y = labels[by_label]
        rank = np.arange(len(by_label)) - np.searchsorted(sorted_y, sorted_y, side="left")
        repeating = by_label[np.lexsort((sorted_y, rank))]
        homo, het = repeating[:len(labels) - n_het], repeating[len(labels) - n_het:]
        het = het[np.argsort(labels[het], kind="stable")]
        mid = len(het) // 2
        het = np.concatenate([rng.permutation(het[:mid]), rng.permutation(het[mid:])])
    return _finish([np.concatenate(pair) for pair in zip(np.array_split(het, num_clients),
                                                         np.array_split(homo, num_clients))], "")


def _check_seed32(seed: Any) -> None:
    check(_is_int(seed) and 0 <= seed < 2**32, "data.seed", seed, "an int in [0, 2**32 - 1] (numpy's RandomState)")


def _fedem_lists(labels: np.ndarray, num_clients: int, alpha: float, seed: int,
                 sample_fraction: float) -> list[np.ndarray]:
    """FedEM's ``split_dataset_by_labels`` with ``n_clusters = n_classes``, each client's list in FedEM's order."""
    num_classes = int(labels.max()) + 1 if len(labels) else 0
    rng = random.Random(seed)  # FedEM: rng = random.Random(seed); np.random.seed(seed)
    legacy = np.random.RandomState(seed)
    cluster_label = list(range(num_classes))
    rng.shuffle(cluster_label)  # iid_divide into n_classes groups of one: cluster i holds class cluster_label[i]
    selected = np.asarray(rng.sample(range(len(labels)), int(len(labels) * sample_fraction)), dtype=np.int64)
    selected_labels = labels[selected]
    clusters: list[list[int]] = []
    for c in cluster_label:  # each cluster in the order its samples were selected, then shuffled by rng
        members = selected[selected_labels == c].tolist()
        clusters.append(members)
    for members in clusters:
        rng.shuffle(members)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for members in clusters:  # per cluster: q ~ Dir(alpha 1_K), counts ~ Mult(|cluster|, q), cut at cumsum
        with np.errstate(invalid="ignore", divide="ignore"):
            weights = legacy.dirichlet(alpha * np.ones(num_clients))
        if not np.isfinite(weights).all():
            raise ConfigError(f"data.alpha={alpha!r} is invalid: Dir(alpha) over {num_clients} clients underflowed "
                              f"to NaN in numpy; expected a larger data.alpha")
        counts = legacy.multinomial(len(members), weights)
        arr = np.asarray(members, dtype=np.int64)
        for client, chunk in enumerate(np.split(arr, np.cumsum(counts)[:-1])):
            parts[client].append(chunk)
    return [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]


def fedem_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, seed: int, sample_fraction: float = 1.0,
                    ordered: bool = False) -> list[np.ndarray]:
    """FedEM's label-Dirichlet split with one cluster per class, as pFedGate's data scripts run it.

    Marfoq et al. (NeurIPS 2021), ``omarfoq/FedEM`` ``data/cifar10/utils.py:split_dataset_by_labels`` (identical in
    ``yxdyc/pFedGate``), called by ``data/{cifar10,cifar100,emnist}/generate_data.py --n_components -1 --alpha 0.4
    --seed 12345`` on the train and test splits concatenated (pass those pooled labels; the datamodule's
    ``test_mode="pooled"`` does). With ``C = max(label) + 1`` classes:

    1. ``random.Random(seed)`` shuffles the class list; ``n_components = -1`` makes every class its own cluster, in
       that shuffled order.
    2. The same generator draws ``int(N * sample_fraction)`` of the ``N`` samples (``rng.sample``; FedEM's
       ``--s_frac``: 0.1 for EMNIST, 1 for CIFAR); each cluster lists its selected samples in the order drawn and is
       shuffled (``rng.shuffle``), cluster by cluster.
    3. ``np.random.RandomState(seed)`` (FedEM seeds numpy's global generator) draws, cluster by cluster, client
       weights ``q ~ Dir(alpha * 1_K)`` and counts ``Multinomial(|cluster|, q)``; the cluster's list is cut at the
       cumulative counts, chunk ``k`` to client ``k``.

    Client sizes vary (no cap, no minimum); all selected samples are used once. The random calls are FedEM's, in its
    order, so with its seed and the pooled labels in torchvision's order the client sets are the authors'. The
    per-client label counts depend only on the seed and the class sizes, not on the order of the samples, so they
    are the authors' for any copy of a dataset. Unlike FedEM, which silently drops a client that gets no sample, an
    empty client is an error.

    Args:
        labels: ``int [N]`` labels (train then test, pooled, for FedEM's setting).
        num_clients: ``K``.
        alpha: Dirichlet concentration (``> 0``; pFedGate: 0.4).
        seed: random seed in ``[0, 2**32)`` (FedEM / pFedGate: 12345).
        sample_fraction: FedEM's ``s_frac``, the fraction of the ``N`` samples used, in ``(0, 1]``.
        ordered: return each client's indices in FedEM's order (cluster by cluster, as
            :func:`fedem_client_split` needs to replay FedEM's train/val/test split) instead of sorted.

    Returns:
        One ``int64`` index array per client.

    Example:
        >>> y = np.repeat(np.arange(3), 4)
        >>> parts = fedem_dirichlet(y, num_clients=2, alpha=0.4, seed=12345)
        >>> sorted(np.concatenate(parts).tolist()) == list(range(12))
        True
        >>> [len(p) for p in fedem_dirichlet(y, 1, alpha=0.4, seed=0, sample_fraction=0.5)]
        [6]
    """
    labels = _prepare(labels, num_clients, seed)
    check(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and 0 < alpha < math.inf, "data.alpha",
          alpha, "a number > 0")
    check(isinstance(sample_fraction, (int, float)) and not isinstance(sample_fraction, bool)
          and 0 < sample_fraction <= 1, "data.sample_fraction", sample_fraction, "a number in (0, 1]")
    _check_seed32(seed)
    check(labels.size == 0 or labels.min() >= 0, "labels", f"array with minimum {labels.min()}",
          "labels >= 0")
    check(int(len(labels) * sample_fraction) >= num_clients, "data.sample_fraction", sample_fraction,
          f"at least num_clients / N = {num_clients} / {len(labels)} (one sample per client)")
    parts = _fedem_lists(labels, num_clients, float(alpha), seed, float(sample_fraction))
    hint = ", a larger data.alpha or a larger data.sample_fraction"
    if not ordered:
        return _finish(parts, hint)
    _finish(parts, hint)  # the empty-client check
    return parts


def fedem_client_split(indices: np.ndarray, split_ratios: tuple[float, float, float],
                       seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One client's train / val / test split as FedEM's (and pFedGate's) ``data/*/generate_data.py`` makes it.

    The scripts call sklearn's ``train_test_split(indices, train_size=tr_frac, random_state=seed)`` and then
    ``train_test_split(train, train_size=1 - val_frac, random_state=seed)`` (``--tr_frac 0.8 --val_frac 0.25``:
    6:2:2), the same seed for every client. Here ``tr_frac = train + val`` and ``val_frac = val / tr_frac`` of
    ``split_ratios``, and each call is replayed without sklearn: ``n_keep = floor(train_size * n)``, a
    ``np.random.RandomState(seed).permutation(n)``, its first ``n - n_keep`` positions held out, the next ``n_keep``
    kept in permutation order. So: ``test = n - floor(tr_frac n)``, ``train = floor((1 - val_frac) (n - test))``,
    ``val`` the rest (no second call when ``val = 0``).

    Args:
        indices: the client's indices, in the order the partition produced them (:func:`fedem_dirichlet` with
            ``ordered=True`` to replay FedEM exactly).
        split_ratios: ``(train, val, test)`` fractions summing to 1 with ``train > 0``.
        seed: random seed in ``[0, 2**32)`` (FedEM / pFedGate: 12345).

    Returns:
        ``(train, val, test)`` sorted ``int64`` index arrays.

    Raises:
        ConfigError: the client is too small to keep a training sample.

    Example:
        >>> [len(a) for a in fedem_client_split(np.arange(10), (0.6, 0.2, 0.2), seed=12345)]
        [6, 2, 2]
        >>> [len(a) for a in fedem_client_split(np.arange(7), (0.6, 0.2, 0.2), seed=12345)]
        [3, 2, 2]
    """
    _check_seed32(seed)
    ratios = tuple(float(r) for r in split_ratios)
    check(len(ratios) == 3 and min(ratios) >= 0 and ratios[0] > 0 and abs(sum(ratios) - 1) < 1e-6,
          "data.split_ratios", list(split_ratios), "three numbers >= 0 (train, val, test) summing to 1 with train > 0")
    idx = np.asarray(indices, dtype=np.int64)
    r_train, r_val, _ = ratios
    tr_frac = r_train + r_val
    val_frac = r_val / tr_frac

    def keep_split(arr: np.ndarray, train_size: float) -> tuple[np.ndarray, np.ndarray]:
        n = len(arr)
        n_keep = min(math.floor(train_size * n), n)
        perm = np.random.RandomState(seed).permutation(n)
        return arr[perm[n - n_keep:]], arr[perm[:n - n_keep]]

    trval, test = keep_split(idx, tr_frac)
    train, val = keep_split(trval, 1.0 - val_frac) if val_frac > 0 else (trval, idx[:0])
    if len(train) < 1:
        raise ConfigError(f"data.split_ratios={list(split_ratios)} is invalid: a client has only {len(idx)} samples, "
                          f"too few for FedEM's train/val/test split (no training sample left); expected fewer "
                          f"data.num_clients, a larger data.alpha or data.sample_fraction, or other ratios")
    return np.sort(train), np.sort(val), np.sort(test)


SCHEMES: dict[str, Callable[..., list[np.ndarray]]] = {"iid": iid, "dirichlet": dirichlet,
                                                       "pathological": pathological, "shards": shards,
                                                       "noniid_ratio": noniid_ratio,
                                                       "fedem_dirichlet": fedem_dirichlet}
_KW_PARAM = {"alpha": "data.alpha", "quantity_skew": "data.quantity_skew", "min_samples": "data.min_samples",
             "classes_per_client": "data.classes_per_client", "shards_per_client": "data.shards_per_client",
             "ratio": "data.noniid_ratio", "order": "data.noniid_order", "sample_fraction": "data.sample_fraction"}
_ALLOWED_KW = {"iid": set(), "dirichlet": {"alpha", "quantity_skew", "min_samples"},
               "pathological": {"classes_per_client"}, "shards": {"shards_per_client"},
               "noniid_ratio": {"ratio", "order"},
               "fedem_dirichlet": {"alpha", "sample_fraction"}}


def clear_partition_memo() -> None:
    """Forget memoised partitions."""
    _MEMO.clear()


def partition(labels: np.ndarray, scheme: str, num_clients: int, seed: int, **kw: Any) -> list[np.ndarray]:
    """Partition by scheme name (one of :data:`SCHEMES`), memoised on the arguments and a digest of ``labels``.

    The returned arrays are read-only views shared between calls (copy them before modifying).

    Example:
        >>> y = np.repeat(np.arange(3), 4)
        >>> a = partition(y, "shards", 3, seed=1, shards_per_client=2)
        >>> b = partition(y, "shards", 3, seed=1, shards_per_client=2)
        >>> all((p == q).all() for p, q in zip(a, b)), a[0].flags.writeable
        (True, False)
    """
    check(scheme in SCHEMES, "data.partition", scheme, f"one of {', '.join(SCHEMES)}")
    for name, value in kw.items():
        check(name in _ALLOWED_KW[scheme], _KW_PARAM.get(name, name), value,
              f"no such option for partition {scheme!r} (allowed: {', '.join(sorted(_ALLOWED_KW[scheme])) or 'none'})")
    arr = np.ascontiguousarray(labels)
    digest = hashlib.sha1(arr.astype(np.int64, copy=False).tobytes()).hexdigest() if arr.ndim == 1 else None
    key = (scheme, num_clients, seed, tuple(sorted((k, repr(v)) for k, v in kw.items())), len(arr), digest)
    if digest is not None and key in _MEMO:
        _MEMO.move_to_end(key)
        return list(_MEMO[key])
    parts = SCHEMES[scheme](arr, num_clients, seed=seed, **kw)
    for p in parts:
        p.setflags(write=False)
    _MEMO[key] = tuple(parts)
    while len(_MEMO) > _MEMO_SIZE:
        _MEMO.popitem(last=False)
    return list(parts)


def client_test_from_global(test_labels: np.ndarray, train_labels_per_client: list[np.ndarray], num_classes: int,
                            per_client: int | None, seed: int) -> list[np.ndarray]:
    """Personal test sets drawn from the global test set following each client's train label distribution.

    As in FedSpa / DisPFL: with ``q = per_client`` (default ``ceil(|test| / K)``), client ``k`` gets, for each class
    ``c`` it holds, ``ceil(n_kc / n_k * q)`` test indices of class ``c`` drawn without replacement (capped at the
    class's test size). Different clients may share test samples. Client ``k`` is seeded by ``(seed, k)``.

    Args:
        test_labels: ``int [M]`` global test labels.
        train_labels_per_client: each client's train labels.
        num_classes: number of classes.
        per_client: the target test-set size per client, or ``None`` for ``ceil(M / K)``.
        seed: random seed.

    Returns:
        One sorted index array (into the global test set) per client.

    Example:
        >>> tests = client_test_from_global(np.repeat(np.arange(2), 10), [np.array([0, 0, 0, 1])], 2, 4, seed=0)
        >>> np.bincount(np.repeat(np.arange(2), 10)[tests[0]]).tolist()
        [3, 1]
    """
    test_labels = np.asarray(test_labels, dtype=np.int64)
    num = len(train_labels_per_client)
    check(num >= 1, "data.num_clients", num, "an int >= 1")
    check(per_client is None or (_is_int(per_client) and per_client >= 1), "data.test_per_client", per_client,
          "None or an int >= 1")
    q = per_client if per_client is not None else math.ceil(len(test_labels) / num)
    by_class = [np.flatnonzero(test_labels == c) for c in range(num_classes)]
    out = []
    for k, y in enumerate(train_labels_per_client):
        rng = np.random.default_rng([seed, k])
        counts = np.bincount(np.asarray(y, dtype=np.int64), minlength=num_classes)
        chosen = [rng.choice(by_class[c], size=min(math.ceil(counts[c] / counts.sum() * q - 1e-9),
                                                   len(by_class[c])), replace=False)
                  for c in np.flatnonzero(counts)]
        out.append(np.sort(np.concatenate(chosen)) if chosen else np.empty(0, np.int64))
    return out
