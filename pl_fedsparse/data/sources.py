"""Your own data as a base dataset: an image folder, a file of tensors, any torchvision dataset, LEAF's JSON files.

Each source is chosen by ``data.name`` and read from ``data.root``; the result is a
:class:`~pl_fedsparse.data.datasets.BaseDataset` like the built-in datasets' (memoised per process, decoded files
cached on disk, see :mod:`pl_fedsparse.data.datasets`).

* ``image_folder`` — ``root/train/<class>/*.jpg|png`` and ``root/test/<class>/...`` (possibly one folder further down)
  with any number of classes, or a single ``root/<class>/...`` folder that is split into train and test per class
  (``data.test_fraction`` of each class is held out, seeded by ``data.seed``). The sorted class folder names are the
  labels ``0 .. C-1``; images are decoded as RGB ``uint8`` and must have one size unless ``data.image_size`` resizes
  them. The normalisation statistics are computed from the training images.
* ``tensors`` — ``root`` is a ``.pt`` file (read with ``torch.load(..., weights_only=True)``: tensors only, no code
  is ever run) or an ``.npz`` file (``np.load(..., allow_pickle=False)``) holding ``train_x``, ``train_y``,
  ``test_x``, ``test_y`` (or ``x``, ``y``, split like a single image folder by ``data.test_fraction``, per client
  when client ids are given), and optionally ``train_client``/``test_client`` (or ``client``) per-sample client ids
  for ``data.partition=natural``, ``num_classes`` (default: the largest label + 1) and ``mean``/``std``. Inputs may
  be ``uint8 [N, C, H, W]`` images, float features of any shape (stored as float32) or integer token ids (int64).
* ``torchvision`` — ``data.torchvision_class`` names a class of ``torchvision.datasets`` (``SVHN``, ``KMNIST``,
  ``QMNIST``, ``STL10``, ``USPS``, ...; or the dotted path of any class with torchvision's constructor) built as
  ``cls(root, train=...|split="train"/"test", download=data.download, **data.torchvision_args)`` into ``root``
  (default ``$PL_FEDSPARSE_CACHE/torchvision/<class>``); the images are converted once to ``uint8 [N, C, H, W]`` and
  cached. Without network the download fails in one line (:class:`~pl_fedsparse.errors.DataNotFoundError`).
* ``leaf`` — LEAF's per-user JSON files (``root/train/*.json`` and ``root/test/*.json``, each
  ``{"users": [...], "user_data": {user: {"x": [...], "y": [...]}}}``, as ``preprocess.sh`` writes them for FEMNIST,
  Shakespeare, Sent140's ids, ...). Every user is a natural client (in order of first appearance in the sorted train
  files). Numeric ``x`` is kept as given (floats → float32 features, e.g. FEMNIST's ``[N, 784]``; ints → int64 token
  ids); strings (Shakespeare) become character ids in LEAF's 80-letter alphabet, and so do string labels.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "toy.npz")
    >>> rng = np.random.default_rng(0)
    >>> np.savez(path, x=rng.standard_normal((40, 20)).astype(np.float32), y=np.arange(40) % 2,
    ...          client=np.arange(40) % 4)
    >>> d = load_source("tensors", path, False, test_fraction=0.25, seed=0)
    >>> d.kind, d.sample_shape, len(d.train_y), len(d.test_y), d.num_classes, sorted(set(d.train_client.tolist()))
    ('features', (20,), 32, 8, 2, [0, 1, 2, 3])
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib
import inspect
import json
import logging
import os
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pl_fedsparse.data.datasets import (
    _IMAGE_SUFFIXES,
    BaseDataset,
    check_resized_images,
    _cache_load,
    _cache_save,
    _cached,
    _decode_files,
    _find_image_folder,
    _list_images,
    _load_image_folder,
    _signature,
    cache_dir,
    channel_stats,
    input_kind,
)
from pl_fedsparse.errors import ConfigError, DataNotFoundError, check

__all__ = ["load_source", "source_key", "image_size_pair", "resolve_torchvision_class", "held_out_split",
           "validate_base_dataset", "LEAF_LETTERS", "TENSOR_KEYS"]

log = logging.getLogger(__name__)

#: LEAF's Shakespeare alphabet (``models/utils/language_utils.py``): a character's id is its index here
LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
#: the keys a ``tensors`` file may hold
TENSOR_KEYS = ("train_x", "train_y", "test_x", "test_y", "x", "y", "train_client", "test_client", "client",
               "num_classes", "mean", "std")


def image_size_pair(image_size: Any) -> tuple[int, int] | None:
    """Validate ``data.image_size`` (``None``, an int or ``[height, width]``) and return ``(height, width)``.

    Example:
        >>> image_size_pair(32), image_size_pair([24, 32]), image_size_pair(None)
        ((32, 32), (24, 32), None)
    """
    if image_size is None:
        return None
    pair = (image_size, image_size) if not isinstance(image_size, (list, tuple)) else tuple(image_size)
    check(len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in pair),
          "data.image_size", image_size, "None, an int >= 1 or [height, width]")
    return int(pair[0]), int(pair[1])


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


def held_out_split(groups: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``round(test_fraction * n)`` random samples of every group (class or client) as a test split.

    A group of ``n >= 2`` samples keeps at least one sample on each side; a single sample stays in training.

    Returns:
        Sorted train and test indices.

    Example:
        >>> train, test = held_out_split(np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1]), 0.25, seed=0)
        >>> len(train), len(test), sorted(np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1])[test].tolist())
        (7, 3, [0, 1, 1])
    """
    groups = np.asarray(groups)
    rng = np.random.default_rng([seed, 7])
    test: list[np.ndarray] = []
    for g in np.unique(groups):
        members = rng.permutation(np.flatnonzero(groups == g))
        n = len(members)
        n_test = min(max(round(test_fraction * n), 1), n - 1) if n >= 2 else 0
        test.append(members[:n_test])
    test_idx = np.sort(np.concatenate(test)) if test else np.empty(0, np.int64)
    mask = np.ones(len(groups), dtype=bool)
    mask[test_idx] = False
    return np.flatnonzero(mask), test_idx


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
    if name == "image_folder":
        base = _load_folder(root, float(test_fraction), int(seed), size)
    elif name == "tensors":
        base = _load_tensors(root, float(test_fraction), int(seed))
    elif name == "torchvision":
        base = _load_torchvision(root, download, torchvision_class, torchvision_args, size)
    elif name == "leaf":
        base = _load_leaf(root)
    else:
        raise ConfigError(f"data.name={name!r} is invalid: expected one of image_folder, tensors, torchvision, leaf")
    return validate_base_dataset(base, f"data.name={name!r}")


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


def _size_extra(classes: list[str], size: tuple[int, int] | None) -> str:
    return "|".join(classes) + ("" if size is None else f"|size={size[0]}x{size[1]}")


# ----------------------------------------------------------------------------------------------- tensors
def _read_tensor_file(path: str) -> dict[str, Any]:
    suffix = os.path.splitext(path)[1].lower()
    expected = ("a .pt file saved with torch.save({'train_x': ..., 'train_y': ..., 'test_x': ..., 'test_y': ...}) "
                "(tensors only) or an .npz file with those arrays")
    check(suffix in (".pt", ".pth", ".npz"), "data.root", path, f"{expected} for data.name='tensors'")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as npz:
                blob: Any = {k: npz[k] for k in npz.files}
        else:
            with warnings.catch_warnings():  # (torch warns about a foreign pickle protocol: the error says it)
                warnings.simplefilter("ignore")
                blob = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        why = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"data.root={path!r} is invalid: cannot read it ({why}); expected {expected}") from None
    check(isinstance(blob, dict), "data.root", path, f"{expected} (it holds a {type(blob).__name__}, not a dict)")
    for key in blob:
        check(key in TENSOR_KEYS, "data.root", path, f"keys among {', '.join(TENSOR_KEYS)} (it has {key!r})")
    return blob


def _as_tensor(value: Any, key: str, path: str) -> torch.Tensor:
    """The file's array ``key`` as a tensor; one line naming it when it holds no numbers (e.g. strings)."""
    if isinstance(value, torch.Tensor):
        return value
    arr = np.asarray(value)
    try:
        return torch.as_tensor(arr)
    except (TypeError, ValueError, RuntimeError):
        raise ConfigError(f"data.root={path!r} is invalid: its {key} holds {arr.dtype} values; expected numbers "
                          "(integer labels and client ids, float features, uint8 images or integer token ids)"
                          ) from None


def _load_tensors(root: str | None, test_fraction: float, seed: int) -> BaseDataset:
    check(root is not None, "data.root", root, "the .pt or .npz file for data.name='tensors'")
    assert root is not None
    if not os.path.isfile(root):
        raise DataNotFoundError(f"data.root={root!r} is invalid: expected an existing .pt or .npz file for "
                                f"data.name='tensors'")
    blob = {k: (v if k == "num_classes" else _as_tensor(v, k, root)) for k, v in _read_tensor_file(root).items()}
    if "x" in blob or "y" in blob:
        check("x" in blob and "y" in blob and not {"train_x", "train_y", "test_x", "test_y"} & set(blob),
              "data.root", root, "either x and y (split by data.test_fraction) or train_x, train_y, test_x and test_y")
        check(len(blob["x"]) == len(blob["y"]), "data.root", root,
              f"x and y of one length (got {len(blob['x'])} and {len(blob['y'])})")
        client = blob.pop("client", None)
        check(client is None or len(client) == len(blob["x"]), "data.root", root,
              f"one client id per sample: client of length {len(client) if client is not None else 0} and x, y "
              f"of length {len(blob['x'])}")
        groups = (client if client is not None else blob["y"]).numpy()
        train, test = held_out_split(groups, test_fraction, seed)
        x, y = blob.pop("x"), blob.pop("y")
        tr, te = torch.from_numpy(train), torch.from_numpy(test)
        blob.update(train_x=x[tr], train_y=y[tr], test_x=x[te], test_y=y[te])
        if client is not None:
            blob.update(train_client=client[tr], test_client=client[te])
    else:
        missing = [k for k in ("train_x", "train_y", "test_x", "test_y") if k not in blob]
        check(not missing and "client" not in blob, "data.root", root,
              f"train_x, train_y, test_x and test_y (or x and y) with train_client/test_client ids (missing "
              f"{', '.join(missing) or 'nothing'}{'; client needs x and y' if 'client' in blob else ''})")
    labels = torch.cat([blob["train_y"].reshape(-1), blob["test_y"].reshape(-1)])
    num_classes: Any = blob.get("num_classes")
    if num_classes is None:  # float labels are refused by the validation, with a better message
        num_classes = int(labels.max()) + 1 if labels.numel() and not labels.is_floating_point() else 1
    else:
        arr = np.asarray(num_classes)
        num_classes = int(arr) if arr.size == 1 and np.issubdtype(arr.dtype, np.integer) else num_classes
    mean = tuple(float(v) for v in blob["mean"].reshape(-1)) if "mean" in blob else None
    std = tuple(float(v) for v in blob["std"].reshape(-1)) if "std" in blob else None
    x_train = blob["train_x"]
    if mean is None and std is None and input_kind(x_train) == "image":
        mean, std = channel_stats(x_train)
    return BaseDataset("tensors", x_train, blob["train_y"], blob["test_x"], blob["test_y"], num_classes, mean, std,
                       blob.get("train_client"), blob.get("test_client"))


# ----------------------------------------------------------------------------------------------- torchvision
def _walk(folder: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")]
    return out


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


# ----------------------------------------------------------------------------------------------- LEAF
def _leaf_ids(values: list, root: str, what: str) -> np.ndarray:
    ids = [LEAF_LETTERS.find(c) for c in "".join(values)]
    if min(ids, default=0) < 0:
        bad = next(c for c in "".join(values) if LEAF_LETTERS.find(c) < 0)
        raise ConfigError(f"data.root={root!r} is invalid: {what} has the character {bad!r}; expected characters of "
                          f"LEAF's alphabet {LEAF_LETTERS!r}")
    return np.asarray(ids, dtype=np.int64)


def _leaf_arrays(xs: list, ys: list, root: str) -> tuple[torch.Tensor, torch.Tensor]:
    if xs and isinstance(xs[0], str):  # Shakespeare: one string of characters per sample
        lengths = {len(s) for s in xs}
        check(len(lengths) == 1, "data.root", root, f"LEAF x strings of one length (got {sorted(lengths)[:3]})")
        x = torch.from_numpy(_leaf_ids(xs, root, "an x string").reshape(len(xs), -1))
    else:
        try:
            arr = np.asarray(xs)
        except ValueError:
            arr = np.asarray([], dtype=object)
        check(arr.dtype != object and (np.issubdtype(arr.dtype, np.number) or len(xs) == 0), "data.root", root,
              "LEAF x values that are numbers, equally long lists of numbers, or strings of one length")
        x = torch.from_numpy(arr.astype(np.float32) if np.issubdtype(arr.dtype, np.floating)
                             else arr.astype(np.int64))
    if ys and isinstance(ys[0], str):
        y = torch.from_numpy(_leaf_ids(ys, root, "a y label"))
    else:
        y = torch.as_tensor(np.asarray(ys, dtype=np.int64))
    return x, y


def _load_leaf(root: str | None) -> BaseDataset:
    layout = "root/train/*.json and root/test/*.json (LEAF's preprocess.sh output, e.g. leaf/data/femnist/data)"
    check(root is not None, "data.root", root, f"the LEAF data folder for data.name='leaf' ({layout})")
    assert root is not None
    files = {s: sorted(str(p) for p in Path(root, s).glob("*.json")) for s in ("train", "test")}
    if not files["train"] or not files["test"]:
        raise DataNotFoundError(f"data.root={root!r} has no LEAF data: expected {layout}")

    def build() -> dict[str, torch.Tensor]:
        users: dict[str, int] = {}
        out: dict[str, torch.Tensor] = {}
        for split in ("train", "test"):
            xs: list = []
            ys: list = []
            owners: list[int] = []
            for path in files[split]:
                try:
                    with open(path, encoding="utf-8") as f:
                        data = json.load(f)
                    order = list(data["users"])
                    user_data = data["user_data"]
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    why = " ".join(str(exc).split())[:120] or type(exc).__name__
                    raise ConfigError(f"data.root={root!r} is invalid: {path} is not a LEAF file ({why}); expected "
                                      f"{{\"users\": [...], \"user_data\": {{user: {{\"x\": [...], \"y\": [...]}}}}}}"
                                      ) from None
                for user in order:
                    if split == "train":
                        users.setdefault(user, len(users))
                    elif user not in users:
                        raise ConfigError(f"data.root={root!r} is invalid: test user {user!r} ({path}) has no "
                                          f"training data; expected every test user among the train users")
                    ux, uy = user_data[user]["x"], user_data[user]["y"]
                    check(len(ux) == len(uy), "data.root", root, f"x and y of one length for user {user!r} in {path}")
                    xs += ux
                    ys += uy
                    owners += [users[user]] * len(ux)
            x, y = _leaf_arrays(xs, ys, root)
            out["chars"] = torch.tensor(bool(ys) and isinstance(ys[0], str))
            out.update({f"{split}_x": x, f"{split}_y": y, f"{split}_client": torch.tensor(owners, dtype=torch.int64)})
        return out

    blob = _cached("leaf", os.path.abspath(root), files["train"] + files["test"], build)
    chars = bool(blob.get("chars", torch.tensor(False)))
    labels = torch.cat([blob["train_y"], blob["test_y"]])
    num_classes = len(LEAF_LETTERS) if chars else (int(labels.max()) + 1 if labels.numel() else 0)
    return BaseDataset("leaf", blob["train_x"], blob["train_y"], blob["test_x"], blob["test_y"], num_classes,
                       train_client=blob["train_client"], test_client=blob["test_client"])


# ----------------------------------------------------------------------------------------------- validation
def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"a numpy {x.dtype} array of shape {x.shape} (expected a torch tensor)"
    return f"a {type(x).__name__}"


def validate_base_dataset(base: Any, owner: str) -> BaseDataset:
    """Check what a source or a :meth:`~pl_fedsparse.data.FederatedDataModule.load_base_dataset` returned.

    Labels and client ids given as arrays become ``int64`` tensors, float features ``float32`` and token ids
    ``int64``; a dataset that needs none of this (every built-in image dataset) is returned as is.

    Args:
        base: the returned object.
        owner: who returned it, for messages (``"MyData.load_base_dataset()"``, ``"data.name='tensors'"``).

    Raises:
        ConfigError: one line naming ``owner`` and the problem (wrong type, lengths differ, labels out of range, no
            test split, bad mean/std or client ids).

    Example:
        >>> bad = BaseDataset("x", torch.zeros(4, 3), torch.tensor([0, 1, 2, 0]), torch.zeros(2, 3),
        ...                   torch.tensor([0, 1]), num_classes=2)
        >>> validate_base_dataset(bad, "Mine.load_base_dataset()")
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: Mine.load_base_dataset() returned train_y with a label 2: expected labels in [0, 2) (num_classes=2)
    """
    def fail(what: str, expected: str) -> ConfigError:
        return ConfigError(f"{owner} returned {what}: expected {expected}")

    if not isinstance(base, BaseDataset):
        raise fail(_describe(base), "a pl_fedsparse.data.BaseDataset")
    nc = base.num_classes
    if not (isinstance(nc, (int, np.integer)) and not isinstance(nc, bool) and nc >= 1):
        raise fail(f"num_classes={nc!r}", "an int >= 1")
    changes: dict[str, Any] = {}
    kinds = ("uint8 images [N, C, H, W], float features [N, ...], integer token ids [N, ...] or a map-style "
             "torch.utils.data.Dataset")
    kind = input_kind(base.train_x)
    for split in ("train", "test"):
        x = getattr(base, f"{split}_x")
        if input_kind(x) is None:
            raise fail(f"{split}_x as {_describe(x)}", kinds)
        if input_kind(x) != kind:
            raise fail(f"test_x as {_describe(x)} and train_x as {_describe(base.train_x)}", "inputs of one kind")
        if isinstance(x, torch.Tensor):
            if x.shape[1:] != base.train_x.shape[1:]:
                raise fail(f"inputs of shapes {tuple(base.train_x.shape[1:])} (train) and {tuple(x.shape[1:])} "
                           f"(test)", "one input shape")
            if kind == "features" and x.dtype != torch.float32:
                changes[f"{split}_x"] = x.float()
            if kind == "tokens" and x.dtype != torch.int64:
                changes[f"{split}_x"] = x.long()
        y = getattr(base, f"{split}_y")
        if len(y) == 0:
            raise fail(f"no {split} split (0 samples)", f"at least one {split} sample")
        if not isinstance(y, torch.Tensor):
            try:
                y = torch.as_tensor(np.asarray(y))
            except (TypeError, ValueError, RuntimeError):
                raise fail(f"{split}_y as {_describe(y)}", "int64 labels [N]") from None
        if y.ndim != 1 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise fail(f"{split}_y as {_describe(y)}", "int64 labels [N]")
        if y.dtype != torch.int64 or y is not getattr(base, f"{split}_y"):
            changes[f"{split}_y"] = y = y.long()
        if len(x) != len(y):
            raise fail(f"{split}_x of length {len(x)} and {split}_y of length {len(y)}", "one label per input")
        if kind == "features" and isinstance(x, torch.Tensor):
            finite = torch.isfinite(x.reshape(len(x), -1)).all(dim=1) if len(x) else torch.ones(0, dtype=torch.bool)
            if not bool(finite.all()):
                bad = (~finite).nonzero().reshape(-1)
                raise fail(f"{split}_x with non-finite values (NaN or inf) in {len(bad)} row(s), the first row "
                           f"{int(bad[0])}", "finite features (drop or impute those rows)")
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= nc:
            raise fail(f"{split}_y with a label {lo if lo < 0 else hi}", f"labels in [0, {nc}) (num_classes={nc})")
    mean, std = base.mean, base.std
    if kind == "image":
        c = int(base.train_x.shape[1])
        ok = mean is not None and std is not None and len(mean) == c and len(std) == c and min(std) > 0
        if not ok:
            raise fail(f"mean={mean!r}, std={std!r}", f"{c} per-channel values each in [0, 1] units, std > 0 "
                                                      f"(pl_fedsparse.data.datasets.channel_stats computes them)")
    elif kind == "features" and (mean is not None or std is not None):
        width = int(base.train_x.shape[1]) if base.train_x.ndim >= 2 else 1
        ok = mean is not None and std is not None and len(mean) in (1, width) and len(std) == len(mean) \
            and min(std) > 0
        if not ok:
            raise fail(f"mean={mean!r}, std={std!r}", f"both None, or 1 or {width} values each with std > 0")
    elif mean is not None or std is not None:
        raise fail(f"mean={mean!r}, std={std!r} for {kind} inputs", "None (only images and float features are "
                                                                    "normalised)")
    if base.test_client is not None and base.train_client is None:
        raise fail("test_client without train_client", "train_client ids too (or neither)")
    for split in ("train", "test"):
        ids = getattr(base, f"{split}_client")
        if ids is None:
            continue
        t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        n = len(getattr(base, f"{split}_y"))
        if t.ndim != 1 or t.is_floating_point() or t.dtype == torch.bool or len(t) != n:
            raise fail(f"{split}_client as {_describe(ids)}", f"{n} integer client ids (one per {split} sample)")
        if t.dtype != torch.int64 or t is not ids:
            changes[f"{split}_client"] = t.long()
    return dataclasses.replace(base, **changes) if changes else base
