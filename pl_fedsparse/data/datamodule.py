"""``FederatedDataModule``: a base dataset split into per-client train / val / test sets.

The federated loop asks it for one client's loaders at a time (:meth:`FederatedDataModule.train_loader`,
:meth:`FederatedDataModule.eval_loader`); every client set is an index array into the base dataset's tensors, which
stay in one place (CPU, or the GPU with ``device="cuda"``) and are never copied per client.

The base dataset comes from :meth:`FederatedDataModule.load_base_dataset`: by default one of the built-in sources
chosen by ``data.name`` (:mod:`pl_fedsparse.data.datasets`, :mod:`pl_fedsparse.data.sources`: synthetic, CIFAR,
(Fashion-/E)MNIST, any image folder, a ``.pt``/``.npz`` file of tensors, any torchvision dataset, LEAF's JSON), or
your own: subclass the module, override that one method, and select it with
``data: {class_path: mypkg.MyDataModule, init_args: {...}}``. Inputs may be images, float features or token ids
(:class:`~pl_fedsparse.data.datasets.BaseDataset`); augmentation and corruptions are for images only
(:attr:`FederatedDataModule.supports_corruptions`).

Partitions: a synthetic, label-based scheme (:mod:`pl_fedsparse.data.partition`; it reads the labels only, never
the inputs), or ``partition="natural"``: the dataset's own per-sample client ids (``train_client`` /
``test_client``: a ``tensors`` file's ids, LEAF's users, a subclass's), where client ``k`` is the ``k``-th smallest
id and ``num_clients`` must be the number of distinct ids (``null`` sets it).

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

With ``partition="natural"`` the modes mean: ``"split"`` — each client's own training samples are split by
``split_ratios``; ``"partition"`` — client ``k`` trains on its training samples and is tested on its own test samples
(``test_client`` ids required: LEAF's and most natural benchmarks' protocol); ``"global"`` — tested on base test
samples following its label distribution; ``"pooled"`` — its train and test samples are pooled and split by
``split_ratios`` (``test_client`` required).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, Literal

import lightning
import numpy as np
import torch

from pl_fedsparse.data.base import BaseDataset, InputKind
from pl_fedsparse.data.corruptions import CIFAR10C, CORRUPTION_NAMES, CORRUPTIONS, corrupt
from pl_fedsparse.data.datasets import DATASETS, load_dataset
from pl_fedsparse.data.loaders import (
    AUGMENT_PAD,
    PreparedInputs,
    TensorBatchLoader,
    dataset_loader,
    item_input,
    normalize,
    prepare_inputs,
)
from pl_fedsparse.data.natural import client_groups, natural_clients
from pl_fedsparse.data.partition import (
    NONIID_ORDERS,
    SCHEMES,
    client_test_from_global,
    fedem_client_split,
    fedem_dirichlet,
    partition,
)
from pl_fedsparse.data.shift import label_matched_rows, shifted_test_indices, shifted_test_split
from pl_fedsparse.data.sources._common import image_size_pair
from pl_fedsparse.data.sources.idx import EMNIST_SPLITS
from pl_fedsparse.data.sources.synthetic import synthetic_params
from pl_fedsparse.data.sources.torchvision_class import resolve_torchvision_class
from pl_fedsparse.data.validate import validate_base_dataset
from pl_fedsparse.errors import ConfigError, check, user_code
from pl_fedsparse.functional import transfer

__all__ = ["AUTO_DATA_SHARE", "AUTO_EVAL_BATCH_SIZE", "FederatedDataModule"]

log = logging.getLogger(__name__)

_FINGERPRINT_VERSION = 1
_SCHEME_PARAMS = {"iid": (), "dirichlet": ("alpha", "quantity_skew", "min_samples"),
                  "pathological": ("classes_per_client",), "shards": ("shards_per_client",),
                  "noniid_ratio": ("noniid_ratio",), "fedem_dirichlet": ("alpha", "sample_fraction"), "natural": ()}
#: ``partition="natural"``: the dataset's own client ids instead of a scheme of :data:`SCHEMES`
NATURAL = "natural"
#: ``data.device: auto``: the largest share of an accelerator's free memory the dataset may take there
AUTO_DATA_SHARE = 0.25


def _free_memory(device: torch.device) -> int:
    """Free bytes on an accelerator (CUDA: ``mem_get_info``; 0 where it cannot be asked)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return 0


#: ``data.eval_batch_size: null``: the evaluation batch size by the type of device the model runs on. On the CPU
#: (one thread) a whole LeNet-CIFAR evaluation runs 1.16x faster at 128 than at 512 and the McMahan CNN's forward
#: pass costs 1.39x less per image (``benchmarks/eval_batch.py``; the activations of a larger batch leave the
#: cache); a GPU keeps 512.
AUTO_EVAL_BATCH_SIZE: dict[str, int] = {"cpu": 128, "cuda": 512, "mps": 512}
_TEST_MODES = ("split", "global", "partition", "pooled")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class FederatedDataModule(lightning.LightningDataModule):
    """Federated split of a base dataset (see the module docstring).

    Your own data: subclass it and override :meth:`load_base_dataset` (nothing else), then select the subclass with
    ``data: {class_path: mypkg.MyDataModule, init_args: {num_clients: 20, partition: dirichlet}}``; every option
    below (partition, test mode, batch sizes, ...) applies to it as to a built-in dataset.

    Args:
        name: base dataset, one of :data:`~pl_fedsparse.data.datasets.DATASETS` (ignored by a subclass whose
            :meth:`load_base_dataset` does not call this class's).
        root: data folder (not needed for ``synthetic``); unset: the download folder ``~/.cache/pl_fedsparse/<name>``.
            For ``name="tensors"`` the ``.pt``/``.npz`` file itself.
        num_clients: number of clients ``K``; with ``partition="natural"`` the number of distinct client ids, or
            ``None`` to take it from the data.
        partition: partition scheme (see :mod:`pl_fedsparse.data.partition`), or ``"natural"``: the dataset's own
            per-sample client ids (module docstring).
        alpha: Dirichlet concentration for ``partition="dirichlet"`` and ``"fedem_dirichlet"``.
        quantity_skew: Dirichlet per-class split with unequal client sizes (DM-PFL) instead of DisPFL's.
        classes_per_client: classes per client for ``partition="pathological"``.
        shards_per_client: shards per client for ``partition="shards"``.
        noniid_ratio: FedPSE's λ for ``partition="noniid_ratio"``.
        noniid_order: how ``partition="noniid_ratio"`` orders its heterogeneous share
            (:func:`~pl_fedsparse.data.partition.noniid_ratio`): ``"sorted"`` (by label: at λ = 1 with ``K >= C``
            every client holds one label) or ``"halves"`` (the Flower code FedPSE follows, its App. C.1 and §5.1
            "Non-IID Setting": two shuffled label halves, about five
            of ten labels per client at λ = 1). Ignored by the other schemes.
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
        eval_batch_size: evaluation batch size; ``None`` (default) lets the loop choose it for throughput on its
            device (:data:`AUTO_EVAL_BATCH_SIZE`: 128 on the CPU, where larger batches cost up to 40 % more per
            image for the McMahan CNN — ``benchmarks/eval_batch.py``; 512 on a GPU). Logits depend on it only in their
            last bits (not at all on one CPU thread, as measured) — except where the evaluation depends on the batch
            (pFedGate's per-batch mask, a module whose eval forward mixes samples): then ``None`` is ``batch_size``
            on every device.
        augment: CIFAR augmentation (random crop + flip) on training batches.
        download: when no local copy is found, download the dataset with torchvision (needs network) into ``root``,
            or ``$PL_FEDSPARSE_CACHE/<name>`` (default ``~/.cache/pl_fedsparse/<name>``) when ``root`` is unset; a
            local copy always wins. ``false`` never downloads (a missing copy is a one-line error).
        device: where in-memory base tensors live: ``"auto"`` (default) where the fits run once the loop knows it
            (:meth:`place_data`: an accelerator, when they take at most :data:`AUTO_DATA_SHARE` of its free memory;
            the host otherwise); ``None`` or ``"cpu"`` the host; ``"cuda"`` the GPU, moved once. On the GPU, batches
            are then gathered (and augmented) there: no copy per batch. The numbers do not depend on it.
        cache_inputs: make the model inputs of the whole dataset once (normalised float32 images, zero-padded for
            the augmentation's crops; normalised features), where the data lives, so that every batch is one gather
            (:class:`~pl_fedsparse.data.loaders.PreparedInputs`) instead of a gather, a conversion, the
            normalisation and the augmentation's index arithmetic — on a GPU thirteen kernel launches fewer per step
            with augmentation, three without. ``"auto"`` (default): on an accelerator, when they take at most
            :data:`AUTO_DATA_SHARE` of its free memory (CIFAR-10 with augmentation: about 1.1 GB); ``true``: also on
            the host (4 bytes per input value: about 6 times a uint8 dataset padded); ``false``: never. The batches
            are the same values either way. Token ids and unnormalised float32 features have nothing to prepare.
        synthetic: overrides of the synthetic task's parameters.
        emnist_split: EMNIST split.
        seed: seed of the subsample, the partition and the per-client splits (``< 2**32`` in ``"pooled"`` mode and
            for ``fedem_dirichlet``, which use numpy's ``RandomState`` as FedEM does), and of the train/test split of
            a source without a test split.
        test_fraction: for ``image_folder`` (single ``root/<class>/`` folder) and ``tensors`` (``x``/``y`` file)
            sources without a test split: the share of each class (of each client, with client ids) held out as the
            base test split.
        image_size: ``image_folder`` and ``torchvision``: resize every image to ``size`` × ``size`` or
            ``[height, width]``; ``None`` requires images of one size.
        torchvision_class: for ``name="torchvision"``: a class of ``torchvision.datasets`` (``SVHN``, ``KMNIST``,
            ``QMNIST``, ``STL10``, ``USPS``, ...) or the dotted path of a class with torchvision's constructor.
        torchvision_args: extra constructor arguments of that class (e.g. ``{split: digits}`` for ``EMNIST``).
        cifar10c_root: a folder holding the published CIFAR-10-C arrays (``<corruption>.npy`` of shape
            ``(50000, 32, 32, 3)`` and ``labels.npy``; :class:`~pl_fedsparse.data.corruptions.CIFAR10C`): corruption
            views of all 15 corruptions are then read from it instead of generated (:attr:`available_corruptions`).
            It is checked at setup against the base test split (same size, same labels in the same order).

    Example:
        A subclass providing its own data (float features; ``partition: natural`` would use ``train_client``)::

            class MyData(FederatedDataModule):
                def load_base_dataset(self) -> BaseDataset:
                    x, y = torch.randn(1000, 20), torch.randint(0, 3, (1000,))
                    return BaseDataset("mine", x[:800], y[:800], x[800:], y[800:], num_classes=3)

        >>> class MyData(FederatedDataModule):
        ...     def load_base_dataset(self) -> BaseDataset:
        ...         x, y = torch.randn(100, 20, generator=torch.Generator().manual_seed(0)), torch.arange(100) % 3
        ...         return BaseDataset("mine", x[:80], y[:80], x[80:], y[80:], num_classes=3)
        >>> dm = MyData(num_clients=4, partition="iid")
        >>> dm.input_shape, dm.input_kind, dm.supports_corruptions, next(iter(dm.train_loader(0, seed=0)))[0].shape
        ((20,), 'features', False, torch.Size([15, 20]))
    """

    def __init__(self, name: str = "synthetic", root: str | None = None, num_clients: int | None = 10,
                 partition: Literal["iid", "dirichlet", "pathological", "shards", "noniid_ratio",
                                    "fedem_dirichlet", "natural"] = "dirichlet",
                 alpha: float = 0.3, quantity_skew: bool = False, classes_per_client: int = 2,
                 shards_per_client: int = 2, noniid_ratio: float = 1.0,
                 noniid_order: Literal["sorted", "halves"] = "sorted", min_samples: int = 1,
                 sample_fraction: float = 1.0,
                 test_mode: Literal["split", "global", "partition", "pooled"] = "split",
                 split_ratios: tuple[float, float, float] = (0.75, 0.0, 0.25),
                 test_per_client: int | None = None, max_train_samples: int | None = None,
                 batch_size: int = 64, eval_batch_size: int | None = None, augment: bool = False,
                 download: bool = True, device: str | None = "auto",
                 synthetic: dict | None = None, emnist_split: str = "balanced", seed: int = 0,
                 test_fraction: float = 0.2, image_size: int | tuple[int, int] | None = None,
                 torchvision_class: str | None = None, torchvision_args: dict | None = None,
                 cifar10c_root: str | None = None, cache_inputs: bool | Literal["auto"] = "auto") -> None:
        super().__init__()
        check(cache_inputs in ("auto", True, False) and (cache_inputs == "auto" or isinstance(cache_inputs, bool)),
              "data.cache_inputs", cache_inputs, "auto, true or false")
        self.cache_inputs = cache_inputs
        #: the bases' prepared inputs ("train", "test"; data.cache_inputs), made when a loader first needs them
        #: (``None``: not made yet; again after the data moves, and in an unpickled copy: where its data is)
        self._prepared: dict[str, PreparedInputs] | None = None
        check(name in DATASETS, "data.name", name, f"one of {', '.join(DATASETS)}")
        check(root is None or isinstance(root, str), "data.root", root, "a folder path or None")
        check((isinstance(num_clients, int) and not isinstance(num_clients, bool) and num_clients >= 1)
              or (num_clients is None and partition == NATURAL),
              "data.num_clients", num_clients, "an int >= 1 (or null with data.partition='natural')")
        check(partition in SCHEMES or partition == NATURAL, "data.partition", partition,
              f"one of {', '.join(SCHEMES)}, {NATURAL}")
        check(_is_num(alpha) and alpha > 0, "data.alpha", alpha, "a number > 0")
        check(_is_int(classes_per_client) and classes_per_client >= 1, "data.classes_per_client",
              classes_per_client, "an int >= 1")
        check(_is_int(shards_per_client) and shards_per_client >= 1, "data.shards_per_client", shards_per_client,
              "an int >= 1")
        check(_is_num(noniid_ratio) and 0 <= noniid_ratio <= 1, "data.noniid_ratio", noniid_ratio,
              "a number in [0, 1]")
        check(noniid_order in NONIID_ORDERS, "data.noniid_order", noniid_order, f"one of {', '.join(NONIID_ORDERS)}")
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
        check(eval_batch_size is None or (_is_int(eval_batch_size) and eval_batch_size >= 1), "data.eval_batch_size",
              eval_batch_size, "null (chosen for the device) or an int >= 1")
        for pname, flag in (("quantity_skew", quantity_skew), ("augment", augment), ("download", download)):
            check(isinstance(flag, bool), f"data.{pname}", flag, "true or false")
        check(emnist_split in EMNIST_SPLITS, "data.emnist_split", emnist_split, f"one of {', '.join(EMNIST_SPLITS)}")
        check(_is_int(seed) and seed >= 0, "data.seed", seed, "an int >= 0")
        check(seed < 2**32 or (test_mode != "pooled" and partition != "fedem_dirichlet"), "data.seed", seed,
              "an int in [0, 2**32 - 1] with test_mode 'pooled' or partition 'fedem_dirichlet' (numpy's RandomState)")
        check(_is_num(test_fraction) and 0 < test_fraction < 1, "data.test_fraction", test_fraction,
              "a number in (0, 1)")
        self.image_size = image_size_pair(image_size)
        check(image_size is None or name in ("image_folder", "torchvision") or self._custom_source,
              "data.image_size", image_size, "None unless data.name is 'image_folder' or 'torchvision'")
        if name == "torchvision" and not self._custom_source:
            resolve_torchvision_class(torchvision_class)
        else:
            check(torchvision_class is None, "data.torchvision_class", torchvision_class,
                  "None unless data.name='torchvision'")
        check(torchvision_args is None or (isinstance(torchvision_args, dict) and name == "torchvision"),
              "data.torchvision_args", torchvision_args, "None, or a dict of constructor arguments with "
              "data.name='torchvision'")
        check(cifar10c_root is None or (isinstance(cifar10c_root, str) and cifar10c_root != ""),
              "data.cifar10c_root", cifar10c_root, "null or the folder of the published CIFAR-10-C arrays")
        self.cifar10c_root = cifar10c_root
        self._cifar10c: CIFAR10C | None = None
        self._synthetic = synthetic_params(synthetic) if name == "synthetic" else None
        if device is not None and device != "auto":
            try:
                dev = torch.device(device)
            except (RuntimeError, TypeError):
                raise ConfigError(f"data.device={device!r} is invalid: expected auto, None, 'cpu' or 'cuda[:N]'"
                                  ) from None
            check(dev.type != "cuda" or torch.cuda.is_available(), "data.device", device,
                  "None or 'cpu' on this machine (CUDA is not available)")
        self.name, self.root, self._num_clients, self.partition = name, root, num_clients, partition
        self.alpha, self.quantity_skew, self.classes_per_client = float(alpha), quantity_skew, classes_per_client
        self.shards_per_client, self.noniid_ratio, self.min_samples = shards_per_client, float(noniid_ratio), \
            min_samples
        self.sample_fraction, self.noniid_order = float(sample_fraction), noniid_order
        self.test_mode, self.split_ratios, self.test_per_client = test_mode, tuple(float(r) for r in ratios), \
            test_per_client
        self.max_train_samples, self.batch_size, self.eval_batch_size = max_train_samples, batch_size, eval_batch_size
        self.augment, self.download, self.device = augment, download, device
        self.emnist_split, self.seed = emnist_split, seed
        self.test_fraction = float(test_fraction)
        self.torchvision_class = torchvision_class
        self.torchvision_args = None if torchvision_args is None else dict(torchvision_args)
        self._base: BaseDataset | None = None
        self._splits: dict[str, list[np.ndarray]] = {}

    # ------------------------------------------------------------------------------------------- the base dataset

    def load_base_dataset(self) -> BaseDataset:
        """Return the whole (centralised) dataset that the clients' data is drawn from.

        The one hook for your own data: override it in a subclass (and nothing else); :meth:`prepare_data` and
        :meth:`setup` call it and check what it returns (one-line :class:`~pl_fedsparse.errors.ConfigError` naming
        the class and the problem). It may be called more than once (memoise expensive work yourself, or use
        :func:`~pl_fedsparse.data.datasets.load_dataset`'s cache); it must return the same data each time, and only
        options that :meth:`fingerprint` covers may change it (extend :meth:`fingerprint` for your own options).

        The default loads the built-in source ``name`` (:func:`~pl_fedsparse.data.datasets.load_dataset`).

        Returns:
            A :class:`~pl_fedsparse.data.datasets.BaseDataset`: train and test inputs (``uint8 [N, C, H, W]`` images
            with per-channel ``mean``/``std``; float features of any shape; integer token ids; or, slower, map-style
            ``torch.utils.data.Dataset`` objects), ``int64`` labels in ``[0, num_classes)``, a non-empty test split,
            and for ``partition="natural"`` per-sample ``train_client`` (and ``test_client``) ids.

        Example:
            ::

                class MyData(FederatedDataModule):
                    def __init__(self, *, csv: str, **kwargs):
                        super().__init__(**kwargs)
                        self.csv = csv

                    def load_base_dataset(self) -> BaseDataset:
                        table = np.loadtxt(self.csv, delimiter=",", dtype=np.float32)
                        x, y = torch.from_numpy(table[:, :-1]), torch.from_numpy(table[:, -1]).long()
                        n = int(0.8 * len(y))
                        return BaseDataset("my-csv", x[:n], y[:n], x[n:], y[n:], num_classes=int(y.max()) + 1)
        """
        return load_dataset(str(self.name), self.root, self.download, synthetic=self._synthetic,
                            emnist_split=self.emnist_split, test_fraction=self.test_fraction, seed=self.seed,
                            image_size=self.image_size, torchvision_class=self.torchvision_class,
                            torchvision_args=self.torchvision_args)

    @property
    def _custom_source(self) -> bool:
        """Whether a subclass provides its own :meth:`load_base_dataset`."""
        return type(self).load_base_dataset is not FederatedDataModule.load_base_dataset

    def source_label(self) -> str:
        """How messages name the data: ``data=MyData`` for a subclass's own hook, else ``data.name='...'``."""
        return f"data={type(self).__name__}" if self._custom_source else f"data.name={self.name!r}"

    def _checked_base(self) -> BaseDataset:
        """:meth:`load_base_dataset`'s result, validated, and checked against the image-only options."""
        owner = (f"{type(self).__name__}.load_base_dataset()" if self._custom_source
                 else f"data.name={self.name!r}")
        if self._custom_source:  # the user's code: what it raises is one line naming it
            with user_code(self, "load_base_dataset", "setting up the data"):
                loaded = self.load_base_dataset()
        else:
            loaded = self.load_base_dataset()
        base = validate_base_dataset(loaded, owner)
        if self.augment and base.kind != "image":
            raise ConfigError(f"data.augment=True is invalid: expected false for {self.source_label()} "
                              f"({self._not_images(base)})")
        return base

    @staticmethod
    def _not_images(base: BaseDataset) -> str:
        what = "dataset items" if base.kind == "dataset" else f"{base.kind} inputs of shape {base.sample_shape}"
        return f"{what} are not images"

    def prepare_data(self) -> None:
        """Download (if enabled) / decode the base dataset once."""
        self._checked_base()

    # ------------------------------------------------------------------------------------------- setup

    def _natural_clients(self, base: BaseDataset, pooled: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Client index of every train (pooled: train then test) and test sample
        (:func:`~pl_fedsparse.data.natural.natural_clients`); sets ``num_clients`` when it is ``None`` and
        ``client_ids``, the data's own id of each client index (``summary.json``'s ``client_ids``)."""
        train_c, test_c, self._num_clients, self.client_ids = natural_clients(
            base, self._num_clients, self.test_mode, pooled, self.source_label())
        return train_c, test_c

    _groups = staticmethod(client_groups)

    def setup(self, stage: str | None = None) -> None:
        """Load the base dataset and build every client's index sets (idempotent)."""
        if self._base is not None:
            return
        base = self._checked_base()
        pooled = self.test_mode == "pooled"  # FedEM: ConcatDataset([train, test])
        train_y = np.concatenate([base.train_y.numpy(), base.test_y.numpy()]) if pooled else base.train_y.numpy()
        natural = self.partition == NATURAL
        client_of, test_client_of = self._natural_clients(base, pooled) if natural else (None, None)
        num_clients = self._num_clients  # known now (``None`` only before a natural partition has read its ids)
        assert num_clients is not None
        pool = np.arange(len(train_y))
        if self.max_train_samples is not None and self.max_train_samples < len(pool):
            rng = np.random.default_rng([self.seed, 1])
            pool = np.sort(rng.choice(len(pool), size=self.max_train_samples, replace=False))
        kw: dict[str, Any] = {p: getattr(self, p) for p in _SCHEME_PARAMS[self.partition]}
        if self.partition == "noniid_ratio":
            kw = {"ratio": self.noniid_ratio}
            if self.noniid_order != "sorted":  # the default is not passed: existing partitions keep their memo keys
                kw["order"] = self.noniid_order
        if natural:  # the data's own clients: only the client ids are read (as the schemes read only labels)
            assert client_of is not None
            raw = self._groups(client_of[pool], num_clients)
            empty = [k for k, r in enumerate(raw) if len(r) == 0]
            if empty:
                raise ConfigError(f"data.max_train_samples={self.max_train_samples} is invalid: natural client "
                                  f"{empty[0]} has no training samples left; expected None or a larger number")
        elif pooled and self.partition == "fedem_dirichlet":  # FedEM's order, for its per-client split
            raw = fedem_dirichlet(train_y[pool], num_clients, self.alpha, self.seed, self.sample_fraction,
                                  ordered=True)
        else:
            raw = partition(train_y[pool], self.partition, num_clients, self.seed, **kw)
        parts = [pool[p] for p in raw]
        r_train, r_val, r_test = self.split_ratios
        splits: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
        for k, idx in enumerate(parts):
            if pooled:
                own = fedem_client_split(idx, (r_train, r_val, r_test), self.seed)
                for name, arr in zip(("train", "val", "test"), own):
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
        if self.test_mode == "partition" and natural:  # client k is tested on its own test samples
            assert test_client_of is not None
            splits["test"] = self._groups(test_client_of, num_clients)
        elif self.test_mode == "partition":  # the base test split, partitioned like the training data (FedPSE C.1)
            test_y = base.test_y.numpy()
            splits["test"] = [np.sort(p) for p in partition(test_y, self.partition, num_clients, self.seed + 1,
                                                            **kw)]
        if self.test_mode == "global":
            splits["test"] = client_test_from_global(base.test_y.numpy(), [train_y[p] for p in parts],
                                                     base.num_classes, self.test_per_client, self.seed)
        for arrays in splits.values():
            for a in arrays:
                a.setflags(write=False)
        self._splits = splits
        train_x, train_t = base.train_x, base.train_y
        in_memory = isinstance(base.train_x, torch.Tensor)
        if pooled:  # one copy of the inputs, train then test (the indices above index it)
            train_x = (torch.cat([base.train_x, base.test_x]) if in_memory
                       else torch.utils.data.ConcatDataset([base.train_x, base.test_x]))
            train_t = torch.cat([base.train_y, base.test_y])
        self._train_x, self._train_y, self._test_x, self._test_y = train_x, train_t, base.test_x, base.test_y
        if self.device not in (None, "auto") and in_memory:  # GPU-resident base tensors, moved once
            self._train_x, self._train_y, self._test_x, self._test_y = (
                t.to(self.device) for t in (train_x, train_t, base.test_x, base.test_y))
        self._train_y_np, self._test_y_np = train_y, base.test_y.numpy()
        self._cifar10c = self._open_cifar10c(base)
        self._base = base
        self._prepared = None

    def place_data(self, device: torch.device | str) -> bool:
        """With ``data.device: auto``: move the in-memory base tensors to ``device`` — where the loop's fits run;
        it calls this once after :meth:`setup` — when it is an accelerator and they take at most
        :data:`AUTO_DATA_SHARE` of its free memory. Returns whether they moved (never for another ``data.device``,
        a dataset read from files, or a second call). The inputs are then prepared where the data is, as
        ``data.cache_inputs`` says.

        Example:
            >>> dm = FederatedDataModule(name="synthetic", num_clients=2)
            >>> dm.setup()
            >>> dm.place_data("cpu"), dm.data_device.type
            (False, 'cpu')
        """
        moved = self._move_data(torch.device(device))
        if getattr(self, "_prepared", None) is None and isinstance(getattr(self, "_train_x", None), torch.Tensor):
            self._prepare_inputs()  # (data.cache_inputs: before the first fit, where the data now is)
        return moved

    def _move_data(self, dev: torch.device) -> bool:
        """:meth:`place_data`'s move: whether the base tensors moved to ``dev``."""
        tensors: tuple[Any, ...] = tuple(getattr(self, n, None) for n in ("_train_x", "_train_y", "_test_x", "_test_y"))
        if self.device != "auto" or dev.type in ("cpu", "meta") or not all(isinstance(t, torch.Tensor)
                                                                            for t in tensors):
            return False
        if any(t.device.type != "cpu" for t in tensors):  # (placed already)
            return False
        need = sum(t.numel() * t.element_size() for t in tensors)
        if need > AUTO_DATA_SHARE * _free_memory(dev):
            log.info("data.device auto: the dataset (%.0f MiB) stays on the host (more than %.0f %% of %s's free "
                     "memory)", need / 2**20, 100 * AUTO_DATA_SHARE, dev)
            return False
        self._train_x, self._train_y, self._test_x, self._test_y = (t.to(dev) for t in tensors)
        self._prepared = None
        return True

    def __getstate__(self) -> dict[str, Any]:
        # (the prepared inputs are made again where the copy is used, not carried: up to 6 times the dataset)
        return {**vars(self), "_prepared": None}

    def _prepare_inputs(self) -> dict[str, PreparedInputs]:
        """The bases' :class:`~pl_fedsparse.data.loaders.PreparedInputs` where the data is, as
        ``data.cache_inputs`` says (made again when the data moves: :meth:`place_data`)."""
        self._prepared = {}
        x = getattr(self, "_train_x", None)
        if self.cache_inputs is False or not isinstance(x, torch.Tensor):
            return self._prepared
        if self.cache_inputs == "auto" and x.device.type in ("cpu", "meta"):
            return self._prepared
        base = self.base
        kind = base.kind
        if kind == "tokens" or (kind == "features" and (base.mean is None or base.std is None)
                                and x.dtype == torch.float32):
            return self._prepared  # (a batch is one gather already)
        bases = {"train": (x, AUGMENT_PAD if self.augment else 0)}
        if self.test_mode in ("global", "partition"):
            bases["test"] = (self._test_x, 0)
        need = 0
        for t, pad in bases.values():
            inner = math.prod(t.shape[1:-2]) * (t.shape[-2] + 2 * pad) * (t.shape[-1] + 2 * pad) if pad else \
                math.prod(t.shape[1:])
            need += len(t) * inner * 4
        if self.cache_inputs == "auto" and need > AUTO_DATA_SHARE * _free_memory(x.device):
            log.info("data.cache_inputs auto: the prepared inputs (%.0f MiB) are not made (more than %.0f %% of "
                     "%s's free memory)", need / 2**20, 100 * AUTO_DATA_SHARE, x.device)
            return self._prepared
        self._prepared = {name: prepare_inputs(t, base.mean, base.std, pad=pad) for name, (t, pad) in bases.items()}
        return self._prepared

    def _prepared_for(self, images: Any) -> PreparedInputs | None:
        """The prepared inputs of a base tensor (``None`` for any other tensor: a shifted or corrupted view)."""
        prepared = getattr(self, "_prepared", None)
        prepared = self._prepare_inputs() if prepared is None else prepared
        if images is self._train_x:
            return prepared.get("train")
        if images is self._test_x:
            return prepared.get("test")
        return None

    @property
    def data_device(self) -> torch.device:
        """Where the in-memory base tensors are (the host for a dataset read from files; before :meth:`setup`,
        where ``data.device`` puts them)."""
        x = getattr(self, "_train_x", None)
        if isinstance(x, torch.Tensor):
            return x.device
        return torch.device(self.device) if self.device not in (None, "auto") else torch.device("cpu")

    # ------------------------------------------------------------------------------------------- properties

    @property
    def base(self) -> BaseDataset:
        """The base dataset (loads it on first use)."""
        self.setup()
        assert self._base is not None
        return self._base

    @property
    def num_clients(self) -> int:
        """Number of clients (with ``partition="natural"`` and ``num_clients=None``, read from the data)."""
        if self._num_clients is None:
            self.setup()
        assert self._num_clients is not None
        return self._num_clients

    @property
    def num_classes(self) -> int:
        """Number of classes of the base dataset."""
        return self.base.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one input: ``(C, H, W)`` of an image, ``(20,)`` of a tabular row, ``(80,)`` of a sequence."""
        return self.base.sample_shape

    @property
    def input_kind(self) -> InputKind:
        """``"image"``, ``"features"``, ``"tokens"`` or ``"dataset"`` (:func:`~pl_fedsparse.data.datasets.input_kind`).
        """
        kind = self.base.kind
        assert kind is not None
        return kind

    @property
    def supports_corruptions(self) -> bool:
        """Whether image corruptions (``eval_loader(corruption=...)``) and augmentation apply: ``uint8`` images only.
        Shift evaluation (``eval_loader(shift=...)``) works for every kind of input."""
        return self.input_kind == "image"

    # ------------------------------------------------------------------------------------------- per-client API

    def _check_client(self, client_idx: int, split: str, allowed: tuple[str, ...] = ("train", "val", "test")) -> None:
        self.setup()
        check(_is_int(client_idx) and 0 <= client_idx < self.num_clients, "client_idx", client_idx,
              f"an int in [0, {self.num_clients})")
        check(split in allowed, "split", split, " or ".join(repr(s) for s in allowed))

    def client_indices(self, client_idx: int, split: Literal["train", "val", "test"] = "train") -> np.ndarray:
        """Read-only indices of a client's split into the base train arrays (the base *test* arrays for the test
        split when ``test_mode`` is ``"global"`` or ``"partition"``; the pooled train-then-test arrays for every split
        when it is ``"pooled"``)."""
        self._check_client(client_idx, split)
        return self._splits[split][client_idx]

    def _source(self, split: str) -> tuple[Any, torch.Tensor, np.ndarray]:
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

    def train_loader(self, client_idx: int, seed: int) -> TensorBatchLoader | torch.utils.data.DataLoader:
        """Shuffled (and, if configured, augmented) training batches of one client, reproducible from ``seed``.

        In-memory inputs give a :class:`~pl_fedsparse.data.loaders.TensorBatchLoader`; a base dataset of
        ``torch.utils.data.Dataset`` objects gives a (slower) ``torch.utils.data.DataLoader`` with a generator seeded
        from ``seed``.
        """
        idx = self.client_indices(client_idx, "train")
        if not isinstance(self._train_x, torch.Tensor):
            return dataset_loader([(self._train_x, self._train_y, idx)], self.batch_size, shuffle=True, seed=seed)
        return TensorBatchLoader(self._train_x, self._train_y, self.batch_size, shuffle=True, generator_seed=seed,
                                 mean=self.base.mean, std=self.base.std, augment=self.augment, indices=idx,
                                 prepared=self._prepared_for(self._train_x))

    def eval_loader(self, client_idx: int, split: Literal["train", "val", "test"] = "test", shift: float = 0.0,
                    seed: int = 0, corruption: str | None = None, severity: int = 0,
                    batch_size: int | None = None) -> TensorBatchLoader | torch.utils.data.DataLoader:
        """Unshuffled, unaugmented evaluation batches of a client's train/val/test split, ``batch_size`` each
        (default :meth:`eval_batch`; the loop's evaluator passes its own choice).

        With ``shift > 0`` a fraction ``shift`` of the samples is replaced by samples drawn uniformly from the base
        test split (DM-PFL, :mod:`pl_fedsparse.data.shift`), seeded by ``(seed, client_idx)``; this works for every
        kind of input. With ``corruption`` every image is corrupted at ``severity`` (1-5;
        :mod:`pl_fedsparse.data.corruptions`), seeded by ``(seed, client_idx, corruption, severity)``; images only
        (:attr:`supports_corruptions`), anything else is refused in one line. With ``data.cifar10c_root`` the
        published CIFAR-10-C images are read instead (:meth:`_cifar10c_loader`; every name of
        :attr:`available_corruptions`).
        """
        self._check_client(client_idx, split)
        check(_is_num(shift) and 0 <= shift <= 1, "shift", shift, "a number in [0, 1]")
        check(batch_size is None or (_is_int(batch_size) and batch_size >= 1), "batch_size", batch_size,
              "null or an int >= 1")
        batch = self.eval_batch() if batch_size is None else int(batch_size)
        if corruption is not None and not self.supports_corruptions:
            raise ConfigError(f"corruption={corruption!r} is invalid: expected None for {self.source_label()} "
                              f"({self._not_images(self.base)})")
        own = self.client_indices(client_idx, split)
        images, labels, _ = self._source(split)
        if corruption is not None and self._cifar10c is not None and corruption in self._cifar10c.names:
            return self._cifar10c_loader(client_idx, split, own, shift, seed, corruption, severity, batch)
        if not isinstance(images, torch.Tensor):
            return self._dataset_eval_loader(client_idx, own, images, labels, shift, seed, batch)
        idx: np.ndarray | None = own
        mean, std = self.base.mean, self.base.std
        if shift > 0:
            shift_seed = int(np.random.SeedSequence([seed, client_idx]).generate_state(1)[0])
            if images is self._test_x:  # client and pool index the same array
                idx = shifted_test_indices(own, len(self._test_y), shift, shift_seed)
            else:
                kept, drawn = shifted_test_split(own, len(self._test_y), shift, shift_seed)
                images = torch.cat([images[transfer.host_tensor(kept, images.device)],
                                    self._test_x[transfer.host_tensor(drawn, images.device)]])
                labels = torch.cat([labels[transfer.host_tensor(kept, labels.device)],
                                    self._test_y[transfer.host_tensor(drawn, labels.device)]])
                idx = None
        if corruption is not None:
            if idx is not None:
                rows = transfer.host_tensor(np.array(idx, dtype=np.int64, copy=True), images.device)
                images, labels, idx = images[rows], labels[rows], None
            check(corruption in CORRUPTIONS, "corruption", corruption, "one of " + ", ".join(CORRUPTIONS)
                  + " (generated); the other CIFAR-10-C corruptions need the published arrays (data.cifar10c_root)")
            gen = torch.Generator().manual_seed(int(np.random.SeedSequence(
                [seed, client_idx, 101, CORRUPTIONS.index(corruption) + 1, int(severity)]).generate_state(1)[0]))
            images = corrupt(images.cpu(), corruption, severity, gen).to(labels.device)
        return TensorBatchLoader(images, labels, batch, shuffle=False, generator_seed=seed, mean=mean,
                                 std=std, augment=False, indices=idx, prepared=self._prepared_for(images))

    @property
    def available_corruptions(self) -> tuple[str, ...]:
        """The corruptions :meth:`eval_loader` can give: the generator's
        (:data:`~pl_fedsparse.data.corruptions.CORRUPTIONS`) or, with ``data.cifar10c_root``, the published 15 in Hendrycks & Dietterich's order, then the generator's
        others."""
        self.setup()
        if self._cifar10c is None:
            return CORRUPTIONS
        return tuple(c for c in CORRUPTION_NAMES if c in self._cifar10c.names or c in CORRUPTIONS)

    def _open_cifar10c(self, base: BaseDataset) -> CIFAR10C | None:
        """The reader of ``data.cifar10c_root``, checked against ``base``'s test split (``None`` when unset)."""
        if self.cifar10c_root is None:
            return None
        if base.kind != "image":
            raise ConfigError(f"data.cifar10c_root={self.cifar10c_root!r} is invalid: expected null for "
                              f"{self.source_label()} ({self._not_images(base)})")
        return CIFAR10C(self.cifar10c_root, base.test_y.numpy(), base.sample_shape)

    def _cifar10c_loader(self, client_idx: int, split: str, own: np.ndarray, shift: float, seed: int,
                         corruption: str, severity: int, batch: int) -> TensorBatchLoader:
        """:meth:`eval_loader`'s corruption view read from the published arrays: the rows a generated view has (the
        client's samples; with ``shift``, the same draws from the base test split), each read at its base test index
        and ``severity``. A row that is not a base test image (a base train image: ``test_mode`` ``"split"``, or the
        train part of ``"pooled"``) is stood in for by a test image of the same label
        (:func:`~pl_fedsparse.data.shift.label_matched_rows`, seeded by ``(seed, client_idx)``: the same images for
        every corruption and severity)."""
        assert self._cifar10c is not None
        check(_is_int(severity) and 1 <= severity <= 5, "severity", severity, "an int in 1..5")
        images, _, _ = self._source(split)
        n_test = len(self._test_y)
        shift_seed = int(np.random.SeedSequence([seed, client_idx]).generate_state(1)[0])
        if images is self._test_x:  # the client's rows index the base test split
            rows = shifted_test_indices(own, n_test, shift, shift_seed) if shift > 0 else np.asarray(own)
        else:
            kept, drawn = (shifted_test_split(own, n_test, shift, shift_seed) if shift > 0
                           else (np.asarray(own), np.empty(0, np.int64)))
            n_train = len(self._train_y) - (n_test if self.test_mode == "pooled" else 0)  # pooled: train, then test
            stand_in = label_matched_rows(self._train_y_np[own], self._test_y_np,
                                          int(np.random.SeedSequence([seed, client_idx, 102]).generate_state(1)[0]))
            order = np.argsort(own, kind="stable")
            at = order[np.searchsorted(np.asarray(own)[order], kept)]  # each kept row's position in ``own``
            rows = np.concatenate([np.where(kept >= n_train, kept - n_train, stand_in[at]), drawn])
        rows = np.array(rows, dtype=np.int64, copy=True)  # the client's index arrays are read-only
        labels = self._test_y[transfer.host_tensor(rows, self._test_y.device)]
        images = self._cifar10c.images(corruption, int(severity), rows).to(labels.device)
        return TensorBatchLoader(images, labels, batch, shuffle=False, generator_seed=seed, mean=self.base.mean,
                                 std=self.base.std, augment=False, indices=None)

    def eval_batch(self, device: str | torch.device | None = None) -> int:
        """The evaluation batch size: ``data.eval_batch_size``, or when it is ``None`` the throughput choice for
        ``device`` (default: where the data lives) from :data:`AUTO_EVAL_BATCH_SIZE`. The loop's evaluator
        (:meth:`pl_fedsparse.evaluation.Evaluator.batch_size`) asks it for the device its model runs on — or, where
        the evaluation depends on the batch, uses ``data.batch_size`` on every device.

        Example:
            >>> FederatedDataModule(eval_batch_size=None).eval_batch("cpu"), FederatedDataModule().eval_batch("cuda")
            (128, 512)
            >>> FederatedDataModule(eval_batch_size=64).eval_batch("cuda")
            64
        """
        if self.eval_batch_size is not None:
            return int(self.eval_batch_size)
        where = device if device is not None else self.data_device
        kind = torch.device(where).type
        return AUTO_EVAL_BATCH_SIZE.get(kind, AUTO_EVAL_BATCH_SIZE["cpu"])

    def _dataset_eval_loader(self, client_idx: int, idx: np.ndarray, data: Any, labels: torch.Tensor, shift: float,
                             seed: int, batch_size: int) -> torch.utils.data.DataLoader:
        """:meth:`eval_loader` for a base dataset of ``Dataset`` objects (the same shift draws as in memory)."""
        parts = [(data, labels, idx)]
        if shift > 0:
            shift_seed = int(np.random.SeedSequence([seed, client_idx]).generate_state(1)[0])
            if data is self._test_x:
                parts = [(data, labels, shifted_test_indices(idx, len(self._test_y), shift, shift_seed))]
            else:
                kept, drawn = shifted_test_split(idx, len(self._test_y), shift, shift_seed)
                parts = [(data, labels, kept), (self._test_x, self._test_y, drawn)]
        return dataset_loader(parts, batch_size, shuffle=False, seed=seed)

    def example_input(self, batch_size: int = 2) -> torch.Tensor:
        """The first ``batch_size`` base train inputs as the loaders yield them (normalised float images, float32
        features or int64 token ids), on the CPU."""
        check(_is_int(batch_size) and batch_size >= 1, "batch_size", batch_size, "an int >= 1")
        base = self.base
        if not isinstance(base.train_x, torch.Tensor):
            n = min(batch_size, len(base.train_y))
            return torch.utils.data.default_collate([item_input(base.train_x[i]) for i in range(n)])
        return normalize(base.train_x[:batch_size], base.mean, base.std)

    def fingerprint(self) -> dict[str, Any]:
        """JSON-able description of everything that determines the clients' data (not paths, devices, batch sizes).

        Only the options of the chosen partition scheme and data source are included, so e.g. ``alpha`` does not
        matter for ``partition="iid"`` (and existing configurations keep their fingerprints). A subclass with its
        own :meth:`load_base_dataset` is recorded by its class path; one with options of its own that change the
        data must add them (``fp = super().fingerprint(); fp["my_option"] = self.my_option; return fp``).
        """
        fp: dict[str, Any] = {"version": _FINGERPRINT_VERSION, "name": self.name, "num_clients": self._num_clients,
                              "partition": self.partition, "test_mode": self.test_mode,
                              "split_ratios": list(self.split_ratios), "max_train_samples": self.max_train_samples,
                              "seed": self.seed}
        fp.update({p: getattr(self, p) for p in _SCHEME_PARAMS[self.partition]})
        if self.partition == "noniid_ratio" and self.noniid_order != "sorted":  # the default keeps old fingerprints
            fp["noniid_order"] = self.noniid_order
        if self.test_mode == "global":
            fp["test_per_client"] = self.test_per_client
        if self.name == "synthetic":
            fp["synthetic"] = dict(sorted(self._synthetic.items()))  # type: ignore[union-attr]
        if self.name == "emnist":
            fp["emnist_split"] = self.emnist_split
        if self.name in ("image_folder", "tensors"):  # their train/test split when the source has none
            fp["test_fraction"] = self.test_fraction
        if self.name in ("image_folder", "torchvision") and self.image_size is not None:
            fp["image_size"] = list(self.image_size)
        if self.name == "torchvision":
            fp["torchvision_class"] = self.torchvision_class
            fp["torchvision_args"] = json.loads(json.dumps(self.torchvision_args or {}, sort_keys=True, default=repr))
        if self._custom_source:
            fp["source"] = f"{type(self).__module__}.{type(self).__qualname__}"
        return fp

    def __repr__(self) -> str:
        return f"FederatedDataModule({', '.join(f'{k}={v!r}' for k, v in self.fingerprint().items())})"
