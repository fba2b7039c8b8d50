"""VGG-11 with GroupNorm, as used by DisPFL (Dai et al., ICML 2022) for CIFAR.

Also home of the width-scaling helpers shared with :mod:`pl_fedsparse.models.resnet`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pl_fedsparse.errors import check
from pl_fedsparse.models.cnn import check_common, check_int

__all__ = ["VGG11GN", "scale_channels", "group_norm", "check_width"]

# VGG config "A" (VGG-11); "M" is a 2×2 max-pool.
_CFG_A: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def check_width(width_mult: Any, groups: Any) -> None:
    """Validate ``width_mult`` (a number > 0) and ``groups`` (an int >= 1)."""
    check(
        isinstance(width_mult, (int, float)) and not isinstance(width_mult, bool) and width_mult > 0,
        "model.backbone.init_args.width_mult",
        width_mult,
        "a number > 0",
    )
    check_int(groups, "groups", 1)


def scale_channels(channels: int, width_mult: float) -> int:
    """Return ``round(channels * width_mult)``, at least 1.

    Example:
        >>> scale_channels(64, 0.25), scale_channels(512, 1.0), scale_channels(64, 0.001)
        (16, 512, 1)
    """
    return max(1, int(round(channels * width_mult)))


def group_norm(channels: int, groups: int = 32) -> nn.GroupNorm:
    """``nn.GroupNorm`` over ``channels`` with the largest group count ``<= groups`` that divides ``channels``.

    Example:
        >>> group_norm(64).num_groups, group_norm(16).num_groups, group_norm(48, 32).num_groups
        (32, 16, 24)
    """
    num_groups = max(d for d in range(1, min(groups, channels) + 1) if channels % d == 0)
    return nn.GroupNorm(num_groups, channels)


class VGG11GN(nn.Module):
    """DisPFL's VGG-11 (config A) with bias convs, GroupNorm and a single linear classifier.

    Each 3×3 conv (padding 1, bias) is followed by GroupNorm and ReLU; five 2×2 max-pools bring a 32×32 input to
    1×1, which is flattened into ``Linear(512·width_mult, num_classes)``. Larger inputs are average-pooled to 1×1
    first (a no-op at 32×32). Init: Kaiming-normal (fan_out, ReLU) convs with zero bias, GroupNorm weight 1 bias 0,
    Linear weight N(0, 0.01) bias 0. **9,231,114 parameters** at width 1.0 with 10 classes. No buffers.

    Config example: ``model: {backbone: {class_path: pl_fedsparse.models.VGG11GN, init_args: {width_mult: 0.25}}}``

    Args:
        num_classes: number of output logits (>= 2).
        in_channels: input image channels.
        width_mult: multiplier of every channel count (e.g. 0.25 for CPU-sized runs).
        groups: maximum GroupNorm group count; each norm uses the largest divisor of its channels ``<= groups``.

    Example:
        >>> sum(p.numel() for p in VGG11GN().parameters())
        9231114
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width_mult: float = 1.0, groups: int = 32) -> None:
        check_common(num_classes, in_channels)
        check_width(width_mult, groups)
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for v in _CFG_A:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out = scale_channels(int(v), width_mult)
                layers += [nn.Conv2d(channels, out, kernel_size=3, padding=1, bias=True), group_norm(out, groups)]
                layers.append(nn.ReLU(inplace=True))
                channels = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, H, W]`` images (H, W >= 32) to ``[B, num_classes]`` logits."""
        x = self.features(x)
        if x.shape[-2:] != (1, 1):
            x = F.adaptive_avg_pool2d(x, 1)
        return self.classifier(torch.flatten(x, 1))
