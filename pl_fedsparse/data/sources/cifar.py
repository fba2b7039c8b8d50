"""``data.name: cifar10 | cifar100``: torchvision's pickled layout under ``root``, else an image-folder copy
(``root/train/<class>/*.jpg``, ``root/test/...``, possibly one folder further down), else torchvision's download.
"""

from __future__ import annotations

import os

from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.data.cache import download_dir
from pl_fedsparse.data.decode import _find_image_folder
from pl_fedsparse.data.sources._builtin import _from_torchvision, _load_image_folder, _missing, _to_dataset


def _load_cifar(name: str, root: str | None, download: bool) -> BaseDataset:
    import torchvision

    num_classes = 10 if name == "cifar10" else 100
    tv_cls = torchvision.datasets.CIFAR10 if name == "cifar10" else torchvision.datasets.CIFAR100
    where = root if root is not None else str(download_dir(name))
    if os.path.isdir(where):  # a local copy wins: no download, whatever ``download`` says
        if os.path.isdir(os.path.join(where, tv_cls.base_folder)):
            return _from_torchvision(name, tv_cls, where, num_classes, root=root, fetch=False, download=download)
        folder = _find_image_folder(where)
        if folder is not None:
            return _to_dataset(name, _load_image_folder(name, folder, num_classes, where), num_classes)
    if download:
        return _from_torchvision(name, tv_cls, where, num_classes, root=root, fetch=True, download=True)
    raise _missing(name, root, download=False)
