"""Pure mask functions: random masks with exact counts and per-layer densities.

Masks are bool tensors shaped like the tensor they mask. Counts are exact: a tensor of ``n`` entries at density
``d`` keeps ``floor(d · n)`` entries (the DisPFL code's ``init_masks``), so a mask's density never drifts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from pl_fedsparse.errors import check

__all__ = ["random_mask", "uniform_densities", "check_density", "apply_masks"]


def check_density(value: float, param: str) -> None:
    """Raise a one-line :class:`~pl_fedsparse.errors.ConfigError` unless ``0 < value <= 1``.

    Example:
        >>> check_density(1.5, "SparseMask.density")
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: SparseMask.density=1.5 is invalid: expected a density in (0, 1]
    """
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1, param, value,
          "a density in (0, 1]")


def random_mask(shape: torch.Size | tuple[int, ...], density: float, generator: torch.Generator) -> Tensor:
    """A bool mask with exactly ``floor(density · numel)`` ones at uniformly random positions.

    Example:
        >>> m = random_mask((4, 5), 0.5, torch.Generator().manual_seed(0))
        >>> m.dtype, int(m.sum())
        (torch.bool, 10)
    """
    check_density(density, "density")
    n = math.prod(shape)
    keep = int(math.floor(density * n))
    flat = torch.zeros(n, dtype=torch.bool)
    flat[torch.randperm(n, generator=generator)[:keep]] = True
    return flat.view(tuple(shape))


def uniform_densities(shapes: Mapping[str, torch.Size | tuple[int, ...]], density: float,
                      dense_1d: bool = True) -> dict[str, float]:
    """The same density for every tensor; 1-D tensors (biases, norm affines) dense when ``dense_1d``.

    Example:
        >>> uniform_densities({"w": (3, 3), "b": (3,)}, 0.5)
        {'w': 0.5, 'b': 1.0}
    """
    check_density(density, "density")
    return {k: 1.0 if (dense_1d and len(s) <= 1) else float(density) for k, s in shapes.items()}


def apply_masks(tensors: Mapping[str, Tensor], masks: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``tensor ⊙ mask`` for every masked tensor (others unchanged), as new tensors.

    Example:
        >>> apply_masks({"w": torch.ones(3), "b": torch.ones(1)}, {"w": torch.tensor([True, False, True])})["w"]
        tensor([1., 0., 1.])
    """
    return {k: (v * masks[k].to(v.device, v.dtype)) if k in masks else v for k, v in tensors.items()}
