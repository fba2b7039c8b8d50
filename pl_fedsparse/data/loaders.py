"""A fast batch iterator over inputs already in memory (CPU or GPU), and the slower path for datasets that are not.

:class:`TensorBatchLoader` replaces ``torch.utils.data.DataLoader`` for the small in-memory datasets of federated
learning: a batch is one advanced-indexing gather of the input tensor followed by vectorised normalisation and
(optionally, for images) CIFAR augmentation, with no per-sample Python work and no worker processes. It is a plain
iterable with ``__len__``, which ``lightning.Trainer.fit(model, train_dataloaders=loader)`` accepts. Inputs are
``uint8 [n, C, H, W]`` images (normalised to float by ``mean``/``std``), float features of any shape (float32,
normalised only when ``mean``/``std`` are given) or integer token ids (int64, as they are); see
:func:`~pl_fedsparse.data.datasets.input_kind`.

:func:`dataset_loader` batches rows of map-style ``torch.utils.data.Dataset`` objects with a
``torch.utils.data.DataLoader`` whose shuffling generator is seeded: reproducible, but per-sample Python work, so
slower — for data that does not fit in memory.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pl_fedsparse.data.base import input_kind
from pl_fedsparse.errors import check
from pl_fedsparse.functional import transfer

__all__ = [
    "AUGMENT_PAD",
    "PreparedInputs",
    "TensorBatchLoader",
    "batch_to",
    "dataset_loader",
    "epoch_seed",
    "item_input",
    "normalize",
    "prepare_inputs",
]

#: the augmentation's zero padding on each side of an image (pixels) before its random crop
AUGMENT_PAD = 4


def normalize(images: torch.Tensor, mean: Sequence[float] | None = None,
              std: Sequence[float] | None = None) -> torch.Tensor:
    """Model inputs from stored inputs: uint8 images ``[B, C, H, W]`` -> float ``(x / 255 - mean) / std`` per channel;
    float features -> float32 ``(x - mean) / std`` (unchanged without ``mean``/``std``); token ids -> int64.

    Example:
        >>> normalize(torch.full((1, 1, 1, 1), 255, dtype=torch.uint8), [0.5], [0.5]).item()
        1.0
        >>> normalize(torch.tensor([[1.0, 3.0]]), [1.0, 1.0], [2.0, 2.0]).tolist(), normalize(torch.tensor([[7]])).dtype
        ([[0.0, 1.0]], torch.int64)
    """
    kind = input_kind(images)
    if kind == "image":
        assert mean is not None and std is not None
        scale, shift = _affine(tuple(mean), tuple(std), images.device)
        return images.float() * scale + shift
    if kind == "features":
        x = images.float()
        if mean is None or std is None:
            return x
        m, s = _feature_stats(tuple(mean), tuple(std), x.ndim, x.device)
        return (x - m) / s
    return images.long()


@functools.lru_cache(maxsize=64)
def _feature_stats(mean: tuple[float, ...], std: tuple[float, ...], ndim: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean``/``std`` (one value, or one per entry of dimension 1) shaped to broadcast over a ``[B, ...]`` batch.
    Cached as :func:`_affine` (made on a GPU from host values, each would wait for the device; only ever read)."""
    shape = (1, -1) + (1,) * max(ndim - 2, 0) if len(mean) > 1 else (1,)
    m = transfer.host_tensor(tuple(mean), device, torch.float32).view(shape)
    s = transfer.host_tensor(tuple(std), device, torch.float32).view(shape)
    return m, s


@functools.lru_cache(maxsize=64)
def _affine(mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel ``(scale, shift)`` that normalise uint8 images: ``x * scale + shift = (x / 255 - mean) / std``.
    Cached (a loader is built per client and fit; the tensors are only ever read)."""
    m = transfer.host_tensor(tuple(mean), device, torch.float32).view(1, -1, 1, 1)
    s = transfer.host_tensor(tuple(std), device, torch.float32).view(1, -1, 1, 1)
    return 1.0 / (255.0 * s), -m / s


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)``, without reading the device where both are the one cached tensor (:func:`_affine`)."""
    return a is b or torch.equal(a, b)


@functools.lru_cache(maxsize=16)
def _channel_index(channels: int, device: torch.device) -> torch.Tensor:
    """``arange(channels)`` shaped ``[1, C, 1, 1]`` (the crop's channel index; only ever read)."""
    return torch.arange(channels, device=device).view(1, -1, 1, 1)


@functools.lru_cache(maxsize=16)
def _crop_ranges(h: int, w: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``arange(h)``, ``arange(w)`` and ``w - 1 - arange(w)`` (a flip's columns) on ``device`` (only ever read)."""
    ar_w = torch.arange(w, device=device)
    return torch.arange(h, device=device), ar_w, w - 1 - ar_w


def _as_index_tensor(values: torch.Tensor | np.ndarray) -> torch.Tensor:
    """int64 tensor from a tensor or (possibly read-only) array, copying arrays."""
    if isinstance(values, torch.Tensor):
        return values.long()
    return torch.from_numpy(np.array(values, dtype=np.int64, copy=True))


def epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed mixing ``seed`` and ``epoch`` (distinct streams for distinct pairs)."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0]) & ((1 << 63) - 1)


def batch_to(x: torch.Tensor, y: torch.Tensor, device: torch.device | str,
             non_blocking: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's inputs and labels on ``device`` (no copy where they are there already, as with a loader whose data
    lives on that device: ``data.device``)."""
    x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
    transfer.mark_placed((x, y), device)  # (a device run simulated on the CPU: the batch is on "the device")
    return x, y


@dataclass(frozen=True, eq=False)
class PreparedInputs:
    """The model inputs of every row of a base tensor, made once where the data lives: for each row what
    :meth:`TensorBatchLoader.inputs` gives for it (the same values, from the same operations), images zero-padded by
    ``pad`` pixels on each side for the augmentation's crops (:func:`prepare_inputs`).

    A loader given them gathers a batch in one operation instead of a gather, a conversion and the normalisation's
    two (and, augmented, the padding and the crop's index arithmetic: ten more): on a GPU each operation is a
    kernel launch, and a small model's step is a few dozen. They take 4 bytes per input value (a uint8 image 4 times
    its size, padded by 4 on 32x32 about 6 times), so the datamodule makes them where memory is plentiful
    (``data.cache_inputs``).

    Attributes:
        values: ``[n, ...]`` the inputs of rows ``0 … n-1`` (images ``[n, C, H + 2 pad, W + 2 pad]``).
        pad: the zero padding on each side of an image (0: none; features: 0).
    """

    values: torch.Tensor
    pad: int = 0

    def core(self) -> torch.Tensor:
        """The inputs without their padding (a view)."""
        p = self.pad
        return self.values[..., p:self.values.shape[-2] - p, p:self.values.shape[-1] - p] if p else self.values


def prepare_inputs(images: torch.Tensor, mean: Sequence[float] | None = None, std: Sequence[float] | None = None,
                   pad: int = 0, chunk: int = 4096) -> PreparedInputs:
    """The :class:`PreparedInputs` of ``images`` (a loader's base tensor) with ``mean``/``std`` as a
    :class:`TensorBatchLoader` normalises them, made where ``images`` are, ``chunk`` rows at a time (the temporary
    memory of one chunk).

    Example:
        >>> x = torch.arange(8, dtype=torch.uint8).view(2, 1, 2, 2)
        >>> p = prepare_inputs(x, [0.0], [1.0], pad=1)
        >>> tuple(p.values.shape), torch.equal(p.core(), TensorBatchLoader(x, torch.zeros(2), 2, False, 0,
        ...     [0.0], [1.0]).inputs(torch.arange(2)))
        ((2, 1, 4, 4), True)
    """
    check(isinstance(pad, int) and pad >= 0, "pad", pad, "an int >= 0")
    loader = TensorBatchLoader(images, torch.zeros(len(images), dtype=torch.int64), 1, shuffle=False,
                               generator_seed=0, mean=mean, std=std)
    check(pad == 0 or loader.kind == "image", "pad", pad, f"0 for {loader.kind} inputs (padding is for images)")
    n = len(images)
    first = loader.inputs(torch.arange(min(chunk, n), device=images.device))
    shape = list(first.shape[1:])
    if pad:
        shape[-2] += 2 * pad
        shape[-1] += 2 * pad
    values = (torch.zeros if pad else torch.empty)((n, *shape), dtype=first.dtype, device=images.device)
    out = PreparedInputs(values, pad)
    core = out.core()
    for begin in range(0, n, chunk):
        rows = torch.arange(begin, min(begin + chunk, n), device=images.device)
        core[begin:begin + len(rows)] = first if begin == 0 else loader.inputs(rows)
    return out


class TensorBatchLoader:
    """Iterate ``(x, y)`` batches from tensors in memory: normalised float images from uint8 images, float32
    features (normalised when ``mean``/``std`` are given) or int64 token ids.

    Every ``__iter__`` (an epoch) seeds a CPU ``torch.Generator`` with ``epoch_seed(generator_seed, epoch)`` and
    increments ``epoch``, so consecutive epochs differ while the whole sequence is reproducible from the seed
    (:meth:`set_epoch` rewinds it). The generator draws the permutation and the augmentation parameters.

    Augmentation (``augment=True``, images only) is the standard CIFAR one, vectorised on the batch: random crop back
    to the original size from the image zero-padded by 4 pixels on each side, and a random horizontal flip (p = 0.5).
    Padding happens *after* normalisation, so the border is the per-channel mean rather than black pixels.

    Args:
        images: the inputs ``[n, ...]`` (or the base tensor when ``indices`` selects from it): ``uint8 [n, C, H, W]``
            images, float features or integer token ids.
        labels: ``int [n]`` labels (tensor or array), aligned with ``images``.
        batch_size: samples per batch.
        shuffle: draw a random permutation per epoch (else keep the order).
        generator_seed: seed of the per-epoch generator; ``None`` draws one from torch's global RNG.
        mean: images: per-channel mean in ``[0, 1]`` units (required); features: ``None`` or one value or one per
            entry of dimension 1 (``(x - mean) / std``); token ids: ``None``.
        std: the matching standard deviations.
        augment: apply random crop (padding 4) + horizontal flip (images only).
        drop_last: drop the last incomplete batch.
        device: move the images and labels there once (GPU-resident batches); ``None`` keeps them where they are.
        indices: optional ``int [m]`` rows of ``images``/``labels`` to iterate over (avoids copying a client's data).
        prepared: the inputs of every row of ``images``, made once (:func:`prepare_inputs`, with this loader's
            ``mean``/``std`` and, when it augments, padding :data:`AUGMENT_PAD`): each batch is then gathered from
            them in one operation, with the same values.

    Example:
        >>> x = torch.arange(10, dtype=torch.uint8).view(10, 1, 1, 1)
        >>> loader = TensorBatchLoader(x, torch.arange(10), 4, shuffle=False, generator_seed=0, mean=[0], std=[1])
        >>> len(loader), [tuple(yb.tolist()) for _, yb in loader]
        (3, [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)])
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor | np.ndarray, batch_size: int, shuffle: bool,
                 generator_seed: int | None, mean: Sequence[float] | None = None,
                 std: Sequence[float] | None = None, augment: bool = False, drop_last: bool = False,
                 device: str | torch.device | None = None, indices: torch.Tensor | np.ndarray | None = None,
                 prepared: PreparedInputs | None = None) -> None:
        kind = input_kind(images) if isinstance(images, torch.Tensor) else None
        check(kind in ("image", "features", "tokens"), "images",
              getattr(images, "shape", type(images).__name__),
              "a uint8 tensor [n, C, H, W], a float tensor [n, ...] or an integer tensor [n, ...]")
        check(isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1,
              "data.batch_size", batch_size, "an int >= 1")
        stats = None if mean is None and std is None else (tuple(mean or ()), tuple(std or ()))
        if kind == "image":
            c = images.shape[1]
            check(stats is not None and len(stats[0]) == c and len(stats[1]) == c and min(stats[1]) > 0,
                  "mean/std", stats, f"{c} values each, std > 0")
        elif kind == "features":
            width = images.shape[1] if images.ndim >= 2 else 1
            check(stats is None or (len(stats[0]) in (1, width) and len(stats[1]) == len(stats[0])
                                    and min(stats[1]) > 0), "mean/std", stats,
                  f"None or 1 or {width} values each, std > 0")
        else:
            check(stats is None, "mean/std", stats, "None for token ids")
        check(not augment or kind == "image", "augment", augment,
              f"False for inputs of shape {tuple(images.shape[1:])} ({images.dtype}; augmentation is for uint8 "
              f"images [n, C, H, W])")
        check(generator_seed is None or (isinstance(generator_seed, int) and generator_seed >= 0), "generator_seed",
              generator_seed, "None or an int >= 0")
        labels = _as_index_tensor(labels)
        check(labels.ndim == 1 and len(labels) == len(images), "labels", tuple(labels.shape),
              f"shape ({len(images)},) aligned with images")
        if device is not None:
            images, labels = images.to(device), labels.to(device)
        self.images, self.labels = images, labels
        self.indices = None if indices is None else transfer.send(_as_index_tensor(indices), images.device)
        self.batch_size, self.shuffle, self.augment, self.drop_last = batch_size, bool(shuffle), bool(augment), \
            bool(drop_last)
        self.generator_seed = int(torch.randint(0, 2**62, (1,)).item()) if generator_seed is None else generator_seed
        self.kind = kind
        self.mean = None if stats is None else tuple(float(m) for m in stats[0])
        self.std = None if stats is None else tuple(float(s) for s in stats[1])
        self._scale, self._shift = torch.ones(()), torch.zeros(())
        self._normalize_features = False
        if self.mean is not None and self.std is not None:
            if kind == "image":
                self._scale, self._shift = _affine(self.mean, self.std, images.device)
            else:  # features: here _shift is the mean and _scale the std
                self._shift, self._scale = _feature_stats(self.mean, self.std, images.ndim, images.device)
                self._normalize_features = True
        self.epoch = 0
        self.prepared = prepared
        self._prepared_core: torch.Tensor | None = None
        if prepared is not None:
            values: Any = getattr(prepared, "values", None)
            check(isinstance(prepared, PreparedInputs) and isinstance(values, torch.Tensor)
                  and len(values) == len(images) and values.device == images.device, "prepared",
                  type(prepared).__name__ if not isinstance(values, torch.Tensor) else tuple(values.shape),
                  f"None or the PreparedInputs of these {len(images)} inputs on {images.device}")
            check(kind != "tokens", "prepared", tuple(values.shape), "None for token ids (their batch is one gather)")
            check(not self.augment or prepared.pad == AUGMENT_PAD, "prepared.pad", prepared.pad,
                  f"{AUGMENT_PAD} for an augmenting loader (the crop's padding)")
            self._prepared_core = prepared.core()

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
        gen, batches = self.epoch_batches()
        if self.augment and self.prepared is not None:  # one gather per batch: the crop from the padded inputs
            values = self.prepared.values
            channels = _channel_index(values.shape[1], values.device)
            crops = self._crop_indices(gen, [len(r) for r in batches])
            for rows, (r, c) in zip(batches, crops):
                yield (values[rows[:, None, None, None], channels, r[:, None, :, None], c[:, None, None, :]],
                       self.labels.index_select(0, rows))
            return
        draws = self._augment_draws(gen, [len(r) for r in batches]) if self.augment else None
        for i, rows in enumerate(batches):
            x = self.inputs(rows)
            if draws is not None:
                x = self._augment(x, gen, draws=draws[i])
            yield x, self.labels.index_select(0, rows)

    def _augment_draws(self, gen: torch.Generator, sizes: list[int], pad: int = AUGMENT_PAD
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every batch's crop offsets and flips of the epoch, drawn up front from ``gen`` in the order the batches
        would draw them one by one (the same numbers), and moved to the batches' device once per epoch: no transfer
        per step."""
        if not sizes:
            return []
        offsets, flips = self._epoch_draws(gen, sizes, pad)
        return list(zip(offsets.split(sizes, dim=1), flips.split(sizes)))

    def _epoch_draws(self, gen: torch.Generator, sizes: list[int], pad: int = AUGMENT_PAD
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_augment_draws` not split by batch: the epoch's offsets ``[2, N]`` and flips ``[N]``."""
        offsets, flips = [], []
        for b in sizes:
            offsets.append(torch.randint(0, 2 * pad + 1, (2, b), generator=gen))
            flips.append(torch.rand(b, generator=gen) < 0.5)
        # (sent without a wait for the device: staged in pinned memory on a GPU)
        return transfer.send(torch.cat(offsets, dim=1), self.device), transfer.send(torch.cat(flips), self.device)

    def _crop_indices(self, gen: torch.Generator, sizes: list[int], pad: int = AUGMENT_PAD
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per batch of the epoch, the rows ``[b, H]`` and columns ``[b, W]`` of its images' crops (flipped) in the
        padded inputs, from the draws :meth:`_augment_draws` makes, for the whole epoch in three operations: the
        index arithmetic of :meth:`_augment`, batch by batch."""
        if not sizes:
            return []
        offsets, flips = self._epoch_draws(gen, sizes, pad)
        h, w = self.images.shape[-2:]
        ar_h, ar_w, rev_w = _crop_ranges(h, w, offsets.device)
        rows = offsets[0, :, None] + ar_h
        cols = offsets[1, :, None] + torch.where(flips[:, None], rev_w, ar_w)
        return list(zip(rows.split(sizes), cols.split(sizes)))

    def epoch_batches(self) -> tuple[torch.Generator, list[torch.Tensor]]:
        """Start the next epoch: its generator (as it stands after the permutation, for the augmentation) and the
        rows of ``images`` of each of its batches, in order — what ``__iter__`` iterates over."""
        gen = torch.Generator().manual_seed(epoch_seed(self.generator_seed, self.epoch))
        self.epoch += 1
        n = self.num_samples
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        order = transfer.send(order, self.device)
        if self.indices is not None:
            order = self.indices[order]
        return gen, [order[b * self.batch_size:(b + 1) * self.batch_size] for b in range(len(self))]

    def inputs(self, rows: torch.Tensor) -> torch.Tensor:
        """The model inputs of ``rows`` of ``images``, normalised (element-wise: the same values whether the rows
        are one batch or several batches' rows together), not augmented."""
        if self._prepared_core is not None:  # made once, the same values: one gather
            return self._prepared_core.index_select(0, rows)
        picked = self.images.index_select(0, rows)  # (3x faster than images[rows] for uint8 images, same values)
        if self.kind == "image":
            return picked.float().mul_(self._scale).add_(self._shift)
        if self.kind == "features":
            x = picked.float()
            return x.sub_(self._shift).div_(self._scale) if self._normalize_features else x
        return picked.long()

    def same_inputs(self, other: Any) -> bool:
        """Whether ``other`` draws its inputs from the same tensors with the same normalisation (so that
        :meth:`inputs` of several loaders' rows can be gathered at once)."""
        return (isinstance(other, TensorBatchLoader) and other.images is self.images and other.labels is self.labels
                and other.kind == self.kind and other._normalize_features == self._normalize_features
                and _same(other._scale, self._scale) and _same(other._shift, self._shift))

    def _augment(self, x: torch.Tensor, gen: torch.Generator, pad: int = 4,
                 draws: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Random crop (zero padding ``pad``) + horizontal flip of a float batch with one gather (the offsets and
        flips drawn from ``gen`` now, or given as ``draws``, already on the batch's device)."""
        b, c, h, w = x.shape
        if draws is None:
            offsets = transfer.send(torch.randint(0, 2 * pad + 1, (2, b), generator=gen), x.device)
            flip = transfer.send(torch.rand(b, generator=gen) < 0.5, x.device)
        else:
            offsets, flip = draws
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


# ----------------------------------------------------------------------------------------------- Dataset objects
def item_input(item: Any) -> Any:
    """The input of one item of a map-style dataset: the item itself, or its first element when it is a tuple."""
    return item[0] if isinstance(item, (tuple, list)) else item


class _Rows(torch.utils.data.Dataset):
    """Rows of one or more datasets, each item paired with its label from a label tensor."""

    def __init__(self, parts: Sequence[tuple[Any, torch.Tensor, np.ndarray]]) -> None:
        self.parts = [(ds, labels, np.asarray(rows, dtype=np.int64)) for ds, labels, rows in parts]
        self.offsets = np.cumsum([0] + [len(rows) for _, _, rows in self.parts])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        p = int(np.searchsorted(self.offsets, i, side="right")) - 1
        ds, labels, rows = self.parts[p]
        row = int(rows[i - self.offsets[p]])
        return item_input(ds[row]), labels[row]


def dataset_loader(parts: Sequence[tuple[Any, torch.Tensor, np.ndarray]], batch_size: int, shuffle: bool,
                   seed: int, num_workers: int = 0) -> torch.utils.data.DataLoader:
    """A ``DataLoader`` over rows of map-style datasets (slower than :class:`TensorBatchLoader`: per-sample work).

    Args:
        parts: ``(dataset, labels, rows)`` triples; the batches hold ``dataset[row]``'s input (see
            :func:`item_input`) and ``labels[row]`` for every row of every part, in this order.
        batch_size: samples per batch.
        shuffle: shuffle with a ``torch.Generator`` seeded by ``seed`` (each new epoch continues its stream, so the
            whole sequence is reproducible from ``seed``).
        seed: the generator's seed.
        num_workers: ``DataLoader`` worker processes.

    Example:
        >>> ds = torch.utils.data.TensorDataset(torch.arange(10.0).view(10, 1))
        >>> loader = dataset_loader([(ds, torch.arange(10) % 2, np.array([1, 3, 5]))], 2, shuffle=False, seed=0)
        >>> [(x.view(-1).tolist(), y.tolist()) for x, y in loader]
        [([1.0, 3.0], [1, 1]), ([5.0], [1])]
    """
    gen = torch.Generator().manual_seed(epoch_seed(seed, 0))
    return torch.utils.data.DataLoader(_Rows(parts), batch_size=batch_size, shuffle=shuffle, generator=gen,
                                       num_workers=num_workers)
