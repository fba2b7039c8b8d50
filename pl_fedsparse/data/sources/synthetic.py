"""``data.name: synthetic``: a Gaussian-mixture image task generated from its parameters (no files; the quickstart
default).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pl_fedsparse.data.base import BaseDataset, channel_stats
from pl_fedsparse.errors import check
from pl_fedsparse.resources import check_fits

__all__ = ["SYNTHETIC_DEFAULTS", "make_synthetic", "synthetic_params"]


#: Parameters of the ``synthetic`` task; override any of them with ``load_dataset(..., synthetic={...})``.
SYNTHETIC_DEFAULTS: dict[str, Any] = {"num_classes": 10, "num_train": 6000, "num_test": 1000, "channels": 3,
                                      "size": 16, "noise": 10.0, "seed": 0}


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
