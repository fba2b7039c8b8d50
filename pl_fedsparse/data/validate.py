"""A base dataset checked before round 0 (what a user's own ``load_base_dataset`` or source returns): its type, the
lengths and dtypes of its tensors, finite features and labels in range; one line naming what is wrong otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from pl_fedsparse.data.base import BaseDataset, input_kind
from pl_fedsparse.errors import ConfigError

__all__ = ["validate_base_dataset"]


# ----------------------------------------------------------------------------------------------- validation
def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"a numpy {x.dtype} array of shape {x.shape} (expected a torch tensor)"
    return f"a {type(x).__name__}"


def validate_base_dataset(base: Any, owner: str) -> BaseDataset:
    """Check what a source or a :meth:`~pl_fedsparse.data.FederatedDataModule.load_base_dataset` returned.

    Labels and client ids given as arrays become ``int64`` tensors, float features ``float32`` and token ids
    ``int64``; a dataset that needs none of this (every built-in image dataset) is returned as is.

    Args:
        base: the returned object.
        owner: who returned it, for messages (``"MyData.load_base_dataset()"``, ``"data.name='tensors'"``).

    Raises:
        ConfigError: one line naming ``owner`` and the problem (wrong type, lengths differ, labels out of range, no
            test split, bad mean/std or client ids).

    Example:
        >>> bad = BaseDataset("x", torch.zeros(4, 3), torch.tensor([0, 1, 2, 0]), torch.zeros(2, 3),
        ...                   torch.tensor([0, 1]), num_classes=2)
        >>> validate_base_dataset(bad, "Mine.load_base_dataset()")
        Traceback (most recent call last):
        ...
        pl_fedsparse.errors.ConfigError: Mine.load_base_dataset() returned train_y with a label 2: expected labels in [0, 2) (num_classes=2)
    """
    def fail(what: str, expected: str) -> ConfigError:
        return ConfigError(f"{owner} returned {what}: expected {expected}")

    if not isinstance(base, BaseDataset):
        raise fail(_describe(base), "a pl_fedsparse.data.BaseDataset")
    nc = base.num_classes
    if not (isinstance(nc, (int, np.integer)) and not isinstance(nc, bool) and nc >= 1):
        raise fail(f"num_classes={nc!r}", "an int >= 1")
    changes: dict[str, Any] = {}
    kinds = ("uint8 images [N, C, H, W], float features [N, ...], integer token ids [N, ...] or a map-style "
             "torch.utils.data.Dataset")
    kind = input_kind(base.train_x)
    for split in ("train", "test"):
        x = getattr(base, f"{split}_x")
        if input_kind(x) is None:
            raise fail(f"{split}_x as {_describe(x)}", kinds)
        if input_kind(x) != kind:
            raise fail(f"test_x as {_describe(x)} and train_x as {_describe(base.train_x)}", "inputs of one kind")
        if isinstance(x, torch.Tensor):
            if x.shape[1:] != base.train_x.shape[1:]:
                raise fail(f"inputs of shapes {tuple(base.train_x.shape[1:])} (train) and {tuple(x.shape[1:])} "
                           f"(test)", "one input shape")
            if kind == "features" and x.dtype != torch.float32:
                changes[f"{split}_x"] = x.float()
            if kind == "tokens" and x.dtype != torch.int64:
                changes[f"{split}_x"] = x.long()
        y = getattr(base, f"{split}_y")
        if len(y) == 0:
            raise fail(f"no {split} split (0 samples)", f"at least one {split} sample")
        if not isinstance(y, torch.Tensor):
            try:
                y = torch.as_tensor(np.asarray(y))
            except (TypeError, ValueError, RuntimeError):
                raise fail(f"{split}_y as {_describe(y)}", "int64 labels [N]") from None
        if y.ndim != 1 or y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
            raise fail(f"{split}_y as {_describe(y)}", "int64 labels [N]")
        if y.dtype != torch.int64 or y is not getattr(base, f"{split}_y"):
            changes[f"{split}_y"] = y = y.long()
        if len(x) != len(y):
            raise fail(f"{split}_x of length {len(x)} and {split}_y of length {len(y)}", "one label per input")
        if kind == "features" and isinstance(x, torch.Tensor):
            finite = torch.isfinite(x.reshape(len(x), -1)).all(dim=1) if len(x) else torch.ones(0, dtype=torch.bool)
            if not bool(finite.all()):
                bad = (~finite).nonzero().reshape(-1)
                raise fail(f"{split}_x with non-finite values (NaN or inf) in {len(bad)} row(s), the first row "
                           f"{int(bad[0])}", "finite features (drop or impute those rows)")
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= nc:
            raise fail(f"{split}_y with a label {lo if lo < 0 else hi}", f"labels in [0, {nc}) (num_classes={nc})")
    mean, std = base.mean, base.std
    if kind == "image":
        c = int(base.train_x.shape[1])
        ok = mean is not None and std is not None and len(mean) == c and len(std) == c and min(std) > 0
        if not ok:
            raise fail(f"mean={mean!r}, std={std!r}", f"{c} per-channel values each in [0, 1] units, std > 0 "
                                                      f"(pl_fedsparse.data.datasets.channel_stats computes them)")
    elif kind == "features" and (mean is not None or std is not None):
        width = int(base.train_x.shape[1]) if base.train_x.ndim >= 2 else 1
        ok = mean is not None and std is not None and len(mean) in (1, width) and len(std) == len(mean) \
            and min(std) > 0
        if not ok:
            raise fail(f"mean={mean!r}, std={std!r}", f"both None, or 1 or {width} values each with std > 0")
    elif mean is not None or std is not None:
        raise fail(f"mean={mean!r}, std={std!r} for {kind} inputs", "None (only images and float features are "
                                                                    "normalised)")
    if base.test_client is not None and base.train_client is None:
        raise fail("test_client without train_client", "train_client ids too (or neither)")
    for split in ("train", "test"):
        ids = getattr(base, f"{split}_client")
        if ids is None:
            continue
        t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(np.asarray(ids))
        n = len(getattr(base, f"{split}_y"))
        if t.ndim != 1 or t.is_floating_point() or t.dtype == torch.bool or len(t) != n:
            raise fail(f"{split}_client as {_describe(ids)}", f"{n} integer client ids (one per {split} sample)")
        if t.dtype != torch.int64 or t is not ids:
            changes[f"{split}_client"] = t.long()
    return dataclasses.replace(base, **changes) if changes else base
