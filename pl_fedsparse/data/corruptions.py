"""CIFAR-10-C-style corruptions generated on the fly (Hendrycks & Dietterich, ICLR 2019), for DM-PFL's test-time
shift evaluation.

Every corruption maps a ``uint8 [n, C, H, W]`` batch to a corrupted ``uint8`` batch of the same shape at one of the
five severities, with the severity parameters of Hendrycks & Dietterich's CIFAR-10-C generation script
(``make_cifar_c.py``). Randomness (noise) comes from the ``torch.Generator`` passed in, so a corruption is
deterministic for a seed.

What is the same and what is approximated (so that no OpenCV/scikit-image/ImageMagick dependency is needed):

=================  ================================================  ===============================================
corruption         severity parameter (1 → 5)                        implementation
=================  ================================================  ===============================================
gaussian_noise     σ = .04 .06 .08 .09 .10                           exact: ``clip(x + N(0, σ²))``
shot_noise         λ = 500 250 100 75 50                             exact: ``clip(Poisson(x·λ)/λ)``
impulse_noise      amount = .01 .02 .03 .05 .07                      exact: salt & pepper per value (sk ``s&p``)
gaussian_blur      σ = .4 .6 .7 .8 1                                 Gaussian kernel (±4σ), reflect padding
defocus_blur       (radius, alias σ) = (.3,.4) (.4,.5) (.5,.6)       aliased disk smoothed by a 3×3 Gaussian
                   (1,.2) (1.5,.1)                                   (as the script), reflect padding
contrast           c = .75 .5 .4 .3 .15                              exact: ``(x − channel mean)·c + mean``
brightness         +v = .05 .1 .15 .2 .3                             exact: HSV value + v, clipped (as RGB scaling)
pixelate           scale = .95 .9 .85 .75 .65                        area down-sampling, nearest up-sampling
                                                                     (the script: PIL BOX both ways)
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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from pl_fedsparse.errors import check

__all__ = ["CORRUPTIONS", "SEVERITY_PARAMS", "corrupt"]

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
#: the corruption names, in the order of Hendrycks & Dietterich's tables
CORRUPTIONS: tuple[str, ...] = tuple(SEVERITY_PARAMS)


def _gaussian_noise(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    return (x + torch.randn(x.shape, generator=gen) * c).clamp_(0, 1)


def _shot_noise(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    return (torch.poisson(x * c, generator=gen) / c).clamp_(0, 1)


def _impulse_noise(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    hit = torch.rand(x.shape, generator=gen) < c
    salt = torch.rand(x.shape, generator=gen) < 0.5
    return torch.where(hit, salt.to(x.dtype), x)


def _filter(x: Tensor, kernel: Tensor) -> Tensor:
    """Depthwise 2-D filtering with reflect padding (kernel ``[k, k]``, odd ``k``)."""
    _, ch, h, w = x.shape
    k = kernel.shape[-1]
    pad = k // 2
    if pad >= min(h, w):  # reflect padding needs pad < size: fall back to replicate
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
    return _filter(x, _gaussian_kernel(c)).clamp_(0, 1)


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


def _pixelate(x: Tensor, c: float, gen: torch.Generator) -> Tensor:
    h, w = x.shape[-2:]
    small = F.interpolate(x, size=(max(1, int(h * c)), max(1, int(w * c))), mode="area")
    return F.interpolate(small, size=(h, w), mode="nearest")


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
        The corrupted uint8 batch (rounded to the nearest integer, as CIFAR-10-C stores it).

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
