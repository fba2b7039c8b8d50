"""CIFAR ResNet-18 (kuangliu/pytorch-cifar layout) with GroupNorm, as used by DisPFL (Dai et al., ICML 2022)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pl_fedsparse.models.cnn import check_common
from pl_fedsparse.models.vgg import check_width, group_norm, scale_channels

__all__ = ["BasicBlock", "ResNet18GN"]


class BasicBlock(nn.Module):
    """conv3×3-GN-ReLU-conv3×3-GN plus shortcut (conv1×1+GN when the stride or the width changes), then ReLU.

    Args:
        in_planes: input channels.
        planes: output channels.
        stride: stride of the first conv and of the shortcut.
        groups: maximum GroupNorm group count.
    """

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, groups: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.gn1 = group_norm(planes, groups)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.gn2 = group_norm(planes, groups)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, kernel_size=1, stride=stride, bias=False),
                group_norm(planes, groups),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18GN(nn.Module):
    """kuangliu's CIFAR ResNet-18 with every BatchNorm replaced by GroupNorm (DisPFL's ``resnet18``).

    3×3 stem conv (stride 1, no bias)-GN-ReLU, no max-pool; four stages of two :class:`BasicBlock` s with
    64/128/256/512 channels (×``width_mult``) and strides 1/2/2/2; global average pool (``avg_pool2d(out, 4)`` at
    32×32 input, adaptive here so other sizes work), flatten, ``Linear(512·width_mult, num_classes)``.
    Parameter names follow kuangliu's (``layer3.0.conv2.weight``, ``layer2.0.shortcut.0.weight``) with norms
    called ``gn*``. **11,173,962 parameters** with 10 classes, 11,220,132 with 100. No buffers.

    Config example: ``model: {backbone: {class_path: pl_fedsparse.models.ResNet18GN, init_args: {num_classes: 100}}}``

    Args:
        num_classes: number of output logits (>= 2).
        in_channels: input image channels.
        width_mult: multiplier of every channel count (e.g. 0.25 for CPU-sized runs).
        groups: maximum GroupNorm group count; each norm uses the largest divisor of its channels ``<= groups``.

    Example:
        >>> sum(p.numel() for p in ResNet18GN().parameters())
        11173962
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width_mult: float = 1.0, groups: int = 32) -> None:
        check_common(num_classes, in_channels)
        check_width(width_mult, groups)
        super().__init__()
        widths = [scale_channels(c, width_mult) for c in (64, 128, 256, 512)]
        self.in_planes = widths[0]
        self.conv1 = nn.Conv2d(in_channels, widths[0], kernel_size=3, stride=1, padding=1, bias=False)
        self.gn1 = group_norm(widths[0], groups)
        self.layer1 = self._make_layer(widths[0], 2, stride=1, groups=groups)
        self.layer2 = self._make_layer(widths[1], 2, stride=2, groups=groups)
        self.layer3 = self._make_layer(widths[2], 2, stride=2, groups=groups)
        self.layer4 = self._make_layer(widths[3], 2, stride=2, groups=groups)
        self.linear = nn.Linear(widths[3], num_classes)

    def _make_layer(self, planes: int, num_blocks: int, stride: int, groups: int) -> nn.Sequential:
        blocks: list[nn.Module] = []
        for s in [stride] + [1] * (num_blocks - 1):
            blocks.append(BasicBlock(self.in_planes, planes, s, groups))
            self.in_planes = planes
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, H, W]`` images to ``[B, num_classes]`` logits."""
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.linear(torch.flatten(out, 1))
