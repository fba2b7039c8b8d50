"""A fast batch iterator over uint8 images already in memory (CPU or GPU).

:class:`TensorBatchLoader` replaces ``torch.utils.data.DataLoader`` for the small in-memory datasets of federated
learning: a batch is one advanced-indexing gather of the uint8 tensor followed by vectorised normalisation and
(optionally) CIFAR augmentation, with no per-sample Python work and no worker processes. It is a plain iterable with
``__len__``, which ``lightning.Trainer.fit(model, train_dataloaders=loader)`` accepts.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pl_fedsparse.errors import check

__all__ = ["TensorBatchLoader", "normalize", "epoch_seed"]


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` -> float ``(x / 255 - mean) / std`` per channel (on the images' device).

    Example:
        >>> normalize(torch.full((1, 1, 1, 1), 255, dtype=torch.uint8), [0.5], [0.5]).item()
        1.0
    """
    scale, shift = _affine(mean, std, images.device)
    return images.float() * scale + shift


def _affine(mean: Sequence[float], std: Sequence[float], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    m = torch.as_tensor(tuple(mean), dtype=torch.float32, device=device).view(1, -1, 1, 1)
    s = torch.as_tensor(tuple(std), dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return 1.0 / (255.0 * s), -m / s


def _as_index_tensor(values: torch.Tensor | np.ndarray) -> torch.Tensor:
    """int64 tensor from a tensor or (possibly read-only) array, copying arrays."""
    if isinstance(values, torch.Tensor):
        return values.long()
    return torch.from_numpy(np.array(values, dtype=np.int64, copy=True))


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed mixing ``seed`` and ``epoch`` (distinct streams for distinct pairs)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


class TensorBatchLoader:
    """Iterate ``(x, y)`` batches of normalised float images from uint8 tensors in memory.

    Every ``__iter__`` (an epoch) seeds a CPU ``torch.Generator`` with ``epoch_seed(generator_seed, epoch)`` and
    increments ``epoch``, so consecutive epochs differ while the whole sequence is reproducible from the seed
    (:meth:`set_epoch` rewinds it). The generator draws the permutation and the augmentation parameters.

    Augmentation (``augment=True``) is the standard CIFAR one, vectorised on the batch: random crop back to the
    original size from the image zero-padded by 4 pixels on each side, and a random horizontal flip (p = 0.5).
    Padding happens *after* normalisation, so the border is the per-channel mean rather than black pixels.

    Args:
        images: ``uint8 [n, C, H, W]`` images (or the base tensor when ``indices`` selects from it).
        labels: ``int [n]`` labels (tensor or array), aligned with ``images``.
        batch_size: samples per batch.
        shuffle: draw a random permutation per epoch (else keep the order).
        generator_seed: seed of the per-epoch generator; ``None`` draws one from torch's global RNG.
        mean: per-channel mean in ``[0, 1]`` units.
        std: per-channel standard deviation in ``[0, 1]`` units.
        augment: apply random crop (padding 4) + horizontal flip.
        drop_last: drop the last incomplete batch.
        device: move the images and labels there once (GPU-resident batches); ``None`` keeps them where they are.
        indices: optional ``int [m]`` rows of ``images``/``labels`` to iterate over (avoids copying a client's data).

    Example:
        >>> x = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1)
        >>> loader = TensorBatchLoader(x, torch.arange(10), 4, shuffle=False, generator_seed=0, mean=[0], std=[1])
        >>> len(loader), [tuple(yb.tolist()) for _, yb in loader]
        (3, [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)])
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | np.ndarray, batch_size: int, shuffle: bool,
                 generator_seed: int | None, mean: Sequence[float], std: Sequence[float], augment: bool = False,
                 drop_last: bool = False, device: str | torch.device | None = None,
                 indices: torch.Tensor | np.ndarray | None = None) -> None:
        check(isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.ndim == 4, "images",
              getattr(images, "shape", type(images).__name__), "a uint8 tensor [n, C, H, W]")
        check(isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1,
              "data.batch_size", batch_size, "an int >= 1")
        check(len(mean) == images.shape[1] and len(std) == images.shape[1] and min(std) > 0, "mean/std",
              (tuple(mean), tuple(std)), f"{images.shape[1]} values each, std > 0")
        check(generator_seed is None or (isinstance(generator_seed, int) and generator_seed >= 0), "generator_seed",
              generator_seed, "None or an int >= 0")
        labels = _as_index_tensor(labels)
        check(labels.ndim == 1 and len(labels) == len(images), "labels", tuple(labels.shape),
              f"shape ({len(images)},) aligned with images")
        if device is not None:
            images, labels = images.to(device), labels.to(device)
        self.images, self.labels = images, labels
        self.indices = None if indices is None else _as_index_tensor(indices).to(images.device)
        self.batch_size, self.shuffle, self.augment, self.drop_last = batch_size, bool(shuffle), bool(augment), \
            bool(drop_last)
        self.generator_seed = int(torch.randint(0, 2**62, (1,)).item()) if generator_seed is None else generator_seed
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)
        self._scale, self._shift = _affine(self.mean, self.std, images.device)
        self.epoch = 0

    @property
    def num_samples(self) -> int:
        """Number of samples iterated per epoch (before ``drop_last``)."""
        return len(self.images) if self.indices is None else len(self.indices)

    @property
    def device(self) -> torch.device:
        """Where the batches are produced."""
        return self.images.device

    def __len__(self) -> int:
        n = self.num_samples
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch counter used to seed the next ``__iter__``."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(epoch_seed(self.generator_seed, self.epoch))
        self.epoch += 1
        n = self.num_samples
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        order = order.to(self.device)
        if self.indices is not None:
            order = self.indices[order]
        for b in range(len(self)):
            rows = order[b * self.batch_size:(b + 1) * self.batch_size]
            x = self.images[rows].float().mul_(self._scale).add_(self._shift)
            if self.augment:
                x = self._augment(x, gen)
            yield x, self.labels[rows]

    def _augment(self, x: torch.Tensor, gen: torch.Generator, pad: int = 4) -> torch.Tensor:
        """Random crop (zero padding ``pad``) + horizontal flip of a float batch with one gather."""
        b, c, h, w = x.shape
        offsets = torch.randint(0, 2 * pad + 1, (2, b), generator=gen).to(x.device)
        flip = (torch.rand(b, generator=gen) < 0.5).to(x.device)
        padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
        ar_h = torch.arange(h, device=x.device)
        ar_w = torch.arange(w, device=x.device)
        rows = offsets[0, :, None] + ar_h  # [b, h]
        cols = offsets[1, :, None] + torch.where(flip[:, None], w - 1 - ar_w, ar_w)  # [b, w]
        bi = torch.arange(b, device=x.device)[:, None, None, None]
        ci = torch.arange(c, device=x.device)[None, :, None, None]
        return padded[bi, ci, rows[:, None, :, None], cols[:, None, None, :]]

    def __repr__(self) -> str:
        return (f"TensorBatchLoader(n={self.num_samples}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"augment={self.augment}, device={self.device})")
