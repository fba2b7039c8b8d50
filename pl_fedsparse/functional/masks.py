"""Pure mask functions: random masks with exact counts and per-layer densities.

Masks are bool tensors shaped like the tensor they mask. Counts are exact: a tensor of ``n`` entries at density
``d`` keeps ``floor(d · n)`` entries (the DisPFL code's ``init_masks``), so a mask's density never drifts.

Per-layer densities are uniform or ERK (Erdős–Rényi-Kernel, Evci et al. 2020 "Rigging the Lottery", RigL), solved
exactly as in DisPFL (Dai et al., ICML 2022, ``my_model_trainer.py:calculate_sparsities``), which FedSpa (Huang et
al. 2022) also uses. Mask *updates* (prune and regrow) and bit packing live in :mod:`pl_fedsparse.functional.sparse`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

from pl_fedsparse.errors import check

__all__ = ["topk_mask", "stable_top_k", "sorted_top_k", "sortable", "permutation_scores", "random_mask", "uniform_densities", "check_density", "apply_masks", "erk_densities", "layer_densities",
           "masks_from_densities", "mask_density"]


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
    names = [k for k in tensors if k in masks]
    values = [tensors[k] for k in names]
    bits = [masks[k] for k in names]
    if len(names) > 1 and _one_kind(values, bits):
        # (one conversion of every mask, joined, and one multi-tensor product: a few launches on a device, where a
        # conversion and a product each were two a tensor; the same products)
        flat = torch.cat([m.reshape(-1) for m in bits]).to(values[0].dtype)
        shaped = [part.view(v.shape) for part, v in zip(flat.split([m.numel() for m in bits]), values)]
        products = dict(zip(names, torch._foreach_mul(values, shaped)))
        return {k: products.get(k, v) for k, v in tensors.items()}
    return {k: (v * _on(masks[k], v)) if k in masks else v for k, v in tensors.items()}


def _one_kind(values: Sequence[Tensor], masks: Sequence[Tensor]) -> bool:
    """Whether ``values`` share a floating dtype and, with ``masks`` (bool, each its value's shape), one device."""
    first = values[0]
    return (first.is_floating_point() and all(
        v.dtype == first.dtype and v.device == first.device and v.layout == torch.strided and not v.requires_grad
        and m.dtype == torch.bool and m.device == first.device and m.shape == v.shape
        for v, m in zip(values, masks)))


def _on(mask: Tensor, like: Tensor) -> Tensor:
    """``mask`` in ``like``'s dtype, copied to ``like``'s device only when it is elsewhere."""
    return mask.to(like.dtype) if mask.device == like.device else mask.to(like.device, like.dtype)


def _check_shapes(shapes: Mapping[str, torch.Size | tuple[int, ...]]) -> None:
    check(isinstance(shapes, Mapping) and len(shapes) > 0, "shapes", type(shapes).__name__,
          "a non-empty mapping name -> shape")


def erk_densities(shapes: Mapping[str, torch.Size | tuple[int, ...]], density: float, erk_power_scale: float = 1.0,
                  *, always_dense: Collection[str] = ()) -> dict[str, float]:
    """Erdős–Rényi-Kernel layer densities whose parameter-weighted mean is ``density``.

    The iterative ε solve of RigL (Evci et al. 2020) as ported by DisPFL (Dai et al. 2022,
    ``my_model_trainer.py:calculate_sparsities``, ``distribution="ERK"``) and used by FedSpa (Huang et al. 2022):

    * every tensor ``l`` (``n_l`` entries) is eligible, with ``raw_l = (sum(shape_l) / prod(shape_l)) ** p``;
      a 1-D tensor (bias, norm affine) therefore has ``raw = 1``;
    * with a dense set ``D`` (initially ``always_dense``, empty in the reference), solve
      ``ε = (Σ_{l∉D} d·n_l − Σ_{l∈D} (1−d)·n_l) / Σ_{l∉D} raw_l·n_l``;
    * if ``max_{l∉D} raw_l·ε > 1``, add **every** tensor whose ``raw`` equals that maximum to ``D`` and repeat;
    * ``density_l = 1`` for ``l ∈ D``, else ``ε·raw_l``.

    So ``Σ density_l·n_l = d·Σ n_l`` up to float rounding. With ``p = 1``, 1-D tensors become dense on the first
    pass in any real network. ``density = 1`` returns all ``1.0``. Tensors with no entries, and 0-d tensors, get
    ``raw = 1`` (``sum(()) = 0`` would otherwise make a scalar parameter fully masked).

    Args:
        shapes: tensor name -> shape (e.g. ``{k: tuple(v.shape) for k, v in model.state_dict().items()}``).
        density: the target global density ``d`` in ``(0, 1]``.
        erk_power_scale: the exponent ``p`` (DisPFL's ``--erk_power_scale``, default 1; ``p = 0`` is uniform).
        always_dense: names that start in ``D`` (kept dense). Not in the reference; used by
            :func:`layer_densities` for ``dense_1d``.

    Returns:
        name -> density in ``(0, 1]``, in the order of ``shapes``.

    Raises:
        ConfigError: a bad argument, or ``always_dense`` tensors already holding more than ``d·Σ n_l`` entries.

    Example:
        An 8x8 weight (raw = 16/64 = 0.25) and its bias (raw = 1) at d = 0.5: the first pass gives
        ε = 36 / (0.25·64 + 8) = 1.5, so the bias (1.5 > 1) is made dense; then ε = (32 − 4) / 16 = 1.75 and the
        weight gets 1.75·0.25 = 0.4375, i.e. 28 + 8 = 36 = 0.5·72 entries:

        >>> erk_densities({"w": (8, 8), "b": (8,)}, 0.5)
        {'w': 0.4375, 'b': 1.0}

        In a tiny layer the bias may stay sparse (ε = 18 / 20 = 0.9 ≤ 1); see ``dense_1d`` of
        :func:`layer_densities`:

        >>> erk_densities({"w1": (4, 4), "w2": (4, 4), "b": (4,)}, 0.5)
        {'w1': 0.45, 'w2': 0.45, 'b': 0.9}
        >>> erk_densities({"w": (4, 4), "b": (4,)}, 1.0)
        {'w': 1.0, 'b': 1.0}
    """
    _check_shapes(shapes)
    check_density(density, "density")
    check(isinstance(erk_power_scale, (int, float)) and not isinstance(erk_power_scale, bool)
          and math.isfinite(erk_power_scale) and erk_power_scale >= 0, "erk_power_scale", erk_power_scale,
          "a finite number >= 0")
    unknown = [k for k in always_dense if k not in shapes]
    check(not unknown, "always_dense", unknown, "names of tensors in shapes")
    if density == 1:
        return {k: 1.0 for k in shapes}
    numel = {k: math.prod(s) for k, s in shapes.items()}
    raw = {k: 1.0 if (len(s) == 0 or numel[k] == 0) else (sum(s) / numel[k]) ** erk_power_scale
           for k, s in shapes.items()}
    dense = set(always_dense)
    eps = 0.0
    while True:
        sparse = [k for k in shapes if k not in dense]
        if not sparse:
            break
        rhs = sum(density * numel[k] for k in sparse) - sum((1 - density) * numel[k] for k in dense)
        divisor = sum(raw[k] * numel[k] for k in sparse)
        check(rhs > 0 and divisor > 0, "density", density,
              f"a density above the share of always-dense entries ({sum(numel[k] for k in dense)} of "
              f"{sum(numel.values())})")
        eps = rhs / divisor
        max_raw = max(raw[k] for k in sparse)
        if max_raw * eps <= 1:
            break
        dense.update(k for k in sparse if raw[k] == max_raw)
    return {k: 1.0 if k in dense else eps * raw[k] for k in shapes}


def layer_densities(shapes: Mapping[str, torch.Size | tuple[int, ...]], density: float,
                    distribution: Literal["erk", "uniform"] = "erk", erk_power_scale: float = 1.0,
                    dense_1d: bool = True) -> dict[str, float]:
    """Per-tensor densities from a global ``density`` and a layer-wise ``distribution``.

    * ``"erk"``: :func:`erk_densities`. With ``dense_1d`` the 1-D (and 0-d) tensors start in the dense set; in any
      real network this gives the same result as the reference, where they become dense on the first pass.
    * ``"uniform"``: :func:`uniform_densities`. ``dense_1d=False`` is DisPFL's ``--uniform``, which also masks
      biases and norm affines at ``density``; with ``dense_1d=True`` the global density is slightly above it.

    Example:
        >>> layer_densities({"w": (4, 4), "b": (4,)}, 0.5, "uniform")
        {'w': 0.5, 'b': 1.0}
        >>> layer_densities({"w": (4, 4), "b": (4,)}, 0.5, "uniform", dense_1d=False)
        {'w': 0.5, 'b': 0.5}
        >>> layer_densities({"w": (4, 4), "b": (4,)}, 0.5, "erk")  # b dense (4 entries), w keeps 10 − 4 = 6 of 16
        {'w': 0.375, 'b': 1.0}
    """
    check(distribution in ("erk", "uniform"), "distribution", distribution, "one of 'erk', 'uniform'")
    if distribution == "uniform":
        return uniform_densities(shapes, density, dense_1d=dense_1d)
    _check_shapes(shapes)
    one_d = [k for k, s in shapes.items() if len(s) <= 1] if dense_1d else []
    return erk_densities(shapes, density, erk_power_scale, always_dense=one_d)


def masks_from_densities(shapes: Mapping[str, torch.Size | tuple[int, ...]], densities: Mapping[str, float],
                         generator: torch.Generator) -> dict[str, Tensor]:
    """A random bool mask per tensor with exactly ``floor(density_l · n_l)`` active entries.

    Every tensor of ``shapes`` gets a mask (all-True at density 1), drawn with :func:`random_mask` in the order of
    ``shapes``. One ``torch.randperm`` per tensor, dense ones included, as DisPFL's ``init_masks``
    (``my_model_trainer.py:28-38``), which draws from the global RNG; the reference computes the count as
    ``int((1 - sparsity) · n)``, which can differ from ``floor(d · n)`` by one in rare float cases.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> m = masks_from_densities({"w": (4, 5), "b": (3,)}, {"w": 0.5, "b": 1.0}, g)
        >>> int(m["w"].sum()), m["b"].tolist()
        (10, [True, True, True])
    """
    _check_shapes(shapes)
    missing = [k for k in shapes if k not in densities]
    check(not missing, "densities", missing, "a density for every tensor in shapes")
    check(isinstance(generator, torch.Generator), "generator", type(generator).__name__, "a torch.Generator")
    return {k: random_mask(tuple(s), float(densities[k]), generator) for k, s in shapes.items()}


def mask_density(masks: Mapping[str, Tensor]) -> float:
    """Global density: active entries over all masked entries (bool or 0/1 masks).

    Example:
        >>> mask_density({"w": torch.tensor([True, False, False, False]), "b": torch.tensor([1.0, 1.0])})
        0.5
    """
    total = sum(m.numel() for m in masks.values())
    check(total > 0, "masks", f"{len(masks)} masks with 0 entries", "at least one masked entry")
    return sum(int(torch.count_nonzero(m)) for m in masks.values()) / total


def stable_top_k(scores: Tensor, k: int, *, largest: bool) -> Tensor:
    """The entries a stable sort puts first, without the sort: a bool tensor of a 1-D ``scores``' shape that is True
    at exactly the entries of ``torch.sort(scores, descending=largest, stable=True).indices[:k]``.

    That is the ``k`` largest (``largest=True``) or smallest scores, ties to the lower index, NaN ranked above every
    number (``torch.sort``'s convention: first when ``largest``, last otherwise), ``-0.0`` equal to ``0.0``. The
    k-th value is found with ``torch.kthvalue`` (linear time) and the entries are taken by comparison with it: one
    VGG11-GN or ResNet18-GN client's prune-and-regrow is ~3× faster than with the sort on a CPU core
    (``benchmarks/topk_select.py``), with the same result (``tests/test_functional_masks.py`` compares the two on
    ties, NaN, ±0, ±inf and integer scores).

    Args:
        scores: a 1-D tensor of real scores (half precision is compared in float32, integers and bools in float64:
            both keep the order).
        k: how many to select, ``0 <= k <= scores.numel()``.
        largest: select the largest (True) or the smallest (False).

    Example:
        >>> stable_top_k(torch.tensor([0.5, 0.9, 0.5, 0.1]), 2, largest=True).tolist()
        [True, True, False, False]
    """
    n = scores.numel()
    check(isinstance(k, int) and 0 <= k <= n, "k", k, f"an int in [0, {n}]")
    s = sortable(scores)
    if s.device.type != "cpu":
        return sorted_top_k(s, k, largest=largest)
    selected = torch.zeros(n, dtype=torch.bool, device=s.device)
    nan = torch.isnan(s)
    n_nan = int(nan.sum())
    take_nan = min(k, n_nan) if largest else max(0, k - (n - n_nan))  # NaN sorts above every number
    if take_nan:
        selected[nan.nonzero().squeeze(1)[:take_nan]] = True
    rest = k - take_nan
    if rest:
        v = -s if largest else s  # the largest of s are the smallest of -s, ties kept in index order
        threshold = torch.kthvalue(v[~nan] if n_nan else v, rest).values
        below = v < threshold
        selected |= below
        missing = rest - int(below.sum())
        if missing:
            selected[(v == threshold).nonzero().squeeze(1)[:missing]] = True
    return selected


def sortable(scores: Tensor) -> Tensor:
    """``scores`` flat, detached, in a dtype whose comparisons keep their order: half precision in float32, integers
    and bools in float64 (how :func:`stable_top_k` and :func:`sorted_top_k` compare)."""
    s = scores.detach().reshape(-1)
    if not s.is_floating_point():
        return s.double()
    return s.float() if s.dtype in (torch.float16, torch.bfloat16) else s


def sorted_top_k(scores: Tensor, k: int, *, largest: bool) -> Tensor:
    """:func:`stable_top_k` by a stable sort on the scores' own device: no host synchronisation (``k`` is known on
    the host), so an accelerator's prune-and-regrow never waits for a copy back. Used for scores off the CPU, where
    a sort is cheap and :func:`stable_top_k`'s counting would stop the device; the same entries
    (``tests/test_functional_masks.py`` compares the two on the CPU).

    Example:
        >>> sorted_top_k(torch.tensor([0.5, 0.9, 0.5, 0.1]), 2, largest=True).tolist()
        [True, True, False, False]
    """
    s = sortable(scores)
    selected = torch.zeros(s.numel(), dtype=torch.bool, device=s.device)
    selected[torch.sort(s, descending=largest, stable=True).indices[:k]] = True
    return selected


def topk_mask(scores: Tensor, k: int) -> Tensor:
    """A bool mask of ``scores``' shape with exactly ``k`` ones at the ``k`` highest scores (ties: lower flat index
    first, so the result is deterministic).

    Example:
        >>> topk_mask(torch.tensor([[0.1, 0.9], [0.5, 0.5]]), 2).tolist()
        [[False, True], [True, False]]
    """
    return stable_top_k(scores.detach().flatten(), k, largest=True).view(scores.shape)


def permutation_scores(shape: torch.Size | tuple[int, ...], generator: torch.Generator) -> Tensor:
    """Random scores whose top-k is the first k entries of one ``torch.randperm`` draw: ``topk_mask`` of them equals
    :func:`random_mask` with the same generator state (the random initial mask as a score).

    Example:
        >>> a = topk_mask(permutation_scores((4, 5), torch.Generator().manual_seed(0)), 10)
        >>> b = random_mask((4, 5), 0.5, torch.Generator().manual_seed(0))
        >>> bool(torch.equal(a, b))
        True
    """
    n = math.prod(shape)
    scores = torch.empty(n, dtype=torch.float64)  # exact ranks for any layer size
    scores[torch.randperm(n, generator=generator)] = torch.arange(n, 0, -1, dtype=torch.float64)
    return scores.view(tuple(shape))
