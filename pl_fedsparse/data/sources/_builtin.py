"""What the built-in datasets share: their names and channel statistics, a local copy in torchvision's layout or an
image folder, torchvision's download, and the one line that says where to put a copy when neither is there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pl_fedsparse.data.base import BaseDataset, channel_stats
from pl_fedsparse.data.cache import _cached
from pl_fedsparse.data.decode import _IMAGE_SUFFIXES, _decode_files, _list_images
from pl_fedsparse.errors import DataNotFoundError, check

__all__ = ["FASHION_MNIST_SYSTEM_DIR"]


FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"


# Per-channel mean / std in [0, 1] units (of the original files; the JPEG copy of CIFAR-10 differs by < 0.003).
# EMNIST (split-dependent) and synthetic statistics are computed from the training images instead.
_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)), "fashion_mnist": ((0.2860,), (0.3530,))}


_PRETTY = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "mnist": "MNIST", "fashion_mnist": "Fashion-MNIST",
           "emnist": "EMNIST"}


_TV_IDX_FOLDER = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "emnist": "EMNIST"}


def _to_dataset(name: str, blob: dict[str, torch.Tensor], num_classes: int) -> BaseDataset:
    mean, std = _STATS[name] if name in _STATS else channel_stats(blob["train_x"])
    train_y, test_y = blob["train_y"].long(), blob["test_y"].long()
    return BaseDataset(name, blob["train_x"], train_y, blob["test_x"], test_y, num_classes, mean, std)


def _load_image_folder(name: str, folder: Path, expected_classes: int | None, root: str,
                       size: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """Decode (or load from the cache) ``folder/train/<class>/*`` and ``folder/test/<class>/*``; the sorted class
    names are the labels. ``expected_classes=None`` accepts any number of classes."""
    classes = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
    test_classes = sorted(p.name for p in (folder / "test").iterdir() if p.is_dir())
    check(classes == test_classes, "data.root", root,
          f"the same class folders in train/ and test/ (got {len(classes)} and {len(test_classes)})")
    check(expected_classes is None or len(classes) == expected_classes, "data.root", root,
          f"{expected_classes} class folders in {folder / 'train'} for {_PRETTY.get(name, name)} "
          f"(found {len(classes)})")
    train_files, train_labels = _list_images(folder / "train", classes)
    test_files, test_labels = _list_images(folder / "test", classes)
    check(len(train_files) > 0 and len(test_files) > 0, "data.root", root,
          f"image files ({', '.join(_IMAGE_SUFFIXES)}) under {folder}/train/<class>/ and test/<class>/")

    def build() -> dict[str, torch.Tensor]:
        return {"train_x": _decode_files(train_files, root, size), "train_y": torch.tensor(train_labels),
                "test_x": _decode_files(test_files, root, size), "test_y": torch.tensor(test_labels)}

    extra = "|".join(classes) + ("" if size is None else f"|size={size[0]}x{size[1]}")
    return _cached(name, str(folder), train_files + test_files, build, extra=extra)


def _missing(name: str, root: str | None, download: bool, why: str = "", split: str = "balanced",
             target: str | None = None, local: str | None = None) -> DataNotFoundError:
    """The one-line "dataset not found" error, saying how to get the data.

    Args:
        name, root, split: the dataset asked for.
        download: the user's ``data.download``.
        why: what went wrong, when something was tried.
        target: the folder a download into failed (``None``: no download was tried).
        local: the unreadable local copy that was found instead (``None``: none).
    """
    where = root if root is not None else "DIR"
    if name in ("cifar10", "cifar100"):
        tar = "cifar10-jpg.tar.gz" if name == "cifar10" else "<a CIFAR-100 ImageFolder tarball>"
        folder = "cifar-10-batches-py" if name == "cifar10" else "cifar-100-python"
        copy = (f"extract a copy: tar -xzf {tar} -C {where} (ImageFolder layout train/<class>/*.jpg and "
                f"test/<class>/*.jpg, or torchvision's {folder}/) and pass --data.root {where}")
    else:
        files = f"{_idx_names(name, split)['train_x']}[.gz] and the 3 other"
        apt = (f"run `apt-get install -y dataset-fashion-mnist` (IDX files in {FASHION_MNIST_SYSTEM_DIR}, used when "
               f"data.root is unset) or " if name == "fashion_mnist" else "")
        copy = f"{apt}put the IDX files ({files}) in {where} or {where}/{_TV_IDX_FOLDER[name]}/raw"
    if target is not None:
        what, first = f"no {_PRETTY[name]} ({why})", f"the download into {target} failed (it needs network)"
    elif local is not None:
        what = f"no readable {_PRETTY[name]} ({why})"
        first = f"delete {local} to download it again" if download else "pass --data.download true (needs network)"
    else:
        what, first = f"no {_PRETTY[name]}", "pass --data.download true (needs network)"
    return DataNotFoundError(f"data.root={root!r} has {what}: {first} or {copy}")


def _from_torchvision(name: str, tv_cls: Any, folder: str, num_classes: int, *, root: str | None, fetch: bool,
                      download: bool, **kwargs: Any) -> BaseDataset:
    """Read both splits with a torchvision dataset class from ``folder`` (downloading them first when ``fetch``) and
    take its ``data``/``targets``; ``root`` and ``download`` (the user's settings) are for the error message."""
    try:
        splits = [tv_cls(folder, train=train, download=fetch, **kwargs) for train in (True, False)]
    except (RuntimeError, OSError) as exc:  # OSError: urllib's URLError without network, a full disk, ...
        why = ' '.join(str(exc).split()) or type(exc).__name__
        local = None if fetch else os.path.join(folder, getattr(tv_cls, "base_folder", ""))
        raise _missing(name, root, download, why, kwargs.get("split", "balanced"),
                       target=folder if fetch else None, local=local) from None
    blob: dict[str, torch.Tensor] = {}
    for split, ds in zip(("train", "test"), splits):
        x = torch.as_tensor(np.asarray(ds.data))
        x = x.permute(0, 3, 1, 2) if x.ndim == 4 else x.unsqueeze(1)  # NHWC (CIFAR) or NHW (MNIST-like)
        blob[f"{split}_x"] = x.contiguous()
        blob[f"{split}_y"] = torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)
    if name == "emnist" and kwargs.get("split") == "letters":
        blob["train_y"], blob["test_y"] = blob["train_y"] - 1, blob["test_y"] - 1
    return _to_dataset(name, blob, num_classes)


def _idx_names(name: str, split: str) -> dict[str, str]:
    prefix = f"emnist-{split}-" if name == "emnist" else ""
    return {"train_x": f"{prefix}train-images-idx3-ubyte", "train_y": f"{prefix}train-labels-idx1-ubyte",
            "test_x": f"{prefix}t10k-images-idx3-ubyte", "test_y": f"{prefix}t10k-labels-idx1-ubyte"}
