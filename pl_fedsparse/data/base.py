"""What every data source produces: a :class:`BaseDataset` (the whole train and test splits in memory as tensors,
``int64 [N]`` labels), the kinds of inputs it may hold (:func:`input_kind`) and per-channel statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["BaseDataset", "InputKind", "channel_stats", "input_kind"]


#: the kinds of inputs a :class:`BaseDataset` may hold (see the module docstring)
InputKind = Literal["image", "features", "tokens", "dataset"]


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
