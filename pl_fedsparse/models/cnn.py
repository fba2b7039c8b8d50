"""Small CNN / MLP backbones used by the reimplemented papers (LeNet, LEAF CNN, McMahan CNN, MLP).

All models are plain :class:`torch.nn.Module` s without buffers (their ``state_dict`` holds exactly their
parameters), take float images ``[B, C, H, W]`` and return logits ``[B, num_classes]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pl_fedsparse.errors import check

__all__ = ["LeNetCIFAR", "CNNFEMNIST", "McMahanCNN", "MLP"]

_PREFIX = "model.backbone.init_args."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: Any, name: str, minimum: int) -> None:
    """Raise :class:`~pl_fedsparse.errors.ConfigError` unless ``value`` is an int ``>= minimum``.

    Args:
        value: the value received.
        name: the constructor argument name (prefixed with ``model.backbone.init_args.`` in the message).
        minimum: the smallest allowed value.
    """
    check(_is_int(value) and value >= minimum, _PREFIX + name, value, f"an int >= {minimum}")


def check_common(num_classes: Any, in_channels: Any, input_size: Any = None, min_size: int = 1) -> None:
    """Validate the arguments every backbone shares (``input_size`` is skipped when ``None``)."""
    check_int(num_classes, "num_classes", 2)
    check_int(in_channels, "in_channels", 1)
    if input_size is not None:
        check_int(input_size, "input_size", min_size)


def _two_conv_pool_side(size: int, kernel: int, padding: int) -> int:
    """Spatial side after two (conv ``kernel`` with ``padding``, stride 1) + maxpool(2) stages."""
    for _ in range(2):
        size = (size + 2 * padding - kernel + 1) // 2
    return size


class _TwoConvNet(nn.Module):
    """conv-ReLU-pool ×2 feature extractor shared by the CNNs below; subclasses add ``fc*`` layers."""

    def __init__(self, in_channels: int, padding: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, kernel_size=5, padding=padding)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5, padding=padding)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Return the flattened conv features of ``x``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return torch.flatten(x, 1)


class LeNetCIFAR(_TwoConvNet):
    """pFedGate's ``AdaptedLeNet`` for CIFAR-10/100.

    conv5×5(in→32)-ReLU-pool2, conv5×5(32→64)-ReLU-pool2, flatten (64·5·5 = 1600 at 32×32),
    fc 1600→120-ReLU, fc 120→84-ReLU, fc 84→num_classes. **256,830 parameters** for 3×32×32 input and 10 classes.

    Config example: ``model: {backbone: {class_path: pl_fedsparse.models.LeNetCIFAR, init_args: {num_classes: 10}}}``

    Args:
        num_classes: number of output logits (>= 2).
        in_channels: input image channels.
        input_size: input image side (>= 16).

    Example:
        >>> sum(p.numel() for p in LeNetCIFAR().parameters())
        256830
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, input_size: int = 32) -> None:
        check_common(num_classes, in_channels, input_size, min_size=16)
        super().__init__(in_channels, padding=0)
        side = _two_conv_pool_side(input_size, kernel=5, padding=0)
        self.fc1 = nn.Linear(64 * side * side, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, H, W]`` images to ``[B, num_classes]`` logits."""
        x = F.relu(self.fc1(self.features(x)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class CNNFEMNIST(_TwoConvNet):
    """The LEAF FEMNIST CNN as used by pFedGate.

    conv5×5(in→32, no padding)-ReLU-pool2, conv5×5(32→64)-ReLU-pool2 (28→24→12→8→4, flatten 64·4·4 = 1024),
    fc 1024→2048-ReLU, fc 2048→num_classes. **2,278,334 parameters** for 62 classes (2,171,786 for 10).

    Config example: ``model: {backbone: {class_path: pl_fedsparse.models.CNNFEMNIST, init_args: {num_classes: 62}}}``

    Args:
        num_classes: number of output logits (>= 2).
        in_channels: input image channels.
        input_size: input image side (>= 16).

    Example:
        >>> sum(p.numel() for p in CNNFEMNIST().parameters())
        2278334
    """

    def __init__(self, num_classes: int = 62, in_channels: int = 1, input_size: int = 28) -> None:
        check_common(num_classes, in_channels, input_size, min_size=16)
        super().__init__(in_channels, padding=0)
        side = _two_conv_pool_side(input_size, kernel=5, padding=0)
        self.fc1 = nn.Linear(64 * side * side, 2048)
        self.fc2 = nn.Linear(2048, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, H, W]`` images to ``[B, num_classes]`` logits."""
        return self.fc2(F.relu(self.fc1(self.features(x))))


class McMahanCNN(_TwoConvNet):
    """The CNN of McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data".

    conv5×5(in→32, pad 2)-ReLU-pool2, conv5×5(32→64, pad 2)-ReLU-pool2, fc 64·(s//4)²→512-ReLU, fc 512→num_classes.
    **1,663,370 parameters** for MNIST (1×28×28, 10 classes); 2,156,490 for CIFAR (3×32×32, 10 classes).

    Config example: ``model: {backbone: {class_path: pl_fedsparse.models.McMahanCNN, init_args: {num_classes: 10}}}``

    Args:
        num_classes: number of output logits (>= 2).
        in_channels: input image channels.
        input_size: input image side (>= 4).

    Example:
        >>> sum(p.numel() for p in McMahanCNN().parameters())
        1663370
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, input_size: int = 28) -> None:
        check_common(num_classes, in_channels, input_size, min_size=4)
        super().__init__(in_channels, padding=2)
        side = _two_conv_pool_side(input_size, kernel=5, padding=2)
        self.fc1 = nn.Linear(64 * side * side, 512)
        self.fc2 = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, C, H, W]`` images to ``[B, num_classes]`` logits."""
        return self.fc2(F.relu(self.fc1(self.features(x))))


class MLP(nn.Module):
    """A fully connected ReLU network on the flattened input (e.g. McMahan et al. 2017's 2NN: 784-200-200-10).

    **199,210 parameters** with the defaults (1×28×28 input, hidden ``[200, 200]``, 10 classes).

    Config example: ``model: {backbone: {class_path: pl_fedsparse.models.MLP, init_args: {hidden: [200, 200]}}}``

    Args:
        num_classes: number of output logits (>= 2).
        in_features: flattened input size; defaults to ``in_channels * input_size ** 2``.
        hidden: widths of the hidden layers (may be empty: a linear model).
        in_channels: input image channels (used only when ``in_features`` is ``None``).
        input_size: input image side (used only when ``in_features`` is ``None``).

    Example:
        >>> sum(p.numel() for p in MLP().parameters())
        199210
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_features: int | None = None,
        hidden: Sequence[int] = (200, 200),
        in_channels: int = 1,
        input_size: int = 28,
    ) -> None:
        check_common(num_classes, in_channels, input_size)
        if in_features is not None:
            check_int(in_features, "in_features", 1)
        check(
            isinstance(hidden, Sequence) and not isinstance(hidden, str) and all(_is_int(h) and h >= 1 for h in hidden),
            _PREFIX + "hidden",
            hidden,
            "a list of ints >= 1",
        )
        super().__init__()
        width = in_features if in_features is not None else in_channels * input_size * input_size
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``[B, ...]`` inputs (flattened to ``[B, in_features]``) to ``[B, num_classes]`` logits."""
        return self.layers(torch.flatten(x, 1))
