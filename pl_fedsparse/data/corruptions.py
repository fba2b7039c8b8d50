"""CIFAR-10-C corruptions (Hendrycks & Dietterich, ICLR 2019) for DM-PFL's test-time shift evaluation: generated on
the fly, or read from the published arrays (:class:`CIFAR10C`, ``data.cifar10c_root``).

The published benchmark has 15 corruptions (:data:`CIFAR10C_CORRUPTIONS`) at 5 severities. The generator makes 8 of
them — gaussian_noise, shot_noise, impulse_noise, defocus_blur, brightness, contrast, pixelate, jpeg_compression —
plus gaussian_blur (one of the four extra corruptions the published archive also ships); glass_blur, motion_blur,
zoom_blur, snow, frost, fog and elastic_transform exist only as the published arrays. How close each generated one is
to a reference implementation is measured by ``papers/dmpfl/cifar10c_compare.py``
(``papers/dmpfl/records/cifar10c_generator_vs_reference.txt``).

Every corruption maps a ``uint8 [n, C, H, W]`` batch to a corrupted ``uint8`` batch of the same shape at one of the
five severities, with the severity parameters of Hendrycks & Dietterich's CIFAR-10-C generation script
(``make_cifar_c.py``). Randomness (noise) comes from the ``torch.Generator`` passed in, so a corruption is
deterministic for a seed.

How each is made (with torch alone: no OpenCV/scikit-image/ImageMagick dependency). Run with the reference
implementation's parameters (``imagecorruptions``, ImageNet-C's), the deterministic ones match it within one grey
level (it truncates to ``uint8``, the generator rounds) and the noises have its statistics; the exception is
defocus_blur at disk radii of 8 and more (up to 3 grey levels), which CIFAR-10-C's radii (<= 1.5) never reach:

=================  ================================================  ===============================================
corruption         severity parameter (1 → 5)                        implementation
=================  ================================================  ===============================================
gaussian_noise     σ = .04 .06 .08 .09 .10                           exact: ``clip(x + N(0, σ²))``
shot_noise         λ = 500 250 100 75 50                             exact: ``clip(Poisson(x·λ)/λ)``
impulse_noise      amount = .01 .02 .03 .05 .07                      exact: salt & pepper per value (sk ``s&p``)
gaussian_blur      σ = .4 .6 .7 .8 1                                 Gaussian kernel (±4σ), edge-replicating padding
defocus_blur       (radius, alias σ) = (.3,.4) (.4,.5) (.5,.6)       aliased disk smoothed by a 3×3 Gaussian
                   (1,.2) (1.5,.1)                                   (as the script), reflect padding
contrast           c = .75 .5 .4 .3 .15                              exact: ``(x − channel mean)·c + mean``
brightness         +v = .05 .1 .15 .2 .3                             exact: HSV value + v, clipped (as RGB scaling)
pixelate           scale = .95 .9 .85 .75 .65                        PIL's BOX down-sampling, nearest up-sampling by
                                                                     pixel centres (PIL's NEAREST)
jpeg_compression   quality = 80 65 58 50 40                          ``torchvision.io.encode_jpeg`` (libjpeg)
=================  ================================================  ===============================================

Example:
    >>> x = torch.full((2, 3, 8, 8), 128, dtype=torch.uint8)
    >>> y = corrupt(x, "gaussian_noise", 3, torch.Generator().manual_seed(0))
    >>> y.shape, y.dtype, bool((y != x).any())
    (torch.Size([2, 3, 8, 8]), torch.uint8, True)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pl_fedsparse.errors import ConfigError, DataNotFoundError, check

__all__ = ["CIFAR10C", "CIFAR10C_CORRUPTIONS", "CORRUPTIONS", "CORRUPTION_NAMES", "SEVERITY_PARAMS", "corrupt"]

SEVERITY_PARAMS: dict[str, tuple] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
    "shot_noise": (500, 250, 100, 75, 50),
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1.0, 0.2), (1.5, 0.1)),
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),
    "jpeg_compression": (80, 65, 58, 50, 40),
}
#: the corruptions the generator makes (:func:`corrupt`)
CORRUPTIONS: tuple[str, ...] = tuple(SEVERITY_PARAMS)
#: the 15 corruptions of the published CIFAR-10-C benchmark, in the order of Hendrycks & Dietterich's Fig. 1
CIFAR10C_CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur", "snow",
    "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression")
#: every corruption name: the published 15, then the generator's others (gaussian_blur)
CORRUPTION_NAMES: tuple[str, ...] = CIFAR10C_CORRUPTIONS + tuple(c for c in CORRUPTIONS
                                                                 if c not in CIFAR10C_CORRUPTIONS)


def _gaussian_noise(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    return (x + torch.randn(x.shape, generator=gen) * c).clamp_(0, 1)


def _shot_noise(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    return (torch.poisson(x * c, generator=gen) / c).clamp_(0, 1)


def _impulse_noise(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    hit = torch.rand(x.shape, generator=gen) < c
    salt = torch.rand(x.shape, generator=gen) < 0.5
    return torch.where(hit, salt.to(x.dtype), x)


def _filter(x: Tensor, kernel: Tensor, border: str = "reflect") -> Tensor:
    """Depthwise 2-D filtering (kernel ``[k, k]``, odd ``k``) with ``border`` padding: ``"reflect"`` (OpenCV's
    default, ``BORDER_REFLECT_101``) or ``"replicate"`` (scikit-image's ``mode="nearest"``)."""
    _, ch, h, w = x.shape
    k = kernel.shape[-1]
    pad = k // 2
    if border == "replicate" or pad >= min(h, w):  # reflect padding needs pad < size: fall back to replicate
        xp = F.pad(x, (pad, pad, pad, pad), mode="replicate")
    else:
        xp = F.pad(x, (pad, pad, pad, pad), mode="reflect")
    weight = kernel.to(x.dtype).expand(ch, 1, k, k)
    return F.conv2d(xp, weight, groups=ch)


def _gaussian_kernel(sigma: float, radius: int | None = None) -> Tensor:
    r = radius if radius is not None else max(1, int(math.ceil(4 * sigma)))
    ax = torch.arange(-r, r + 1, dtype=torch.float64)
    g = torch.exp(-(ax**2) / (2 * sigma**2))
    k2 = g[:, None] * g[None, :]
    return (k2 / k2.sum()).float()


def _gaussian_blur(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    return _filter(x, _gaussian_kernel(c), border="replicate").clamp_(0, 1)  # skimage.filters.gaussian's default


def _defocus_blur(x: Tensor, c: tuple[float, float], gen: torch.Generator) -> Tensor:
    radius, alias = c
    ax = torch.arange(-8, 9, dtype=torch.float64)  # the script's 17×17 grid for radius <= 8
    disk = ((ax[:, None] ** 2 + ax[None, :] ** 2) <= radius**2).double()
    disk /= disk.sum()
    smooth = _gaussian_kernel(alias, radius=1).double()  # cv2.GaussianBlur(ksize=(3, 3), sigmaX=alias)
    kernel = F.conv2d(F.pad(disk[None, None], (1, 1, 1, 1)), smooth[None, None])[0, 0]
    nz = kernel.abs().sum(0) > 1e-12  # crop the all-zero border (same filter, smaller kernel)
    idx = torch.nonzero(nz).flatten()
    r = max(8 - int(idx.min()), int(idx.max()) - 8)
    kernel = kernel[8 - r:9 + r, 8 - r:9 + r]
    return _filter(x, (kernel / kernel.sum()).float()).clamp_(0, 1)


def _contrast(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    mean = x.mean(dim=(2, 3), keepdim=True)
    return ((x - mean) * c + mean).clamp_(0, 1)


def _brightness(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    # HSV with H and S fixed: RGB is proportional to V = max(R, G, B), so V + c is a rescaling of the pixel
    v = x.amax(dim=1, keepdim=True)
    v_new = (v + c).clamp(0, 1)
    scaled = x * (v_new / v.clamp_min(1e-12))
    return torch.where(v > 0, scaled, v_new.expand_as(x)).clamp_(0, 1)


def _box_weights(n_in: int, n_out: int) -> Tensor:
    """``[n_out, n_in]`` weights of a box down-sampling as PIL's ``BOX`` filter does it: output pixel ``i`` is the mean
    of the input pixels whose centres lie in ``[i, i + 1) * n_in / n_out`` (an area average only for whole ratios)."""
    scale = n_in / n_out
    centres = torch.arange(n_in, dtype=torch.float64) + 0.5
    lo = torch.arange(n_out, dtype=torch.float64)[:, None] * scale
    inside = ((centres[None] >= lo) & (centres[None] < lo + scale)).double()
    return (inside / inside.sum(1, keepdim=True).clamp_min(1)).float()


def _pixelate(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    h, w = x.shape[-2:]
    sh, sw = max(1, int(h * c)), max(1, int(w * c))
    small = torch.einsum("ij,ncjk,lk->ncil", _box_weights(h, sh), x, _box_weights(w, sw))
    return F.interpolate(small, size=(h, w), mode="nearest-exact")  # PIL's NEAREST: by pixel centres


def _jpeg(x: Tensor, c: int, gen: torch.Generator) -> Tensor:
    from torchvision.io import decode_jpeg, encode_jpeg

    imgs = (x * 255).round_().to(torch.uint8)
    out = [decode_jpeg(encode_jpeg(img, quality=int(c))) for img in imgs]
    return torch.stack(out).float() / 255


_FUNCS: dict[str, Callable[..., Tensor]] = {
    "gaussian_noise": _gaussian_noise, "shot_noise": _shot_noise, "impulse_noise": _impulse_noise,
    "gaussian_blur": _gaussian_blur, "defocus_blur": _defocus_blur, "contrast": _contrast,
    "brightness": _brightness, "pixelate": _pixelate, "jpeg_compression": _jpeg,
}


def corrupt(images: Tensor, name: str, severity: int, generator: torch.Generator | None = None) -> Tensor:
    """Apply corruption ``name`` at ``severity`` (1-5) to a ``uint8 [n, C, H, W]`` batch (CPU).

    Args:
        images: uint8 images.
        name: one of :data:`CORRUPTIONS`.
        severity: 1 (mildest) to 5.
        generator: source of the noise (a fixed seed gives identical output).

    Returns:
        The corrupted uint8 batch, rounded to the nearest integer (the reference implementation, ``imagecorruptions``,
        truncates: its values are on average about half a grey level lower).

    Example:
        >>> x = torch.randint(0, 256, (1, 3, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        >>> a = corrupt(x, "shot_noise", 5, torch.Generator().manual_seed(1))
        >>> b = corrupt(x, "shot_noise", 5, torch.Generator().manual_seed(1))
        >>> torch.equal(a, b), torch.equal(a, x)
        (True, False)
    """
    check(name in SEVERITY_PARAMS, "corruption", name, "one of " + ", ".join(CORRUPTIONS))
    check(isinstance(severity, int) and not isinstance(severity, bool) and 1 <= severity <= 5, "severity", severity,
          "an int in 1..5")
    check(isinstance(images, Tensor) and images.dtype == torch.uint8 and images.ndim == 4, "images",
          getattr(images, "shape", type(images).__name__), "a uint8 tensor [n, C, H, W]")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)
    x = images.detach().cpu().float() / 255
    if len(x) == 0:
        return images.cpu().clone()
    y = _FUNCS[name](x, SEVERITY_PARAMS[name][severity - 1], gen)
    return (y * 255).round_().clamp_(0, 255).to(torch.uint8)


class CIFAR10C:
    """The published CIFAR-10-C arrays in a folder (Hendrycks & Dietterich's release), checked against the base test
    split they corrupt.

    Layout: ``<corruption>.npy`` for each of :data:`CIFAR10C_CORRUPTIONS`, ``uint8`` of shape ``(5·N, H, W, C)`` —
    severity 1's ``N`` images, then severity 2's, ..., each block in the order of the base test split — and
    ``labels.npy`` of shape ``(5·N,)``. The published arrays have ``N = 10000`` images of 32 × 32 × 3 in the original
    CIFAR-10 test order (shape ``(50000, 32, 32, 3)``); ``N`` is read as ``len(labels.npy) / 5``, so a smaller array in
    the same layout works too, and so does CIFAR-100-C's. ``gaussian_blur.npy`` (an extra corruption of the published
    archive, and one the generator makes) is read when it is there.

    The arrays are memory-mapped: a view reads only its rows, and a pickled reader (e.g. on a Ray worker) carries the
    folder, not the data. Every problem is one :class:`~pl_fedsparse.errors.ConfigError` line naming ``param``, the
    folder, the file and the expected shape (:class:`~pl_fedsparse.errors.DataNotFoundError` for missing files).

    Args:
        root: the folder.
        test_labels: the base test split's labels (``int [N]``); ``labels.npy`` must repeat them for every severity.
        image_shape: the base images' ``(C, H, W)``.
        param: the configuration name used in messages.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     CIFAR10C(d, np.zeros(4, np.int64), (3, 32, 32))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.DataNotFoundError: data.cifar10c_root='...' is invalid: missing gaussian_noise.npy, ...
    """

    def __init__(self, root: str | os.PathLike[str], test_labels: Any, image_shape: tuple[int, ...],
                 param: str = "data.cifar10c_root") -> None:
        self.root, self.param = os.fspath(root), param
        labels_ref = np.asarray(test_labels, dtype=np.int64)
        n = len(labels_ref)
        check(len(image_shape) == 3, param, self.root, f"null for inputs of shape {tuple(image_shape)} (not images)")
        ch, h, w = (int(v) for v in image_shape)
        self._expected = (f"the published CIFAR-10-C layout: <corruption>.npy of shape ({5 * n}, {h}, {w}, {ch}) "
                          f"uint8 (5 severities x the {n} base test images) for each of the 15 corruptions "
                          f"({', '.join(CIFAR10C_CORRUPTIONS)}) and labels.npy of shape ({5 * n},)")
        if not os.path.isdir(self.root):
            raise DataNotFoundError(f"{self._where()} no such folder; expected a folder holding {self._expected}")
        required = [*CIFAR10C_CORRUPTIONS, "labels"]
        missing = [f"{name}.npy" for name in required if not os.path.isfile(self._path(name))]
        if missing:
            raise DataNotFoundError(f"{self._where()} missing {', '.join(missing)}; expected {self._expected}")
        labels = self._load("labels")
        if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or len(labels) % 5:
            raise ConfigError(f"{self._where()} labels.npy has shape {labels.shape} {labels.dtype}; "
                              f"expected {self._expected}")
        per = len(labels) // 5
        if per != n:
            raise ConfigError(f"{self._where()} labels.npy has {len(labels)} rows ({per} per severity) but the base "
                              f"test split has {n} images; expected {self._expected}")
        blocks = np.asarray(labels).reshape(5, n)
        wrong = int((blocks != labels_ref[None]).any(axis=0).sum())
        if wrong:
            raise ConfigError(f"{self._where()} labels.npy differs from the base test labels at {wrong} of {n} "
                              f"positions; expected the base test split in the published order (the original CIFAR-10 "
                              f"test order, as torchvision's CIFAR10 files have it; an ImageFolder copy is sorted by "
                              f"class)")
        #: rows per severity (``N``)
        self.rows_per_severity = n
        self._shape = (5 * n, h, w, ch)
        extras = [c for c in CORRUPTION_NAMES if c not in CIFAR10C_CORRUPTIONS and os.path.isfile(self._path(c))]
        #: the corruptions read from the folder: the 15, then any extra found (gaussian_blur)
        self.names: tuple[str, ...] = CIFAR10C_CORRUPTIONS + tuple(extras)
        self._arrays: dict[str, np.ndarray] = {}
        for name in self.names:
            self._arrays[name] = self._checked(name)

    def _where(self) -> str:
        return f"{self.param}={self.root!r} is invalid:"

    def _path(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.npy")

    def _load(self, name: str) -> np.ndarray:
        try:
            return np.load(self._path(name), mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ConfigError(f"{self._where()} {name}.npy is not a readable .npy array ({' '.join(str(e).split())}); "
                              f"expected {self._expected}") from None

    def _checked(self, name: str) -> np.ndarray:
        arr = self._load(name)
        if arr.dtype != np.uint8 or tuple(arr.shape) != self._shape:
            raise ConfigError(f"{self._where()} {name}.npy has shape {tuple(arr.shape)} {arr.dtype}; "
                              f"expected {self._expected}")
        return arr

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = {}  # memory maps are reopened where the reader is unpickled
        return state

    def images(self, name: str, severity: int, rows: Any) -> Tensor:
        """The published images of base test rows ``rows`` under corruption ``name`` at ``severity`` (1-5), as
        ``uint8 [len(rows), C, H, W]`` (in the order of ``rows``).

        Args:
            name: one of :attr:`names`.
            severity: 1 (mildest) to 5.
            rows: indices into the base test split.
        """
        check(name in self.names, "corruption", name, f"one of {', '.join(self.names)} (read from {self.root})")
        check(isinstance(severity, int) and not isinstance(severity, bool) and 1 <= severity <= 5, "severity",
              severity, "an int in 1..5")
        idx = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = self.rows_per_severity
        check(len(idx) == 0 or (0 <= idx.min() and idx.max() < n), "rows", f"[{idx.min()}..{idx.max()}]"
              if len(idx) else "[]", f"indices in [0, {n})")
        if name not in self._arrays:
            self._arrays[name] = self._checked(name)
        block = np.asarray(self._arrays[name][(severity - 1) * n + idx])
        return torch.from_numpy(np.ascontiguousarray(block.transpose(0, 3, 1, 2)))
