"""Decoding files into tensors: image folders (``<class>/*.jpg|png``, decoded in parallel, optionally resized) and
IDX files (plain or ``.gz``).
"""

from __future__ import annotations

import gzip
import math
import os
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from pl_fedsparse.data.png import PNG_SIGNATURE, png_damage
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.resources import check_fits

__all__ = ["check_resized_images", "read_idx"]


_IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp")


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


def _decoder_message(error: Exception) -> str:
    """A decoder's error in words, without torchvision's ``function, /path/file.cpp:line,`` prefix.

    >>> _decoder_message(RuntimeError("decode_png, /__w/vision/csrc/decode_png.cpp:62, Internal error."))
    'Internal error.'
    """
    text = " ".join(str(error).split())
    return re.sub(r"^[\w:()]+, \S+\.(?:cpp|cc|c|h):\d+, ", "", text) or type(error).__name__


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
            head = bytes(data[:len(PNG_SIGNATURE)].tolist())
            damage = png_damage(data.numpy().tobytes()) if head == PNG_SIGNATURE else None  # (libpng may crash)
            if damage is not None:
                raise fail(i, f"cannot be decoded ({damage})")
            try:
                imgs.append(decode_image(data, mode=ImageReadMode.RGB))
            except (RuntimeError, ValueError) as exc:
                raise fail(i, f"cannot be decoded ({_decoder_message(exc)})") from None
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
