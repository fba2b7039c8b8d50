"""``FederatedDataModule``: a base dataset split into per-client train / val / test sets.

The federated loop asks it for one client's loaders at a time (:meth:`FederatedDataModule.train_loader`,
:meth:`FederatedDataModule.eval_loader`); every client set is an index array into the base dataset's uint8 tensors,
which stay in one place (CPU, or the GPU with ``device="cuda"``) and are never copied per client.

Four ways to build personal test sets:

* ``test_mode="split"`` (DM-PFL, FedPSE, ...): the partition covers the whole base train split and each client's
  samples are split train / val / test by ``split_ratios``; the base test split only serves shifted evaluation.
* ``test_mode="global"`` (FedSpa, DisPFL): a client trains on its whole partition (minus an optional validation
  share) and is tested on samples of the base test split that follow its train label distribution
  (:func:`~pl_fedsparse.data.partition.client_test_from_global`).
* ``test_mode="partition"`` (FedPSE, App. C.1: "test sets are built the same way"): the base test split is
  partitioned with the same scheme and parameters as the training data (another seed), client ``k`` is tested on its
  part; training uses the whole training partition (minus an optional validation share).
* ``test_mode="pooled"`` (FedEM's and pFedGate's ``data/*/generate_data.py``): the base train and test splits are
  concatenated (train first), the partition covers this pool, and each client's part is split train / val / test by
  ``split_ratios`` with FedEM's rounding and random stream
  (:func:`~pl_fedsparse.data.partition.fedem_client_split`); personal test sets therefore come from the pool, not
  from the base test split. With ``partition="fedem_dirichlet"`` and the scripts' seed 12345 this replays the
  authors' split (see :func:`~pl_fedsparse.data.partition.fedem_dirichlet`). Client indices index the pooled
  arrays: ``i < len(train)`` is base train sample ``i``, otherwise base test sample ``i - len(train)``. Shifted
  evaluation (``eval_loader(shift=...)``) still draws its replacements from the base test split.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import lightning
import numpy as np
import torch

from pl_fedsparse.data.datasets import DATASETS, EMNIST_SPLITS, BaseDataset, load_dataset, synthetic_params
from pl_fedsparse.data.loaders import TensorBatchLoader, normalize
from pl_fedsparse.data.partition import (
    SCHEMES,
    client_test_from_global,
    fedem_client_split,
    fedem_dirichlet,
    partition,
)
from pl_fedsparse.data.corruptions import CORRUPTIONS, corrupt
from pl_fedsparse.data.shift import shifted_test_indices, shifted_test_split
from pl_fedsparse.errors import ConfigError, check

__all__ = ["FederatedDataModule"]

_FINGERPRINT_VERSION = 1
_SCHEME_PARAMS = {"iid": (), "dirichlet": ("alpha", "quantity_skew", "min_samples"),
                  "pathological": ("classes_per_client",), "shards": ("shards_per_client",),
                  "noniid_ratio": ("noniid_ratio",), "fedem_dirichlet": ("alpha", "sample_fraction")}
_TEST_MODES = ("split", "global", "partition", "pooled")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class FederatedDataModule(lightning.LightningDataModule):
    """Federated split of a base dataset (see the module docstring).

    Args:
        name: base dataset, one of :data:`~pl_fedsparse.data.datasets.DATASETS`.
        root: data folder (not needed for ``synthetic``); unset: the download folder ``~/.cache/pl_fedsparse/<name>``.
        num_clients: number of clients ``K``.
        partition: partition scheme (see :mod:`pl_fedsparse.data.partition`).
        alpha: Dirichlet concentration for ``partition="dirichlet"`` and ``"fedem_dirichlet"``.
        quantity_skew: Dirichlet per-class split with unequal client sizes (DM-PFL) instead of DisPFL's.
        classes_per_client: classes per client for ``partition="pathological"``.
        shards_per_client: shards per client for ``partition="shards"``.
        noniid_ratio: FedPSE's λ for ``partition="noniid_ratio"``.
        min_samples: least number of samples per client (Dirichlet).
        sample_fraction: FedEM's ``s_frac`` for ``partition="fedem_dirichlet"``: the fraction of the data (the pool
            in ``"pooled"`` mode) that the partition deals out (pFedGate's EMNIST: 0.1).
        test_mode: ``"split"``, ``"global"``, ``"partition"`` or ``"pooled"`` (see the module docstring).
        split_ratios: train/val/test fractions of each client's data (``"split"``, ``"pooled"``); in ``"global"`` and
            ``"partition"`` mode only the validation share ``val / (train + val)`` is used.
        test_per_client: personal test-set size in ``"global"`` mode (default ``ceil(|test| / K)``).
        max_train_samples: random subset of the base train split (of the pool in ``"pooled"`` mode) to use
            (seeded), for CPU-sized runs.
        batch_size: training batch size.
        eval_batch_size: evaluation batch size.
        augment: CIFAR augmentation (random crop + flip) on training batches.
        download: when no local copy is found, download the dataset with torchvision (needs network) into ``root``,
            or ``$PL_FEDSPARSE_CACHE/<name>`` (default ``~/.cache/pl_fedsparse/<name>``) when ``root`` is unset; a
            local copy always wins. ``false`` never downloads (a missing copy is a one-line error).
        device: ``None`` keeps the data on the CPU; ``"cuda"`` moves the base tensors to the GPU once.
        synthetic: overrides of the synthetic task's parameters.
        emnist_split: EMNIST split.
        seed: seed of the subsample, the partition and the per-client splits (``< 2**32`` in ``"pooled"`` mode and
            for ``fedem_dirichlet``, which use numpy's ``RandomState`` as FedEM does).
    """

    def __init__(self, name: str = "synthetic", root: str | None = None, num_clients: int = 10,
                 partition: Literal["iid", "dirichlet", "pathological", "shards", "noniid_ratio",
                                    "fedem_dirichlet"] = "dirichlet",
                 alpha: float = 0.3, quantity_skew: bool = False, classes_per_client: int = 2,
                 shards_per_client: int = 2, noniid_ratio: float = 1.0, min_samples: int = 1,
                 sample_fraction: float = 1.0,
                 test_mode: Literal["split", "global", "partition", "pooled"] = "split",
                 split_ratios: tuple[float, float, float] = (0.75, 0.0, 0.25),
                 test_per_client: int | None = None, max_train_samples: int | None = None,
                 batch_size: int = 64, eval_batch_size: int = 512, augment: bool = False,
                 download: bool = True, device: str | None = None,
                 synthetic: dict | None = None, emnist_split: str = "balanced", seed: int = 0) -> None:
        super().__init__()
        check(name in DATASETS, "data.name", name, f"one of {', '.join(DATASETS)}")
        check(root is None or isinstance(root, str), "data.root", root, "a folder path or None")
        check(_is_int(num_clients) and num_clients >= 1, "data.num_clients", num_clients, "an int >= 1")
        check(partition in SCHEMES, "data.partition", partition, f"one of {', '.join(SCHEMES)}")
        check(_is_num(alpha) and alpha > 0, "data.alpha", alpha, "a number > 0")
        check(_is_int(classes_per_client) and classes_per_client >= 1, "data.classes_per_client",
              classes_per_client, "an int >= 1")
        check(_is_int(shards_per_client) and shards_per_client >= 1, "data.shards_per_client", shards_per_client,
              "an int >= 1")
        check(_is_num(noniid_ratio) and 0 <= noniid_ratio <= 1, "data.noniid_ratio", noniid_ratio,
              "a number in [0, 1]")
        check(_is_int(min_samples) and min_samples >= 0, "data.min_samples", min_samples, "an int >= 0")
        check(_is_num(sample_fraction) and 0 < sample_fraction <= 1, "data.sample_fraction", sample_fraction,
              "a number in (0, 1]")
        check(test_mode in _TEST_MODES, "data.test_mode", test_mode, "'split', 'global', 'partition' or 'pooled'")
        ratios = tuple(split_ratios) if isinstance(split_ratios, (tuple, list)) else ()
        check(len(ratios) == 3 and all(_is_num(r) and r >= 0 for r in ratios) and abs(sum(ratios) - 1) < 1e-6
              and ratios[0] > 0, "data.split_ratios", split_ratios,
              "three numbers >= 0 (train, val, test) summing to 1 with train > 0")
        check(test_per_client is None or (_is_int(test_per_client) and test_per_client >= 1),
              "data.test_per_client", test_per_client, "None or an int >= 1")
        check(max_train_samples is None or (_is_int(max_train_samples) and max_train_samples >= 1),
              "data.max_train_samples", max_train_samples, "None or an int >= 1")
        check(_is_int(batch_size) and batch_size >= 1, "data.batch_size", batch_size, "an int >= 1")
        check(_is_int(eval_batch_size) and eval_batch_size >= 1, "data.eval_batch_size", eval_batch_size,
              "an int >= 1")
        for pname, flag in (("quantity_skew", quantity_skew), ("augment", augment), ("download", download)):
            check(isinstance(flag, bool), f"data.{pname}", flag, "true or false")
        check(emnist_split in EMNIST_SPLITS, "data.emnist_split", emnist_split, f"one of {', '.join(EMNIST_SPLITS)}")
        check(_is_int(seed) and seed >= 0, "data.seed", seed, "an int >= 0")
        check(seed < 2**32 or (test_mode != "pooled" and partition != "fedem_dirichlet"), "data.seed", seed,
              "an int in [0, 2**32 - 1] with test_mode 'pooled' or partition 'fedem_dirichlet' (numpy's RandomState)")
        self._synthetic = synthetic_params(synthetic) if name == "synthetic" else None
        if device is not None:
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError):
                raise ConfigError(f"data.device={device!r} is invalid: expected None, 'cpu' or 'cuda[:N]'") from None
            check(dev.type != "cuda" or torch.cuda.is_available(), "data.device", device,
                  "None or 'cpu' on this machine (CUDA is not available)")
        self.name, self.root, self._num_clients, self.partition = name, root, num_clients, partition
        self.alpha, self.quantity_skew, self.classes_per_client = float(alpha), quantity_skew, classes_per_client
        self.shards_per_client, self.noniid_ratio, self.min_samples = shards_per_client, float(noniid_ratio), \
            min_samples
        self.sample_fraction = float(sample_fraction)
        self.test_mode, self.split_ratios, self.test_per_client = test_mode, tuple(float(r) for r in ratios), \
            test_per_client
        self.max_train_samples, self.batch_size, self.eval_batch_size = max_train_samples, batch_size, eval_batch_size
        self.augment, self.download, self.device = augment, download, device
        self.emnist_split, self.seed = emnist_split, seed
        self._base: BaseDataset | None = None
        self._splits: dict[str, list[np.ndarray]] = {}

    # ------------------------------------------------------------------------------------------- setup

    def _load(self) -> BaseDataset:
        return load_dataset(self.name, self.root, self.download, synthetic=self._synthetic,
                            emnist_split=self.emnist_split)

    def prepare_data(self) -> None:
        """Download (if enabled) / decode the base dataset once."""
        self._load()

    def setup(self, stage: str | None = None) -> None:
        """Load the base dataset and build every client's index sets (idempotent)."""
        if self._base is not None:
            return
        base = self._load()
        pooled = self.test_mode == "pooled"  # FedEM: ConcatDataset([train, test])
        train_y = np.concatenate([base.train_y.numpy(), base.test_y.numpy()]) if pooled else base.train_y.numpy()
        pool = np.arange(len(train_y))
        if self.max_train_samples is not None and self.max_train_samples < len(pool):
            rng = np.random.default_rng([self.seed, 1])
            pool = np.sort(rng.choice(len(pool), size=self.max_train_samples, replace=False))
        kw: dict[str, Any] = {p: getattr(self, p) for p in _SCHEME_PARAMS[self.partition]}
        if self.partition == "noniid_ratio":
            kw = {"ratio": self.noniid_ratio}
        if pooled and self.partition == "fedem_dirichlet":  # FedEM's order, for its per-client split
            raw = fedem_dirichlet(train_y[pool], self._num_clients, self.alpha, self.seed, self.sample_fraction,
                                  ordered=True)
        else:
            raw = partition(train_y[pool], self.partition, self._num_clients, self.seed, **kw)
        parts = [pool[p] for p in raw]
        r_train, r_val, r_test = self.split_ratios
        splits: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
        for k, idx in enumerate(parts):
            if pooled:
                for name, arr in zip(("train", "val", "test"), fedem_client_split(idx, self.split_ratios, self.seed)):
                    splits[name].append(arr)
                continue
            rng = np.random.default_rng([self.seed, 2, k])
            perm = rng.permutation(idx)
            n = len(perm)
            if self.test_mode == "split":
                n_test = max(1, round(r_test * n)) if r_test > 0 else 0
                n_val = max(1, round(r_val * n)) if r_val > 0 else 0
            else:
                n_test, n_val = 0, (max(1, round(r_val / (r_train + r_val) * n)) if r_val > 0 else 0)
            if n - n_test - n_val < 1:
                raise ConfigError(f"data.split_ratios={list(self.split_ratios)} is invalid: client {k} has only {n} "
                                  f"samples, too few for a train/val/test split; expected fewer data.num_clients, "
                                  f"a larger data.min_samples or data.alpha, or other ratios")
            splits["test"].append(np.sort(perm[:n_test]))
            splits["val"].append(np.sort(perm[n_test:n_test + n_val]))
            splits["train"].append(np.sort(perm[n_test + n_val:]))
        if self.test_mode == "partition":  # the base test split, partitioned like the training data (FedPSE App. C.1)
            test_y = base.test_y.numpy()
            splits["test"] = [np.sort(p) for p in partition(test_y, self.partition, self._num_clients, self.seed + 1,
                                                            **kw)]
        if self.test_mode == "global":
            splits["test"] = client_test_from_global(base.test_y.numpy(), [train_y[p] for p in parts],
                                                     base.num_classes, self.test_per_client, self.seed)
        for arrays in splits.values():
            for a in arrays:
                a.setflags(write=False)
        self._splits = splits
        train_x, train_t = base.train_x, base.train_y
        if pooled:  # one copy of the images, train then test (the indices above index it)
            train_x, train_t = torch.cat([base.train_x, base.test_x]), torch.cat([base.train_y, base.test_y])
        self._train_x, self._train_y, self._test_x, self._test_y = train_x, train_t, base.test_x, base.test_y
        if self.device is not None:  # GPU-resident base tensors, moved once
            self._train_x, self._train_y, self._test_x, self._test_y = (
                t.to(self.device) for t in (train_x, train_t, base.test_x, base.test_y))
        self._train_y_np, self._test_y_np = train_y, base.test_y.numpy()
        self._base = base

    # ------------------------------------------------------------------------------------------- properties

    @property
    def base(self) -> BaseDataset:
        """The base dataset (loads it on first use)."""
        self.setup()
        assert self._base is not None
        return self._base

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return self._num_clients

    @property
    def num_classes(self) -> int:
        """Number of classes of the base dataset."""
        return self.base.num_classes

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one image."""
        c, h, w = self.base.train_x.shape[1:]
        return int(c), int(h), int(w)

    # ------------------------------------------------------------------------------------------- per-client API

    def _check_client(self, client_idx: int, split: str, allowed: tuple[str, ...] = ("train", "val", "test")) -> None:
        check(_is_int(client_idx) and 0 <= client_idx < self._num_clients, "client_idx", client_idx,
              f"an int in [0, {self._num_clients})")
        check(split in allowed, "split", split, " or ".join(repr(s) for s in allowed))
        self.setup()

    def client_indices(self, client_idx: int, split: Literal["train", "val", "test"] = "train") -> np.ndarray:
        """Read-only indices of a client's split into the base train arrays (the base *test* arrays for the test
        split when ``test_mode`` is ``"global"`` or ``"partition"``; the pooled train-then-test arrays for every split
        when it is ``"pooled"``)."""
        self._check_client(client_idx, split)
        return self._splits[split][client_idx]

    def _source(self, split: str) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        if split == "test" and self.test_mode in ("global", "partition"):
            return self._test_x, self._test_y, self._test_y_np
        return self._train_x, self._train_y, self._train_y_np

    def num_samples(self, client_idx: int, split: Literal["train", "val", "test"] = "train") -> int:
        """Number of samples in a client's split."""
        return len(self.client_indices(client_idx, split))

    def client_label_counts(self, client_idx: int, split: Literal["train", "val", "test"] = "train") -> np.ndarray:
        """Per-class sample counts (length ``num_classes``) of a client's split."""
        idx = self.client_indices(client_idx, split)
        return np.bincount(self._source(split)[2][idx], minlength=self.num_classes)

    def train_loader(self, client_idx: int, seed: int) -> TensorBatchLoader:
        """Shuffled (and, if configured, augmented) training batches of one client, reproducible from ``seed``."""
        idx = self.client_indices(client_idx, "train")
        return TensorBatchLoader(self._train_x, self._train_y, self.batch_size, shuffle=True, generator_seed=seed,
                                 mean=self.base.mean, std=self.base.std, augment=self.augment, indices=idx)

    def eval_loader(self, client_idx: int, split: Literal["train", "val", "test"] = "test", shift: float = 0.0,
                    seed: int = 0, corruption: str | None = None, severity: int = 0) -> TensorBatchLoader:
        """Unshuffled, unaugmented evaluation batches of a client's train/val/test split.

        With ``shift > 0`` a fraction ``shift`` of the samples is replaced by samples drawn uniformly from the base
        test split (DM-PFL, :mod:`pl_fedsparse.data.shift`), seeded by ``(seed, client_idx)``. With ``corruption``
        every image is corrupted at ``severity`` (1-5; :mod:`pl_fedsparse.data.corruptions`), seeded by
        ``(seed, client_idx, corruption, severity)``.
        """
        self._check_client(client_idx, split)
        check(_is_num(shift) and 0 <= shift <= 1, "shift", shift, "a number in [0, 1]")
        idx = self.client_indices(client_idx, split)
        images, labels, _ = self._source(split)
        mean, std = self.base.mean, self.base.std
        if shift > 0:
            shift_seed = int(np.random.SeedSequence([seed, client_idx]).generate_state(1)[0])
            if images is self._test_x:  # client and pool index the same array
                idx = shifted_test_indices(idx, len(self._test_y), shift, shift_seed)
            else:
                kept, drawn = shifted_test_split(idx, len(self._test_y), shift, shift_seed)
                images = torch.cat([images[torch.as_tensor(kept, device=images.device)],
                                    self._test_x[torch.as_tensor(drawn, device=images.device)]])
                labels = torch.cat([labels[torch.as_tensor(kept, device=labels.device)],
                                    self._test_y[torch.as_tensor(drawn, device=labels.device)]])
                idx = None
        if corruption is not None:
            if idx is not None:
                rows = torch.as_tensor(np.array(idx, dtype=np.int64, copy=True), device=images.device)
                images, labels, idx = images[rows], labels[rows], None
            check(corruption in CORRUPTIONS, "corruption", corruption, "one of " + ", ".join(CORRUPTIONS))
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence(
                [seed, client_idx, 101, CORRUPTIONS.index(corruption) + 1, int(severity)]).generate_state(1)[0]))
            images = corrupt(images.cpu(), corruption, severity, gen).to(labels.device)
        return TensorBatchLoader(images, labels, self.eval_batch_size, shuffle=False, generator_seed=seed, mean=mean,
                                 std=std, augment=False, indices=idx)

    def example_input(self, batch_size: int = 2) -> torch.Tensor:
        """The first ``batch_size`` base train images, normalised, as a float CPU tensor."""
        check(_is_int(batch_size) and batch_size >= 1, "batch_size", batch_size, "an int >= 1")
        base = self.base
        return normalize(base.train_x[:batch_size], base.mean, base.std)

    def fingerprint(self) -> dict[str, Any]:
        """JSON-able description of everything that determines the clients' data (not paths, devices, batch sizes).

        Only the options of the chosen partition scheme are included, so e.g. ``alpha`` does not matter for
        ``partition="iid"``.
        """
        fp: dict[str, Any] = {"version": _FINGERPRINT_VERSION, "name": self.name, "num_clients": self._num_clients,
                              "partition": self.partition, "test_mode": self.test_mode,
                              "split_ratios": list(self.split_ratios), "max_train_samples": self.max_train_samples,
                              "seed": self.seed}
        fp.update({p: getattr(self, p) for p in _SCHEME_PARAMS[self.partition]})
        if self.test_mode == "global":
            fp["test_per_client"] = self.test_per_client
        if self.name == "synthetic":
            fp["synthetic"] = dict(sorted(self._synthetic.items()))  # type: ignore[union-attr]
        if self.name == "emnist":
            fp["emnist_split"] = self.emnist_split
        return fp

    def __repr__(self) -> str:
        return f"FederatedDataModule({', '.join(f'{k}={v!r}' for k, v in self.fingerprint().items())})"
