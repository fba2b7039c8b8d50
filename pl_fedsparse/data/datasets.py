"""Base (centralised) datasets held in memory.

:func:`load_dataset` returns a :class:`BaseDataset` holding the whole train and test splits as tensors and ``int64
[N]`` labels; partitioning into clients (:mod:`pl_fedsparse.data.partition`) and batching
(:mod:`pl_fedsparse.data.loaders`) work on indices into these tensors, so no sample is ever copied per client.
Inputs come in three kinds (:func:`input_kind`), all batched by the same fast in-memory loader:

* ``"image"`` — ``uint8 [N, C, H, W]`` images, normalised per channel by the dataset's ``mean``/``std``; the only
  kind that augmentation and corruptions apply to.
* ``"features"`` — float tensors of any shape (``[N, 20]`` tabular rows, ``[N, 784]`` FEMNIST pixels, ...), passed
  through as float32 (normalised only when the dataset gives ``mean``/``std``).
* ``"tokens"`` — integer token ids of any shape (``[N, 80]`` Shakespeare characters, ...), passed through as int64.

A fourth kind, ``"dataset"``, holds map-style ``torch.utils.data.Dataset`` objects for data that does not fit in
memory (see :class:`BaseDataset`); it is batched by a ``torch.utils.data.DataLoader`` and is slower.

Sources (``data.name``), in order of preference for the fixed ones:

* ``synthetic`` — a Gaussian-mixture image task generated from its parameters (no files; the quickstart default).
* ``cifar10`` / ``cifar100`` — torchvision's pickled layout under ``root`` (``cifar-10-batches-py`` /
  ``cifar-100-python``), else an ImageFolder copy (``root/train/<class>/*.jpg`` and ``root/test/<class>/*.jpg``,
  possibly one folder further down, as the ``cifar10-jpg.tar.gz`` copy extracts), else torchvision's download.
* ``mnist`` / ``fashion_mnist`` / ``emnist`` — the original IDX files (plain or ``.gz``) directly in ``root`` or in
  torchvision's ``root/<Class>/raw`` layout (for Fashion-MNIST, Debian's ``dataset-fashion-mnist`` package in
  ``/usr/share/datasets/fashion-mnist`` when ``root`` is unset), else torchvision's download.
* ``image_folder``, ``tensors``, ``torchvision``, ``leaf`` — your own data (:mod:`pl_fedsparse.data.sources`): an
  image folder with any number of classes, a ``.pt``/``.npz`` file of tensors (any input shape, optional per-sample
  client ids), any torchvision dataset class by name, or LEAF's per-user JSON files (one natural client per user).

Downloads (``download=True``, the default of ``data.download``): a local copy always wins; only when none is found
does torchvision download the dataset, into ``root`` when it is given, else into :func:`download_dir`
(``$PL_FEDSPARSE_CACHE/<name>``, default ``~/.cache/pl_fedsparse/<name>``), where the next run finds it. Without
network the download fails with the same one-line :class:`~pl_fedsparse.errors.DataNotFoundError` as a missing copy
with ``download=False``, saying where to put one.

Decoded image folders, IDX files, torchvision datasets and LEAF JSON files are cached (``torch.save``) under
``$PL_FEDSPARSE_CACHE`` (default ``~/.cache/pl_fedsparse``), keyed by dataset name, absolute folder and every source
file's size and mtime: the second run loads in well under a second. An in-process memo makes repeated calls with the
same arguments free.
"""

from __future__ import annotations

import os

# the names this module held before the sources moved into pl_fedsparse.data.sources (public: kept importable here)
from pl_fedsparse.data.base import BaseDataset, InputKind, channel_stats, input_kind  # noqa: E402,F401
from pl_fedsparse.data.cache import CACHE_ENV, cache_dir, download_dir  # noqa: E402,F401
from pl_fedsparse.data.decode import read_idx  # noqa: E402,F401
from pl_fedsparse.data.sources.cifar import _load_cifar
from pl_fedsparse.data.sources.idx import EMNIST_SPLITS, _load_idx_dataset
from pl_fedsparse.data.sources.synthetic import (
    SYNTHETIC_DEFAULTS,  # noqa: E402,F401
    make_synthetic,
    synthetic_params,
)
from pl_fedsparse.errors import check

__all__ = ["DATASETS", "clear_memo", "load_dataset"]


DATASETS: tuple[str, ...] = ("synthetic", "cifar10", "cifar100", "mnist", "fashion_mnist", "emnist", "image_folder",
                             "tensors", "torchvision", "leaf")


_MEMO: dict[tuple, BaseDataset] = {}

#: the sources of :mod:`pl_fedsparse.data.sources` (your own data)
SOURCES: tuple[str, ...] = ("image_folder", "tensors", "torchvision", "leaf")


def clear_memo() -> None:
    """Forget the in-process memo of :func:`load_dataset` (the on-disk cache is kept)."""
    _MEMO.clear()


def load_dataset(name: str, root: str | None = None, download: bool = True, *, synthetic: dict | None = None,
                 emnist_split: str = "balanced", test_fraction: float = 0.2, seed: int = 0,
                 image_size: int | tuple[int, int] | None = None, torchvision_class: str | None = None,
                 torchvision_args: dict | None = None) -> BaseDataset:
    """Load a base dataset into memory (memoised per process, cached on disk after decoding).

    Args:
        name: one of :data:`DATASETS`.
        root: data folder (ignored for ``synthetic``); see the module docstring for the accepted layouts. Unset:
            :func:`download_dir` (and, for Fashion-MNIST, Debian's system copy first).
        download: when no local copy is found, download the dataset with torchvision (needs network) into ``root``,
            or :func:`download_dir` when ``root`` is unset; ``False`` never downloads.
        synthetic: overrides of :data:`SYNTHETIC_DEFAULTS` for ``name="synthetic"``.
        emnist_split: the EMNIST split (one of :data:`EMNIST_SPLITS`), for ``name="emnist"``.
        test_fraction: share of each class (of each client, with client ids) held out as the test split when an
            ``image_folder`` or ``tensors`` source has no test split of its own.
        seed: seed of that train/test split.
        image_size: resize every image to ``size`` × ``size`` (or ``(height, width)``) for ``image_folder`` and
            ``torchvision``; ``None`` requires images of one size.
        torchvision_class: for ``name="torchvision"``, a class of ``torchvision.datasets`` (``"SVHN"``) or the dotted
            path of a class with the same constructor (``"mypkg.MyDataset"``).
        torchvision_args: extra keyword arguments of that class's constructor.

    Returns:
        The dataset; the same object for repeated calls with equal arguments (do not modify its tensors).

    Raises:
        ConfigError: unknown name/split, bad synthetic parameters or corrupted files.
        DataNotFoundError: no local copy, and ``download`` is off or the download failed (no network); the
            message says how to get the data.
    """
    check(name in DATASETS, "data.name", name, f"one of {', '.join(DATASETS)}")
    check(emnist_split in EMNIST_SPLITS, "data.emnist_split", emnist_split, f"one of {', '.join(EMNIST_SPLITS)}")
    check(root is None or isinstance(root, (str, os.PathLike)), "data.root", root, "a folder path or None")
    if name == "synthetic":
        params = synthetic_params(synthetic)
        key: tuple = (name, tuple(sorted(params.items())))
    else:
        abs_root = None if root is None else os.path.abspath(os.path.expanduser(os.fspath(root)))
        key = (name, abs_root, bool(download), emnist_split if name == "emnist" else None)
        if name in SOURCES:
            from pl_fedsparse.data.sources.registry import source_key

            key += source_key(name, abs_root, test_fraction=test_fraction, seed=seed, image_size=image_size,
                              torchvision_class=torchvision_class, torchvision_args=torchvision_args)
    if key in _MEMO:
        return _MEMO[key]
    if name == "synthetic":
        dataset = make_synthetic(**params)
    elif name in ("cifar10", "cifar100"):
        dataset = _load_cifar(name, key[1], bool(download))
    elif name in SOURCES:
        from pl_fedsparse.data.sources.registry import load_source

        dataset = load_source(name, key[1], bool(download), test_fraction=test_fraction, seed=seed,
                              image_size=image_size, torchvision_class=torchvision_class,
                              torchvision_args=torchvision_args)
    else:
        dataset = _load_idx_dataset(name, key[1], bool(download), emnist_split)
    _MEMO[key] = dataset
    return dataset
