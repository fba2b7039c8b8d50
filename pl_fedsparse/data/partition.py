"""Pure, seeded label-based partitions of a dataset into federated clients.

Every function takes the labels ``int [N]`` of the data to split and returns one sorted ``int64`` index array per
client. They use only ``np.random.default_rng(seed)`` (no global numpy/torch state), so a partition is a function
of its arguments. :func:`partition` dispatches by scheme name and memoises results.

Schemes:

* :func:`iid` — uniform random equal split.
* :func:`dirichlet` — label skew with client label priors ``p_k ~ Dir(alpha)`` and equal sizes, dealt as in DisPFL's
  code (Dai et al., ICML 2022), or with ``quantity_skew=True`` the per-class Dirichlet split of NIID-Bench / FedLab
  used by DM-PFL, where client sizes vary too.
* :func:`pathological` — each client holds exactly ``classes_per_client`` classes (FedAvg-style pathological split).
* :func:`shards` — McMahan et al. (AISTATS 2017): sort by label, cut into shards, deal ``shards_per_client``.
* :func:`noniid_ratio` — FedPSE (App. C.1): a fraction λ of the data is sorted by label, the rest is i.i.d.

:func:`client_test_from_global` builds FedSpa/DisPFL-style personal test sets that follow each client's train label
distribution from the global test set.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from pl_fedsparse.errors import ConfigError, check

__all__ = ["SCHEMES", "iid", "dirichlet", "pathological", "shards", "noniid_ratio", "partition",
           "client_test_from_global", "clear_partition_memo"]

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
    ``shards_per_client`` classes when shards do not straddle class boundaries.

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


def noniid_ratio(labels: np.ndarray, num_clients: int, ratio: float, seed: int) -> list[np.ndarray]:
    """FedPSE's λ-heterogeneity (App. C.1): a fraction ``ratio`` of the shuffled data is sorted by label and cut into
    ``K`` contiguous chunks in order (client k gets chunk k), the rest is split i.i.d.; client k = union of both.

    ``ratio=0`` is i.i.d., ``ratio=1`` gives each client a contiguous label range.

    Example:
        >>> y = np.repeat(np.arange(4), 5)
        >>> [np.unique(y[p]).tolist() for p in noniid_ratio(y, num_clients=4, ratio=1.0, seed=0)]
        [[0], [1], [2], [3]]
    """
    labels = _prepare(labels, num_clients, seed)
    check(isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0.0 <= ratio <= 1.0,
          "data.noniid_ratio", ratio, "a number in [0, 1]")
    perm = np.random.default_rng(seed).permutation(len(labels))
    n_het = int(round(ratio * len(labels)))
    het, homo = perm[:n_het], perm[n_het:]
    het = het[np.argsort(labels[het], kind="stable")]
    return _finish([np.concatenate(pair) for pair in zip(np.array_split(het, num_clients),
                                                         np.array_split(homo, num_clients))], "")


SCHEMES: dict[str, Callable[..., list[np.ndarray]]] = {"iid": iid, "dirichlet": dirichlet,
                                                       "pathological": pathological, "shards": shards,
                                                       "noniid_ratio": noniid_ratio}
_KW_PARAM = {"alpha": "data.alpha", "quantity_skew": "data.quantity_skew", "min_samples": "data.min_samples",
             "classes_per_client": "data.classes_per_client", "shards_per_client": "data.shards_per_client",
             "ratio": "data.noniid_ratio"}
_ALLOWED_KW = {"iid": set(), "dirichlet": {"alpha", "quantity_skew", "min_samples"},
               "pathological": {"classes_per_client"}, "shards": {"shards_per_client"}, "noniid_ratio": {"ratio"}}


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
