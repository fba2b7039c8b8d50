"""``data.name: image_folder``: an image folder with any number of classes (``root/train/<class>/*`` and
``root/test/<class>/*``, or ``root/<class>/*`` with a held-out test split).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from pl_fedsparse.data.base import BaseDataset, channel_stats
from pl_fedsparse.data.cache import _cached
from pl_fedsparse.data.decode import (
    _IMAGE_SUFFIXES,
    _decode_files,
    _find_image_folder,
    _list_images,
)
from pl_fedsparse.data.sources._builtin import _load_image_folder
from pl_fedsparse.data.sources._common import _size_extra, held_out_split
from pl_fedsparse.errors import DataNotFoundError, check

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------- image_folder
def _load_folder(root: str | None, test_fraction: float, seed: int, size: tuple[int, int] | None) -> BaseDataset:
    layouts = "root/train/<class>/*.jpg|png and root/test/<class>/..., or root/<class>/*.jpg|png"
    check(root is not None, "data.root", root, f"the image folder for data.name='image_folder' ({layouts})")
    assert root is not None
    if not os.path.isdir(root):
        raise DataNotFoundError(f"data.root={root!r} is invalid: expected an existing image folder ({layouts})")
    folder = _find_image_folder(root)
    if folder is not None:
        blob = _load_image_folder("image_folder", folder, None, root, size)
        classes = sorted(p.name for p in (folder / "train").iterdir() if p.is_dir())
        x_train, y_train, x_test, y_test = blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"]
    else:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        files, labels = _list_images(Path(root), classes)
        check(len(files) > 0, "data.root", root, f"image files ({', '.join(_IMAGE_SUFFIXES)}) in {layouts}")
        _warn_empty_classes(root, classes, labels)
        empty = torch.zeros(0, dtype=torch.int64)

        def build() -> dict[str, torch.Tensor]:  # the whole folder; split below (the split is cheap, and seeded)
            return {"train_x": _decode_files(files, root, size), "train_y": torch.tensor(labels), "test_x": empty,
                    "test_y": empty}

        blob = _cached("image_folder", root, files, build, _size_extra(classes, size))
        train, test = held_out_split(blob["train_y"].numpy(), test_fraction, seed)
        x, y = blob["train_x"], blob["train_y"]
        x_train, y_train, x_test, y_test = x[train], y[train], x[test], y[test]
    mean, std = channel_stats(x_train)
    return BaseDataset("image_folder", x_train, y_train.long(), x_test, y_test.long(), len(classes), mean, std)


def _warn_empty_classes(root: str, classes: list[str], labels: list[int]) -> None:
    """A class folder without an image is a class no client can learn: say which (it still counts as a class)."""
    seen = set(labels)
    empty = [c for i, c in enumerate(classes) if i not in seen]
    if empty:
        log.warning("data.root=%r: class folder(s) %s hold no image (.%s); they stay classes of the task (labels "
                    "and logits keep their places) but no client has a sample of them", root,
                    ", ".join(repr(c) for c in empty), "/.".join(s.lstrip(".") for s in _IMAGE_SUFFIXES))
