"""The user-data sources by name (``data.name``: ``image_folder``, ``tensors``, ``torchvision``, ``leaf``):
:func:`load_source` looks the name up in :data:`USER_SOURCES` and checks what the source returns
(:func:`~pl_fedsparse.data.validate.validate_base_dataset`); :func:`source_key` is its part of the memo key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pl_fedsparse.data.base import BaseDataset
from pl_fedsparse.data.sources._common import image_size_pair
from pl_fedsparse.data.sources.image_folder import _load_folder
from pl_fedsparse.data.sources.leaf import _load_leaf
from pl_fedsparse.data.sources.tensor_file import _load_tensors
from pl_fedsparse.data.sources.torchvision_class import _load_torchvision
from pl_fedsparse.data.validate import validate_base_dataset
from pl_fedsparse.errors import ConfigError, check

__all__ = ["SourceRequest", "USER_SOURCES", "load_source", "source_key"]


def source_key(name: str, abs_root: str | None, *, test_fraction: float, seed: int, image_size: Any,
               torchvision_class: str | None, torchvision_args: dict | None) -> tuple:
    """The options of a source that the in-process memo of :func:`~pl_fedsparse.data.datasets.load_dataset` keys."""
    size = image_size_pair(image_size)
    if name == "image_folder":
        return (float(test_fraction), int(seed), size)
    if name == "tensors":
        return (float(test_fraction), int(seed))
    if name == "torchvision":
        return (torchvision_class, json.dumps(torchvision_args or {}, sort_keys=True, default=repr), size)
    return ()


def load_source(name: str, root: str | None, download: bool, *, test_fraction: float = 0.2, seed: int = 0,
                image_size: Any = None, torchvision_class: str | None = None,
                torchvision_args: dict | None = None) -> BaseDataset:
    """Load one of the sources of the module docstring (``root`` absolute or ``None``); see
    :func:`~pl_fedsparse.data.datasets.load_dataset` for the arguments."""
    check(isinstance(test_fraction, (int, float)) and not isinstance(test_fraction, bool) and 0 < test_fraction < 1,
          "data.test_fraction", test_fraction, "a number in (0, 1)")
    size = image_size_pair(image_size)
    loader = USER_SOURCES.get(name)
    if loader is None:
        raise ConfigError(f"data.name={name!r} is invalid: expected one of {', '.join(USER_SOURCES)}")
    request = SourceRequest(root, download, float(test_fraction), int(seed), size, torchvision_class,
                            torchvision_args)
    return validate_base_dataset(loader(request), f"data.name={name!r}")


@dataclass(frozen=True)
class SourceRequest:
    """What :func:`load_source` was asked for; each source reads the part it needs."""

    root: str | None
    download: bool
    test_fraction: float
    seed: int
    size: tuple[int, int] | None
    torchvision_class: str | None
    torchvision_args: dict | None


#: ``data.name`` -> the loader of that user-data source (one module each in :mod:`pl_fedsparse.data.sources`)
USER_SOURCES: dict[str, Callable[[SourceRequest], BaseDataset]] = {
    "image_folder": lambda r: _load_folder(r.root, r.test_fraction, r.seed, r.size),
    "tensors": lambda r: _load_tensors(r.root, r.test_fraction, r.seed),
    "torchvision": lambda r: _load_torchvision(r.root, r.download, r.torchvision_class, r.torchvision_args, r.size),
    "leaf": lambda r: _load_leaf(r.root),
}
