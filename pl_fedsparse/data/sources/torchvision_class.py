"""``data.name: torchvision``: any ``torchvision.datasets`` class by name (or a class with the same constructor by
dotted path), read offline from ``root`` when its files are there (the distributed ``.gz`` files too).
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pl_fedsparse.data.base import BaseDataset, channel_stats
from pl_fedsparse.data.cache import _cache_load, _cache_save, _signature, cache_dir
from pl_fedsparse.data.decode import (
    check_resized_images,
)
from pl_fedsparse.data.sources._common import _walk
from pl_fedsparse.errors import ConfigError, DataNotFoundError, check

log = logging.getLogger(__name__)

__all__ = ["resolve_torchvision_class"]


def resolve_torchvision_class(spec: Any) -> type:
    """The dataset class named by ``data.torchvision_class``: a name in ``torchvision.datasets`` or a dotted path."""
    allowed = ("a class of torchvision.datasets (e.g. 'SVHN', 'KMNIST', 'QMNIST', 'STL10', 'USPS') or the dotted "
               "path of a class with torchvision's dataset constructor")
    check(isinstance(spec, str) and spec != "", "data.torchvision_class", spec, allowed)
    cls: Any = None
    try:
        if "." in spec:
            module, _, attr = spec.rpartition(".")
            cls = getattr(importlib.import_module(module), attr, None)
        else:
            import torchvision.datasets

            cls = getattr(torchvision.datasets, spec, None)
    except ImportError:
        cls = None
    check(isinstance(cls, type) and issubclass(cls, torch.utils.data.Dataset), "data.torchvision_class", spec,
          allowed)
    return cls


def _split_kwargs(cls: type, spec: str, args: dict) -> tuple[dict, dict, dict]:
    """Constructor keyword arguments of the train split, the test split, and the download flag's name."""
    params = inspect.signature(cls).parameters
    train: dict[str, Any]
    test: dict[str, Any]
    if "train" in params:
        train, test = {"train": True}, {"train": False}
    elif "split" in params:
        train, test = {"split": "train"}, {"split": "test"}
    else:
        raise ConfigError(f"data.torchvision_class={spec!r} is invalid: expected a class whose constructor takes "
                          f"train= or split= (a train and a test split)")
    clash = sorted(set(train) & set(args))
    check(not clash, "data.torchvision_args", args, f"no {clash[0] if clash else ''!r} (the train/test split is set "
          f"by pl_fedsparse)")
    return train, test, ({"download": True} if "download" in params else {})


def _to_uint8_image(img: Any, mode: str | None) -> torch.Tensor:
    """A PIL image or image tensor as ``uint8 [C, H, W]``; ``mode`` (PIL) makes every image the first one's mode."""
    if isinstance(img, torch.Tensor):
        t = img if img.dtype == torch.uint8 else (img.float() * 255).round().clamp(0, 255).to(torch.uint8)
        return t.unsqueeze(0) if t.ndim == 2 else t
    from torchvision.transforms.v2.functional import pil_to_tensor

    return pil_to_tensor(img.convert(mode) if mode is not None and img.mode != mode else img)


def _tv_split(ds: Any, spec: str, size: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8 [N, C, H, W]`` images and ``int64`` labels of one split of a torchvision dataset: from its ``data``
    array when it has one (CIFAR, MNIST-like, SVHN, STL10, USPS), else item by item (PIL images)."""
    if size is not None:
        check_resized_images(len(ds), 3, size)
    data = getattr(ds, "data", None)
    targets = next((getattr(ds, a) for a in ("targets", "labels", "_labels") if getattr(ds, a, None) is not None),
                   None)
    arr = np.asarray(data) if isinstance(data, (np.ndarray, torch.Tensor)) else None
    if arr is not None and arr.dtype == np.uint8 and arr.ndim in (3, 4) and targets is not None \
            and len(arr) == len(targets) == len(ds):
        x = torch.from_numpy(np.ascontiguousarray(arr))
        if x.ndim == 3:
            x = x.unsqueeze(1)
        elif x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):  # NHWC (CIFAR) vs NCHW (SVHN, STL10)
            x = x.permute(0, 3, 1, 2)
        y = torch.as_tensor(np.asarray(targets), dtype=torch.int64)
        imgs = list(x) if size is not None and tuple(x.shape[2:]) != size else None
        if imgs is None:
            return x.contiguous(), y
    else:
        imgs, labels, mode = [], [], None
        for i in range(len(ds)):
            item = ds[i]
            img = item[0]
            if mode is None and not isinstance(img, torch.Tensor):
                mode = "L" if img.mode in ("L", "1", "I", "I;16", "F") else "RGB"
            imgs.append(_to_uint8_image(img, mode))
            labels.append(int(item[1]))
        y = torch.tensor(labels, dtype=torch.int64)
    if size is not None:
        from torchvision.transforms.v2.functional import resize

        imgs = [im if tuple(im.shape[1:]) == size else resize(im, list(size), antialias=True) for im in imgs]
    shapes = {tuple(im.shape) for im in imgs}
    check(len(shapes) <= 1, "data.image_size", None,
          f"[height, width] to resize to: torchvision.datasets.{spec} has images of {len(shapes)} shapes "
          f"(e.g. {', '.join(str(s) for s in sorted(shapes)[:2])})")
    return (torch.stack(imgs) if imgs else torch.zeros(0, 1, 1, 1, dtype=torch.uint8)), y


def _mnist_files(cls: type) -> list[str]:
    """The files an MNIST-family class of torchvision (MNIST, FashionMNIST, KMNIST) reads from
    ``root/<Class>/raw/``, as distributed (``.gz``); empty for any other class."""
    import torchvision.datasets as tvd

    if not issubclass(cls, tvd.MNIST) or issubclass(cls, (tvd.EMNIST, tvd.QMNIST)):
        return []
    resources = getattr(cls, "resources", None)
    if not isinstance(resources, list):
        return []
    return [os.path.basename(name) for name, _ in resources if str(name).endswith(".gz")]


def _unpack_distributed_files(cls: type, where: str) -> None:
    """Without a download, torchvision's MNIST-family classes read only uncompressed files: unpack the ``.gz``
    files as distributed (e.g. Debian's ``dataset-fashion-mnist``) next to them, once, atomically."""
    raw = Path(where) / cls.__name__ / "raw"
    for name in _mnist_files(cls):
        packed, target = raw / name, raw / name[:-3]
        if packed.is_file() and not target.exists():
            try:
                with gzip.open(packed, "rb") as f:
                    data = f.read()
            except (OSError, EOFError) as exc:
                raise ConfigError(f"data.root={where!r} is invalid: {packed} cannot be unpacked "
                                  f"({' '.join(str(exc).split())}); expected the gzip file as distributed") from None
            tmp = None
            try:  # atomically: a half-written file would be read as the dataset
                fd, tmp = tempfile.mkstemp(dir=raw, prefix=f".{target.name}.", suffix=".tmp")
                with os.fdopen(fd, "wb") as out:
                    out.write(data)
                os.replace(tmp, target)
            except OSError as exc:
                if tmp is not None and os.path.exists(tmp):
                    os.unlink(tmp)
                raise ConfigError(f"data.root={where!r} is invalid: {packed} cannot be unpacked next to itself "
                                  f"({exc.strerror or exc}); expected a writable folder, or the files unpacked "
                                  f"(gunzip -k {raw}/*.gz)") from None
            log.info("unpacked %s for torchvision.datasets.%s", packed, cls.__name__)


def _load_torchvision(root: str | None, download: bool, spec: str | None, args: dict | None,
                      size: tuple[int, int] | None) -> BaseDataset:
    cls = resolve_torchvision_class(spec)
    assert spec is not None
    args = dict(args or {})
    check(all(isinstance(k, str) for k in args), "data.torchvision_args", args, "a dict of constructor arguments")
    train_kw, test_kw, dl = _split_kwargs(cls, spec, args)
    where = root if root is not None else str(cache_dir() / "torchvision" / cls.__name__)
    extra = f"{spec}|{json.dumps(args, sort_keys=True, default=repr)}|{size}"

    def cache_path() -> Path:
        return cache_dir() / f"torchvision-{cls.__name__}-{_signature('torchvision', where, _walk(where), extra)}.pt"

    if os.path.isdir(where):
        _unpack_distributed_files(cls, where)
    blob = _cache_load(cache_path()) if os.path.isdir(where) and _walk(where) else None
    if blob is None:
        try:
            if dl:
                dl = {"download": bool(download)}
            splits = [cls(where, **kw, **dl, **args) for kw in (train_kw, test_kw)]
        except (RuntimeError, OSError, ValueError) as exc:  # OSError: urllib's URLError without network, ...
            why = " ".join(str(exc).split())[:200] or type(exc).__name__
            how = (f"the download into {where} failed (it needs network); put a copy there" if download else
                   f"pass --data.download true (needs network) or put a copy in {where}")
            files = _mnist_files(cls)
            if files:  # say where torchvision looks, and for what
                how += (f" ({cls.__name__} reads {os.path.join(where, cls.__name__, 'raw')}/ holding "
                        f"{', '.join(files)}: the files as distributed, .gz, or uncompressed)")
            what = spec if "." in spec else f"torchvision.datasets.{spec}"
            raise DataNotFoundError(f"data.root={root!r} has no {what} ({why}): {how}") from None
        blob = {}
        for split, ds in zip(("train", "test"), splits):
            blob[f"{split}_x"], blob[f"{split}_y"] = _tv_split(ds, spec, size)
        classes = getattr(splits[0], "classes", None)
        blob["num_classes"] = torch.tensor(len(classes) if isinstance(classes, (list, tuple)) and classes else -1)
        _cache_save(cache_path(), blob)
    labels = torch.cat([blob["train_y"], blob["test_y"]])
    num_classes = int(blob["num_classes"]) if "num_classes" in blob else -1
    if num_classes < 1 or (labels.numel() and int(labels.max()) >= num_classes):
        num_classes = int(labels.max()) + 1 if labels.numel() else 0
    mean, std = channel_stats(blob["train_x"])
    return BaseDataset(cls.__name__, blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"], num_classes,
                       mean, std)
