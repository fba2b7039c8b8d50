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

import gzip
import hashlib
import logging
import math
import os
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from pl_fedsparse.errors import ConfigError, DataNotFoundError, cause_of, check
from pl_fedsparse.resources import check_fits

log = logging.getLogger(__name__)

__all__ = [
    "CACHE_ENV",
    "DATASETS",
    "EMNIST_SPLITS",
    "SYNTHETIC_DEFAULTS",
    "BaseDataset",
    "InputKind",
    "cache_dir",
    "channel_stats",
    "clear_memo",
    "download_dir",
    "input_kind",
    "load_dataset",
    "make_synthetic",
    "read_idx",
    "synthetic_params",
]

DATASETS: tuple[str, ...] = ("synthetic", "cifar10", "cifar100", "mnist", "fashion_mnist", "emnist", "image_folder",
                             "tensors", "torchvision", "leaf")
#: the kinds of inputs a :class:`BaseDataset` may hold (see the module docstring)
InputKind = Literal["image", "features", "tokens", "dataset"]
#: EMNIST split -> number of classes (``letters`` labels are shifted from 1..26 to 0..25).
EMNIST_SPLITS: dict[str, int] = {"balanced": 47, "byclass": 62, "bymerge": 47, "digits": 10, "letters": 26,
                                 "mnist": 10}
#: Parameters of the ``synthetic`` task; override any of them with ``load_dataset(..., synthetic={...})``.
SYNTHETIC_DEFAULTS: dict[str, Any] = {"num_classes": 10, "num_train": 6000, "num_test": 1000, "channels": 3,
                                      "size": 16, "noise": 10.0, "seed": 0}
CACHE_ENV = "PL_FEDSPARSE_CACHE"
FASHION_MNIST_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
_CACHE_VERSION = 1
_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")
# Per-channel mean / std in [0, 1] units (of the original files; the JPEG copy of CIFAR-10 differs by < 0.003).
# EMNIST (split-dependent) and synthetic statistics are computed from the training images instead.
_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)), "fashion_mnist": ((0.2860,), (0.3530,))}
_PRETTY = {"cifar10": "CIFAR-10", "cifar100": "CIFAR-100", "mnist": "MNIST", "fashion_mnist": "Fashion-MNIST",
           "emnist": "EMNIST"}
_TV_IDX_FOLDER = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "emnist": "EMNIST"}
_MEMO: dict[tuple, BaseDataset] = {}
#: the sources of :mod:`pl_fedsparse.data.sources` (your own data)
SOURCES: tuple[str, ...] = ("image_folder", "tensors", "torchvision", "leaf")


def input_kind(x: Any) -> InputKind | None:
    """The kind of a dataset's inputs (see the module docstring), ``None`` when they are none of them.

    Example:
        >>> input_kind(torch.zeros(2, 3, 8, 8, dtype=torch.uint8)), input_kind(torch.zeros(2, 20))
        ('image', 'features')
        >>> input_kind(torch.zeros(2, 80, dtype=torch.int64)), input_kind(torch.zeros(2, 8, dtype=torch.uint8))
        ('tokens', None)
    """
    if isinstance(x, torch.Tensor):
        if x.ndim < 1 or x.dtype == torch.bool or x.is_complex():
            return None
        if x.dtype == torch.uint8:  # uint8 means pixels; token ids come as another integer type
            return "image" if x.ndim == 4 else None
        return "features" if x.is_floating_point() else "tokens"
    if isinstance(x, torch.utils.data.Dataset) and hasattr(x, "__getitem__") and hasattr(x, "__len__"):
        return "dataset"
    return None


@dataclass
class BaseDataset:
    """A whole dataset: the train and test splits' inputs and labels (what
    :meth:`~pl_fedsparse.data.FederatedDataModule.load_base_dataset` returns).

    Attributes:
        name: a short name for messages (one of :data:`DATASETS` for the built-in sources).
        train_x, test_x: the inputs of the train / test split, one of the kinds of :func:`input_kind`:
            ``uint8 [N, C, H, W]`` images, float features ``[N, ...]``, integer token ids ``[N, ...]``, or (slower,
            for data that does not fit in memory) a map-style ``torch.utils.data.Dataset`` whose item ``i`` is the
            input of sample ``i`` or a tuple ``(input, ...)`` (the label is taken from ``train_y``/``test_y``, so the
            partition never reads an input).
        train_y, test_y: ``int64 [N]`` labels in ``[0, num_classes)``.
        num_classes: number of classes.
        mean, std: for images, the per-channel mean / standard deviation in ``[0, 1]`` units (required); for float
            features, optional values (one, or one per entry of dimension 1) to normalise by as ``(x - mean) / std``;
            ``None`` otherwise.
        train_client, test_client: optional ``int64 [N]`` per-sample client ids for ``data.partition=natural``
            (any distinct integers; sorted, they become clients ``0 .. K-1``).
    """

    name: str
    train_x: Any
    train_y: torch.Tensor
    test_x: Any
    test_y: torch.Tensor
    num_classes: int
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    train_client: torch.Tensor | None = None
    test_client: torch.Tensor | None = None

    @property
    def kind(self) -> InputKind | None:
        """The kind of the inputs (:func:`input_kind` of ``train_x``)."""
        return input_kind(self.train_x)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one input (``(C, H, W)`` for images)."""
        if isinstance(self.train_x, torch.Tensor):
            return tuple(int(d) for d in self.train_x.shape[1:])
        first = self.train_x[0]
        first = first[0] if isinstance(first, (tuple, list)) else first
        return tuple(int(d) for d in torch.as_tensor(first).shape)


def cache_dir() -> Path:
    """The folder of decoded-dataset caches: ``$PL_FEDSPARSE_CACHE`` or ``~/.cache/pl_fedsparse``."""
    return Path(os.environ.get(CACHE_ENV, "~/.cache/pl_fedsparse")).expanduser()


def download_dir(name: str) -> Path:
    """Where a dataset is downloaded to (and looked for) when ``root`` is unset: ``cache_dir() / name``.

    Example:
        >>> download_dir("cifar10").name
        'cifar10'
    """
    return cache_dir() / name


def clear_memo() -> None:
    """Forget the in-process memo of :func:`load_dataset` (the on-disk cache is kept)."""
    _MEMO.clear()


def synthetic_params(synthetic: dict | None) -> dict[str, Any]:
    """Validate ``synthetic`` overrides and return the full parameter dict (defaults filled in).

    Example:
        >>> synthetic_params({"num_classes": 4})["num_classes"], synthetic_params(None)["size"]
        (4, 16)
    """
    synthetic = {} if synthetic is None else synthetic
    check(isinstance(synthetic, dict), "data.synthetic", synthetic, f"a dict with keys {sorted(SYNTHETIC_DEFAULTS)}")
    for key in synthetic:
        check(key in SYNTHETIC_DEFAULTS, f"data.synthetic.{key}", synthetic[key],
              f"a key among {', '.join(SYNTHETIC_DEFAULTS)}")
    params = {**SYNTHETIC_DEFAULTS, **synthetic}
    for key, low in {"num_classes": 2, "num_train": 1, "num_test": 1, "channels": 1, "size": 4, "seed": 0}.items():
        check(isinstance(params[key], int) and not isinstance(params[key], bool) and params[key] >= low,
              f"data.synthetic.{key}", params[key], f"an int >= {low}")
    noise = params["noise"]
    check(isinstance(noise, (int, float)) and not isinstance(noise, bool) and 0 <= noise < math.inf,
          "data.synthetic.noise", noise, "a number >= 0")
    params["noise"] = float(noise)
    _check_synthetic_memory(params)
    return params


def _check_synthetic_memory(params: dict[str, Any]) -> None:
    """Refuse synthetic sizes whose arrays cannot fit, before :func:`make_synthetic` allocates them: the float32
    class patterns and one split's float32 draw (two arrays each, a lower bound of the peak) plus the uint8 images."""
    pixels = params["channels"] * params["size"] ** 2
    patterns = (params["num_classes"] + 1) * pixels * 4 * 2
    draw = max(params["num_train"], params["num_test"]) * pixels * 4 * 2
    stored = (params["num_train"] + params["num_test"]) * (pixels + 8)
    sizes = ("num_train", "num_test", "channels", "size", "num_classes")
    changed = {k: params[k] for k in sizes if params[k] != SYNTHETIC_DEFAULTS[k]}
    check_fits("data.synthetic", changed or {k: params[k] for k in sizes}, patterns + draw + stored,
               f"the synthetic task's images ({params['num_train']} + {params['num_test']} of "
               f"{params['channels']}x{params['size']}x{params['size']}, {params['num_classes']} classes)")


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
            from pl_fedsparse.data.sources import source_key

            key += source_key(name, abs_root, test_fraction=test_fraction, seed=seed, image_size=image_size,
                              torchvision_class=torchvision_class, torchvision_args=torchvision_args)
    if key in _MEMO:
        return _MEMO[key]
    if name == "synthetic":
        dataset = make_synthetic(**params)
    elif name in ("cifar10", "cifar100"):
        dataset = _load_cifar(name, key[1], bool(download))
    elif name in SOURCES:
        from pl_fedsparse.data.sources import load_source

        dataset = load_source(name, key[1], bool(download), test_fraction=test_fraction, seed=seed,
                              image_size=image_size, torchvision_class=torchvision_class,
                              torchvision_args=torchvision_args)
    else:
        dataset = _load_idx_dataset(name, key[1], bool(download), emnist_split)
    _MEMO[key] = dataset
    return dataset


def make_synthetic(num_classes: int = 10, num_train: int = 6000, num_test: int = 1000, channels: int = 3,
                   size: int = 16, noise: float = 10.0, seed: int = 0) -> BaseDataset:
    """A Gaussian-mixture image classification task.

    Smooth random patterns (4×4 Gaussian noise, bilinearly upsampled to ``size``×``size``, unit pixel std) make a
    shared background ``b`` and one class pattern ``d_c`` per class; a sample of class ``c`` is
    ``2 b + d_c + noise * eps`` with i.i.d. pixel noise ``eps ~ N(0, 1)``, scaled to a pixel std of ~50 grey
    levels around 128 and clipped/quantised to uint8. ``noise`` is the per-pixel noise-to-class-signal ratio: with
    the default 10, a small MLP/CNN trained for 100 SGD steps (batch 64) reaches about 70 % test accuracy (chance
    10 %, nearest-class-mean about 80 %); 5 is easier, 20 much harder. Takes ~0.1 s with the defaults.

    Example:
        >>> d = make_synthetic(num_classes=3, num_train=30, num_test=6, size=8)
        >>> tuple(d.train_x.shape), d.train_x.dtype, d.train_y.bincount().tolist()
        ((30, 3, 8, 8), torch.uint8, [10, 10, 10])
    """
    rng = np.random.default_rng(seed)
    low = rng.standard_normal((num_classes + 1, channels, 4, 4), dtype=np.float32)
    smooth = F.interpolate(torch.from_numpy(low), size=(size, size), mode="bilinear", align_corners=False)
    smooth = smooth / smooth.flatten(1).std(dim=1).clamp_min(1e-6)[:, None, None, None]  # unit pixel std each
    protos = 2.0 * smooth[:1] + smooth[1:]  # a shared background plus a class-specific pattern
    gain = 50.0 / math.sqrt(4.0 + 1.0 + noise**2)  # overall pixel std ~50 grey levels, so clipping is rare

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.from_numpy(rng.permutation(np.arange(n) % num_classes).astype(np.int64))
        eps = torch.from_numpy(rng.standard_normal((n, channels, size, size), dtype=np.float32))
        x = protos[labels] + noise * eps
        return (x * gain + 128.0).round_().clamp_(0, 255).to(torch.uint8), labels

    train_x, train_y = draw(num_train)
    test_x, test_y = draw(num_test)
    mean, std = channel_stats(train_x)
    return BaseDataset("synthetic", train_x, train_y, test_x, test_y, num_classes, mean, std)


# ----------------------------------------------------------------------------------------------- on-disk cache
def _signature(name: str, folder: str, files: list[str], extra: str = "") -> str:
    """Hash of the dataset name, folder and every file's relative path, size and mtime."""
    skip = len(os.path.join(folder, ""))
    parts = [f"{_CACHE_VERSION}|{name}|{folder}|{extra}"]
    for path in files:
        st = os.stat(path)
        parts.append(f"{path[skip:] if path.startswith(folder) else path}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def _cache_load(path: Path) -> dict[str, torch.Tensor] | None:
    """Load a cache file; ``None`` when it is missing or unreadable (a corrupted cache is simply rebuilt)."""
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        keys = ("train_x", "train_y", "test_x", "test_y")
        if not isinstance(blob, dict) or not all(isinstance(blob.get(k), torch.Tensor) for k in keys):
            return None
        return blob
    except Exception:  # noqa: BLE001 - any unreadable cache is rebuilt
        return None


def _cache_save(path: Path, blob: dict[str, torch.Tensor]) -> None:
    """Write ``blob`` atomically (temp file in the same folder + ``os.replace``). The cache is an optimisation: a
    folder that does not take the write (read-only, full, over quota) costs a warning and the decoding next time, not
    the run."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(blob, f)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # read-only or full disk: run without a cache
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        cause = e if isinstance(e, OSError) else cause_of(e, OSError)
        reason = (cause.strerror or str(cause)) if cause is not None else str(e).splitlines()[0]
        log.warning("the dataset cache %s was not written (%s); the data will be decoded again next time "
                    "(the PL_FEDSPARSE_CACHE variable names another folder)", path, reason)


def _cached(name: str, folder: str, files: list[str], build, extra: str = "") -> dict[str, torch.Tensor]:
    """Return ``build()``'s tensors, from the cache when the source files are unchanged."""
    path = cache_dir() / f"{name}-{_signature(name, folder, files, extra)}.pt"
    blob = _cache_load(path)
    if blob is None:
        blob = build()
        _cache_save(path, blob)
    return blob


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std (in ``[0, 1]`` units) of uint8 ``[N, C, H, W]`` images, in float64 chunks."""
    total = torch.zeros(images.shape[1], dtype=torch.float64)
    squares = torch.zeros_like(total)
    for chunk in images.split(8192):
        x = chunk.to(torch.float64).div_(255.0)
        total += x.sum(dim=(0, 2, 3))
        squares += x.square_().sum(dim=(0, 2, 3))
    count = max(images.numel() // max(images.shape[1], 1), 1)
    mean = total / count
    std = (squares / count - mean.square()).clamp_min(1e-6).sqrt()
    return tuple(mean.tolist()), tuple(std.tolist())


def _to_dataset(name: str, blob: dict[str, torch.Tensor], num_classes: int) -> BaseDataset:
    mean, std = _STATS[name] if name in _STATS else channel_stats(blob["train_x"])
    train_y, test_y = blob["train_y"].long(), blob["test_y"].long()
    return BaseDataset(name, blob["train_x"], train_y, blob["test_x"], test_y, num_classes, mean, std)


# ----------------------------------------------------------------------------------------------- CIFAR
def _find_image_folder(root: str) -> Path | None:
    """``root`` or a direct sub-folder that holds ``train/<class>/`` and ``test/<class>/``."""
    base = Path(root)
    candidates = [base] + (sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else [])
    return next((c for c in candidates if (c / "train").is_dir() and (c / "test").is_dir()
                 and any(p.is_dir() for p in (c / "train").iterdir())), None)


def _list_images(split_dir: Path, classes: list[str]) -> tuple[list[str], list[int]]:
    files: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        folder = os.path.join(split_dir, cls)
        names = sorted(e.name for e in os.scandir(folder) if e.name.lower().endswith(_IMAGE_SUFFIXES) and e.is_file())
        files += [os.path.join(folder, n) for n in names]
        labels += [label] * len(names)
    return files, labels


def check_resized_images(count: int, channels: int, size: tuple[int, int]) -> None:
    """Refuse ``data.image_size`` when ``count`` images resized to it cannot fit in memory (before decoding)."""
    check_fits("data.image_size", list(size), count * channels * size[0] * size[1],
               f"{count} images of {channels}x{size[0]}x{size[1]} (uint8)")


def _decode_files(files: list[str], root: str, size: tuple[int, int] | None = None) -> torch.Tensor:
    """Decode image files to one RGB ``uint8 [N, 3, H, W]`` tensor (equal sizes required unless ``size`` resizes
    every image to ``(H, W)``) with a thread pool; chunks of JPEGs use the batched ``decode_jpeg`` (twice as fast as
    ``decode_image`` per file)."""
    from torchvision.io import ImageReadMode, decode_image, decode_jpeg

    if size is not None:
        check_resized_images(len(files), 3, size)

    def fail(i: int, why: str) -> ConfigError:
        hint = "" if size is not None else " (or set data.image_size to resize them)"
        return ConfigError(f"data.root={root!r} is invalid: image {files[i]} {why}; expected readable JPEG/PNG "
                           f"files of one size{hint}")

    def decode_range(lo: int, hi: int) -> list[torch.Tensor]:
        datas = []
        for i in range(lo, hi):
            try:
                with open(files[i], "rb") as f:
                    datas.append(torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
            except (OSError, ValueError) as exc:  # ValueError: an empty file
                raise fail(i, f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
        if all(bytes(d[:2].tolist()) == b"\xff\xd8" for d in datas):
            try:
                return decode_jpeg(datas, mode=ImageReadMode.RGB)
            except (RuntimeError, ValueError):
                pass  # find the culprit below
        imgs = []
        for i, data in zip(range(lo, hi), datas):
            try:
                imgs.append(decode_image(data, mode=ImageReadMode.RGB))
            except (RuntimeError, ValueError) as exc:
                why = ' '.join(str(exc).split()) or type(exc).__name__
                raise fail(i, f"cannot be decoded ({why})") from None
        return imgs

    if size is not None:
        from torchvision.transforms.v2.functional import resize

        plain = decode_range

        def decode_range(lo: int, hi: int) -> list[torch.Tensor]:  # the resizing variant
            return [img if tuple(img.shape[1:]) == size else resize(img, list(size), antialias=True)
                    for img in plain(lo, hi)]

    shape = decode_range(0, 1)[0].shape
    out = torch.empty((len(files), *shape), dtype=torch.uint8)

    def work(lo: int, hi: int) -> None:
        imgs = decode_range(lo, hi)
        for j, img in enumerate(imgs):
            if img.shape != shape:
                raise fail(lo + j, f"has shape {tuple(img.shape)} but {files[0]} has {tuple(shape)}")
        torch.stack(imgs, out=out[lo:hi])

    step = 1024
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        futures = [pool.submit(work, lo, min(lo + step, len(files))) for lo in range(0, len(files), step)]
        for fut in futures:
            fut.result()
    return out


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


# ----------------------------------------------------------------------------------------------- IDX datasets
_IDX_DTYPES: dict[int, str] = {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> torch.Tensor:
    """Read one IDX file (LeCun's MNIST format), plain or gzip-compressed, into a tensor.

    The magic number (two zero bytes, type code, number of dimensions), the sizes and the exact payload length are
    validated: an unreadable, non-IDX or truncated file raises a one-line :class:`ConfigError` naming it.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "x-idx1-ubyte")
        >>> _ = open(path, "wb").write(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
        >>> read_idx(path).tolist()
        [7, 8, 9]
    """
    path = os.fspath(path)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"data.root={os.path.dirname(os.path.abspath(path))!r} is invalid: IDX file {path} is "
                           f"corrupted ({why}); expected an intact (optionally gzipped) IDX file: delete it and get "
                           f"it again")

    try:
        with open(path, "rb") as f:
            raw = f.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise bad(f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'unreadable'}") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise bad(f"bad magic number {raw[:4].hex() or 'none'}")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise bad(f"header of {ndim} dimensions is incomplete")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = header + math.prod(dims) * dtype.itemsize
    if len(raw) != expected:
        raise bad(f"{len(raw)} bytes after decompression, expected {expected} for shape {tuple(dims)}")
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return torch.from_numpy(arr.astype(dtype.newbyteorder("="), copy=True))


def _idx_names(name: str, split: str) -> dict[str, str]:
    prefix = f"emnist-{split}-" if name == "emnist" else ""
    return {"train_x": f"{prefix}train-images-idx3-ubyte", "train_y": f"{prefix}train-labels-idx1-ubyte",
            "test_x": f"{prefix}t10k-images-idx3-ubyte", "test_y": f"{prefix}t10k-labels-idx1-ubyte"}


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
