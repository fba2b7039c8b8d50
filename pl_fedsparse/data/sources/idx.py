"""``data.name: mnist | fashion_mnist | emnist``: the original IDX files (plain or ``.gz``) in ``root`` or in
torchvision's ``root/<Class>/raw`` layout (for Fashion-MNIST, Debian's ``dataset-fashion-mnist`` package when
``root`` is unset), else torchvision's download.
"""

from __future__ import annotations

import os

import torch

from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.data.cache import _cached, download_dir
from pl_fedsparse.data.decode import read_idx
from pl_fedsparse.data.sources._builtin import (
    _TV_IDX_FOLDER,
    FASHION_MNIST_SYSTEM_DIR,
    _from_torchvision,
    _idx_names,
    _missing,
    _to_dataset,
)
from pl_fedsparse.errors import check

__all__ = ["EMNIST_SPLITS"]


#: EMNIST split -> number of classes (``letters`` labels are shifted from 1..26 to 0..25).
EMNIST_SPLITS: dict[str, int] = {"balanced": 47, "byclass": 62, "bymerge": 47, "digits": 10, "letters": 26,
                                 "mnist": 10}


def _find_idx_files(folder: str, names: dict[str, str]) -> dict[str, str] | None:
    found = {key: next((p for p in (os.path.join(folder, base), os.path.join(folder, base + ".gz"))
                        if os.path.isfile(p)), None) for key, base in names.items()}
    return found if all(found.values()) else None  # type: ignore[return-value]


def _load_idx_dataset(name: str, root: str | None, download: bool, emnist_split: str) -> BaseDataset:
    import torchvision

    num_classes = EMNIST_SPLITS[emnist_split] if name == "emnist" else 10
    names = _idx_names(name, emnist_split)
    where = root if root is not None else str(download_dir(name))
    folders = [where, os.path.join(where, _TV_IDX_FOLDER[name], "raw")]
    if name == "fashion_mnist" and root is None:
        folders.insert(0, FASHION_MNIST_SYSTEM_DIR)
    for folder in folders:
        files = _find_idx_files(folder, names)
        if files is None:
            continue

        def build(files: dict[str, str] = files) -> dict[str, torch.Tensor]:
            blob = {key: read_idx(path) for key, path in files.items()}
            for split in ("train", "test"):
                x, y = blob[f"{split}_x"], blob[f"{split}_y"]
                check(x.ndim == 3 and y.ndim == 1 and len(x) == len(y), "data.root", root,
                      f"matching IDX image [N, H, W] and label [N] files (got {tuple(x.shape)} and {tuple(y.shape)}"
                      f" in {folder})")
                blob[f"{split}_x"] = x.to(torch.uint8).unsqueeze(1).contiguous()
                blob[f"{split}_y"] = y.to(torch.int64) - (1 if name == "emnist" and emnist_split == "letters" else 0)
            return blob

        blob = _cached(name, os.path.abspath(folder), list(files.values()), build, extra=emnist_split)
        labels = torch.cat([blob["train_y"], blob["test_y"]])
        check(int(labels.min()) >= 0 and int(labels.max()) < num_classes, "data.root", root,
              f"labels in [0, {num_classes}) in the IDX label files of {folder}")
        return _to_dataset(name, blob, num_classes)
    if download:
        kwargs = {"split": emnist_split} if name == "emnist" else {}
        tv_cls = getattr(torchvision.datasets, _TV_IDX_FOLDER[name])
        return _from_torchvision(name, tv_cls, where, num_classes, root=root, fetch=True, download=True, **kwargs)
    raise _missing(name, root, download=False, split=emnist_split)
