"""DisPFL's gossip average made from the stored sparse models as one flat buffer per model
(``group_average_stored``): the same bits as expanding each tensor and averaging, far fewer operators."""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_datamodule, tiny_loop, tiny_module
from torch.utils._python_dispatch import TorchDispatchMode

from pl_fedsparse import RandomPeers
from pl_fedsparse.callbacks import Gossip, RandomRegrow
from pl_fedsparse.callbacks import gossip as gossip_module
from pl_fedsparse.functional import weighted_average
from pl_fedsparse.functional.sparse import (
    expand_values,
    group_average_stored,
    pack_masks,
    packed_count,
    unpack_masks,
)

#: operators that make a view (no kernel on a device)
_VIEWS = {"view", "_unsafe_view", "slice", "split", "split_with_sizes", "unsqueeze", "reshape", "alias", "lift_fresh"}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        return sum(c for op, c in self.count.items() if op not in _VIEWS)


def _special(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Random values with some -0.0, ±inf and NaN among them."""
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    flat = t.view(-1)
    pick = torch.randint(0, 12, flat.shape, generator=g)
    flat[pick == 0] = -0.0
    flat[pick == 1] = math.inf
    flat[pick == 2] = -math.inf
    flat[pick == 3] = math.nan
    return t.to(dtype)


def _group(shapes: dict[str, tuple[int, ...]], masked: list[str], members: int, dtype: torch.dtype, seed: int,
           special: bool = False) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """``members`` stored models as Gossip keeps them: masked tensors as their values at the mask, the rest dense."""
    g = torch.Generator().manual_seed(seed)
    group = []
    for _ in range(members):
        masks = {n: torch.rand(shapes[n], generator=g) < torch.rand((), generator=g) for n in masked}
        dense = {n: _special(s, g, dtype) if special else torch.randn(s, generator=g, dtype=torch.float64).to(dtype)
                 for n, s in shapes.items()}
        values = {n: (t[masks[n]] if n in masks else t) for n, t in dense.items()}
        values["steps"] = torch.tensor(7 + len(group))  # an integer buffer: the receiver's own is kept
        group.append((values, pack_masks(masks)))
    return group


def _counts(group: list) -> list[dict[str, int]]:
    return [{n: packed_count(p) for n, p in packed.items()} for _, packed in group]


def _by_tensor(group: list, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """What Gossip computed before: each tensor unpacked and expanded (one stored at its dense shape taken as it is,
    as Gossip's ``_expand`` does), then ``weighted_average``."""
    masks = [unpack_masks(p, shapes) for _, p in group]
    dense = [{n: expand_values(v, m[n]) if n in m and tuple(v.shape) != tuple(shapes[n]) else v
              for n, v in w.items()} for (w, _), m in zip(group, masks)]
    return weighted_average(dense, [1.0] * len(dense), [m or None for m in masks])


def _assert_same_bits(flat: dict[str, torch.Tensor] | None, ref: dict[str, torch.Tensor], seed: int) -> None:
    assert flat is not None and list(flat) == list(ref)
    for name in ref:
        assert flat[name].dtype == ref[name].dtype and flat[name].shape == ref[name].shape, name
        assert torch.equal(_bits(flat[name]), _bits(ref[name])), (name, seed)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (a NaN's payload aside: converting kernels may set it differently, vectorised or not)."""
    if not t.is_floating_point():
        return t
    return torch.where(t.isnan(), torch.full_like(t, math.nan), t).view(
        {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


# sizes from 1 to 41 elements: every length of a vectorised loop's scalar tail, on either side of a vector's width
SHAPES = {**{f"w{i}": (i + 1,) for i in range(0, 41, 3)}, "conv": (4, 3, 3, 3), "fc": (10, 7), "odd": (3, 5)}
MASKED = ["conv", "fc", "odd", "w3", "w9", "w39"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("members", [1, 2, 5])
@pytest.mark.parametrize("special", [False, True])
def test_flat_average_is_the_tensor_by_tensor_average_bit_for_bit(dtype: torch.dtype, members: int,
                                                                  special: bool) -> None:
    shapes = {**SHAPES, "steps": ()}
    for seed in range(4):
        group = _group(SHAPES, MASKED, members, dtype, seed, special)
        _assert_same_bits(group_average_stored(group, shapes, _counts(group)), _by_tensor(group, shapes), seed)


def _initial(group: list, shapes: dict[str, tuple[int, ...]], seed: int, special: bool) -> list:
    """``group`` with each member's masked tensors stored dense (values off the mask too), as a client holding the
    initial model under its first mask stores them."""
    g = torch.Generator().manual_seed(100 + seed)
    out = []
    for values, packed in group:
        dtype = next(v.dtype for n, v in values.items() if n in packed)
        out.append(({n: (_special(shapes[n], g, dtype) if special else torch.randn(shapes[n], generator=g).to(dtype))
                     if n in packed else v for n, v in values.items()}, packed))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("special", [False, True])
def test_members_still_holding_the_initial_dense_model_are_averaged_flat_bit_for_bit(dtype: torch.dtype,
                                                                                    special: bool) -> None:
    """Round 0 of DisPFL: every member's masked tensors at their dense shape (values off the mask too: the average
    takes ``v·m``, NaN and infinities off the mask included); and later rounds' mixed groups, where a client that
    has not trained yet still holds its initial model beside neighbours that store values."""
    shapes = {**SHAPES, "steps": ()}
    for seed in range(3):
        sparse_group = _group(SHAPES, MASKED, 4, dtype, seed, special)
        initial = _initial(sparse_group, shapes, seed, special)
        for group in (initial, [initial[0], sparse_group[1], initial[2], sparse_group[3]]):
            _assert_same_bits(group_average_stored(group, shapes, _counts(group)), _by_tensor(group, shapes), seed)
        assert group_average_stored(initial, shapes) is not None  # (no counts needed: every shape says dense)


def test_flat_average_without_masks_is_dpsgds_average() -> None:
    shapes = dict(SHAPES)
    group = _group(SHAPES, [], 4, torch.float32, 0)
    flat, ref = group_average_stored(group, shapes), _by_tensor(group, shapes)
    assert flat is not None and all(torch.equal(_bits(flat[n]), _bits(ref[n])) for n in ref)


def test_the_receivers_integer_buffers_are_kept() -> None:
    group = _group(SHAPES, MASKED, 3, torch.float32, 1)
    out = group_average_stored(group, {**SHAPES, "steps": ()}, _counts(group))
    assert out is not None and out["steps"].item() == 7 and out["steps"] is not group[0][0]["steps"]


def test_a_full_mask_on_a_1d_tensor_needs_the_counts() -> None:
    shapes = {"b": (6,), "w": (3, 4)}
    g = torch.Generator().manual_seed(0)
    masks = [{"b": torch.ones(6, dtype=torch.bool), "w": torch.rand(3, 4, generator=g) < 0.5},
             {"b": torch.arange(6) < 2, "w": torch.rand(3, 4, generator=g) < 0.5}]
    group = [({n: torch.randn(shapes[n], generator=g)[m[n]] for n in shapes}, pack_masks(m)) for m in masks]
    assert group_average_stored(group, shapes) is None  # b's 6 values could be a dense b
    out = group_average_stored(group, shapes, _counts(group))
    ref = _by_tensor(group, shapes)
    assert out is not None and all(torch.equal(_bits(out[n]), _bits(ref[n])) for n in shapes)


def test_the_flat_form_declines_what_it_does_not_take() -> None:
    shapes = dict(SHAPES)
    base = _group(SHAPES, ["conv", "fc", "odd"], 3, torch.float32, 2)
    assert group_average_stored(base, shapes) is not None
    # a member still holding the initial dense model under its first mask
    dense_under_mask = [dict(w) for w, _ in base]
    dense_under_mask[1]["fc"] = torch.randn(SHAPES["fc"])
    assert group_average_stored([(w, p) for w, (_, p) in zip(dense_under_mask, base)], shapes) is None
    base_w3 = _group(SHAPES, ["w3"], 3, torch.float32, 5)
    flat_w3 = [(dict(w), p) for w, p in base_w3]
    flat_w3[1][0]["w3"] = torch.randn(4)  # dense, though its mask holds fewer: taken as dense (v·m), as Gossip does
    out_w3, ref_w3 = group_average_stored(flat_w3, shapes, _counts(flat_w3)), _by_tensor(flat_w3, shapes)
    assert out_w3 is not None and all(torch.equal(_bits(out_w3[n]), _bits(ref_w3[n])) for n in ref_w3)
    # (without the counts a 1-D tensor at its dense shape beside stored values could be either: declined)
    mixed_w3 = [(dict(w), p) for w, p in _group(SHAPES, ["w3", "fc"], 3, torch.float32, 6)]
    mixed_w3[1][0]["w3"] = torch.randn(4)
    assert group_average_stored(mixed_w3, shapes) is None
    # masked names that differ between members
    fewer = [(w, dict(p)) for w, p in base]
    del fewer[2][1]["fc"]
    fewer[2][0]["fc"] = torch.randn(SHAPES["fc"])
    assert group_average_stored(fewer, shapes) is None
    # mixed floating dtypes
    mixed = [(dict(w), p) for w, p in base]
    mixed[0][0]["w0"] = mixed[0][0]["w0"].double()
    assert group_average_stored(mixed, shapes) is None
    # names that differ
    other = [(dict(w), p) for w, p in base]
    other[1][0]["extra"] = torch.ones(2)
    assert group_average_stored(other, shapes) is None


def test_operators_per_message_do_not_grow_with_the_tensors() -> None:
    def kernels(n_tensors: int) -> int:
        shapes = {f"t{i}": (6, 5) for i in range(n_tensors)} | {f"b{i}": (5,) for i in range(n_tensors)}
        group = _group(shapes, [f"t{i}" for i in range(n_tensors)], 4, torch.float32, 3)
        group_average_stored(group, shapes)  # (warm: nothing cached, but the same path)
        with _Ops() as ops:
            group_average_stored(group, shapes)
        return ops.kernels()

    few, many = kernels(3), kernels(30)
    # per member: the masks' bytes and the values joined, unpacked, expanded, added (masked and dense parts)
    assert few == many <= 12 * 4 + 12, (few, many)


class _PerTensorGossip(Gossip):
    """The same callback with ``_expand`` overridden: it takes the tensor-by-tensor path."""

    def _expand(self, weights: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super()._expand(weights, masks)


def _dispfl(tmp_path: Path, gossip: Gossip, **kw: Any):  # type: ignore[no-untyped-def]
    loop = tiny_loop(tmp_path, num_rounds=3, topology=RandomPeers(k=2),
                     callbacks=[RandomRegrow(density=0.5, same_mask=False, mask_personal_eval=False), gossip], **kw)
    loop.fit(tiny_module(), tiny_datamodule(num_clients=5))
    return loop


@pytest.mark.parametrize("join_ratio", [1.0, 0.6])
def test_a_dispfl_run_is_the_same_bit_for_bit_by_either_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             join_ratio: float) -> None:
    taken: list[bool] = []
    real = gossip_module.group_average_stored

    def spy(*args: Any) -> Any:
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(gossip_module, "group_average_stored", spy)
    flat = _dispfl(tmp_path / "flat", Gossip(), join_ratio=join_ratio)
    calls = len(taken)
    assert taken and all(taken)  # round 0 too: the initial dense models under their masks are averaged flat
    per_tensor = _dispfl(tmp_path / "tensor", _PerTensorGossip(), join_ratio=join_ratio)
    assert len(taken) == calls  # the subclass never takes the flat path
    for k in range(5):
        a, b = flat.personal_state(k), per_tensor.personal_state(k)
        assert list(a) == list(b) and all(torch.equal(_bits(a[n]), _bits(b[n])) for n in a), k
    assert flat.accounting.comm.cum == per_tensor.accounting.comm.cum and flat.accounting.comm.cum["links"] > 0
    assert flat.accounting.comm.cum_node == per_tensor.accounting.comm.cum_node
