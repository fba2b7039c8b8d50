"""Pure mask maths: ERK densities against the DisPFL reference numbers, exact mask counts, prune-and-regrow,
the cosine prune rate and bit packing."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional import (
    cosine_prune_rate,
    drop_and_grow,
    drop_and_grow_many,
    erk_densities,
    layer_densities,
    mask_density,
    masks_from_densities,
    pack_mask,
    pack_masks,
    prune_regrow_count,
    sorted_top_k,
    stable_top_k,
    unpack_mask,
    unpack_masks,
)
from pl_fedsparse.models import VGG11GN, ResNet18GN


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def resnet_shapes() -> dict[str, tuple[int, ...]]:
    return _shapes(ResNet18GN())


def _global(shapes: dict[str, tuple[int, ...]], dens: dict[str, float]) -> float:
    return sum(dens[k] * math.prod(s) for k, s in shapes.items()) / sum(math.prod(s) for s in shapes.values())


# --- ERK (notes §1: values computed with DisPFL's own calculate_sparsities) ---------------------------------------

def test_erk_resnet18_at_half(resnet_shapes):
    dens = erk_densities(resnet_shapes, 0.5)
    expected = {"layer3.0.conv2.weight": 0.720, "layer3.1.conv1.weight": 0.720, "layer3.1.conv2.weight": 0.720,
                "layer4.0.conv1.weight": 0.538, "layer4.0.conv2.weight": 0.358, "layer4.1.conv1.weight": 0.358,
                "layer4.1.conv2.weight": 0.358}
    assert len(resnet_shapes) == 62
    assert {k for k, d in dens.items() if d < 1} == set(expected)
    for k, d in expected.items():
        assert dens[k] == pytest.approx(d, abs=5e-4), k
    assert all(d == 1.0 for k, d in dens.items() if k not in expected)
    assert _global(resnet_shapes, dens) == pytest.approx(0.5, abs=1e-4)
    assert layer_densities(resnet_shapes, 0.5, "erk") == dens  # dense_1d changes nothing on a real network


def test_erk_resnet18_at_0_2(resnet_shapes):
    dens = erk_densities(resnet_shapes, 0.2)
    for k, d in {"layer2.0.conv1.weight": 0.751, "layer3.0.conv1.weight": 0.370, "layer4.0.conv1.weight": 0.183,
                 "layer4.1.conv2.weight": 0.122}.items():
        assert dens[k] == pytest.approx(d, abs=1e-3), k
    assert _global(resnet_shapes, dens) == pytest.approx(0.2, abs=1e-4)


def test_erk_vgg11_at_half():
    # VGG11GN's `features` indices equal DisPFL's vgg.py ones (conv, GN, ReLU, [pool] per block), so the notes'
    # names apply as they are: features.11 is the 4th conv, .15 the 5th, .18/.22/.25 the 6th-8th.
    shapes = _shapes(VGG11GN())
    dens = erk_densities(shapes, 0.5)
    expected = {"features.11.weight": 0.848, "features.15.weight": 0.634, "features.18.weight": 0.422,
                "features.22.weight": 0.422, "features.25.weight": 0.422}
    assert {k for k, d in dens.items() if d < 1} == set(expected)
    for k, d in expected.items():
        assert dens[k] == pytest.approx(d, abs=5e-4), k
    assert _global(shapes, dens) == pytest.approx(0.5, abs=1e-4)


def test_erk_edge_cases():
    shapes = {"w": (8, 8), "b": (8,)}
    assert erk_densities(shapes, 1.0) == {"w": 1.0, "b": 1.0}
    assert erk_densities(shapes, 0.5, erk_power_scale=0) == {"w": 0.5, "b": 0.5}  # p = 0 is uniform
    # a group of equal raws becomes dense together
    d = erk_densities({"a": (2, 2), "b": (2, 2), "c": (64, 64)}, 0.5)
    assert d["a"] == d["b"] == 1.0 and d["c"] < 1
    with pytest.raises(ConfigError, match="density"):
        erk_densities(shapes, 0.0)
    with pytest.raises(ConfigError, match="erk_power_scale"):
        erk_densities(shapes, 0.5, erk_power_scale=-1)
    with pytest.raises(ConfigError, match="distribution"):
        layer_densities(shapes, 0.5, "snip")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="density"):  # the forced-dense bias alone holds more than 10 %
        layer_densities({"w": (2, 2), "b": (100,)}, 0.1, "erk")


# --- masks from densities --------------------------------------------------------------------------------------

def test_masks_from_densities_exact_and_reproducible():
    shapes = {"conv": (16, 8, 3, 3), "fc": (10, 33), "b": (10,)}
    dens = erk_densities(shapes, 0.3)
    m1 = masks_from_densities(shapes, dens, torch.Generator().manual_seed(1))
    m2 = masks_from_densities(shapes, dens, torch.Generator().manual_seed(1))
    m3 = masks_from_densities(shapes, dens, torch.Generator().manual_seed(2))
    assert set(m1) == set(shapes)
    for k, s in shapes.items():
        assert m1[k].dtype == torch.bool and tuple(m1[k].shape) == s
        assert int(m1[k].sum()) == math.floor(dens[k] * math.prod(s))
        assert torch.equal(m1[k], m2[k])
    assert not torch.equal(m1["conv"], m3["conv"])
    assert mask_density(m1) == pytest.approx(
        sum(math.floor(dens[k] * math.prod(s)) for k, s in shapes.items()) / sum(math.prod(s) for s in shapes.values()))
    with pytest.raises(ConfigError, match="densities"):
        masks_from_densities(shapes, {"conv": 0.5}, torch.Generator())


def test_masks_from_densities_match_reference_stream():
    # DisPFL's init_masks draws one randperm per tensor from the global RNG: a generator with the same seed
    # reproduces its masks.
    shapes = {"w": (6, 5), "b": (6,), "v": (4, 9)}
    dens = {"w": 0.5, "b": 1.0, "v": 0.25}
    with torch.random.fork_rng():
        torch.manual_seed(7)
        ref = {}
        for k, s in shapes.items():
            m = torch.zeros(s).view(-1)
            m[torch.randperm(m.numel())[:int(dens[k] * m.numel())]] = 1
            ref[k] = m.view(s).bool()
    ours = masks_from_densities(shapes, dens, torch.Generator().manual_seed(7))
    assert all(torch.equal(ours[k], ref[k]) for k in shapes)


# --- prune and regrow ------------------------------------------------------------------------------------------

def test_drop_and_grow_preserves_count_and_selects_extremes():
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        shape = (int(torch.randint(1, 7, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
        mask = torch.rand(shape, generator=g) < 0.5
        nnz = int(mask.sum())
        # integer-valued scores make ties frequent, exercising the tie-breaking
        drop = torch.randint(0, 4, shape, generator=g).float()
        grow = torch.randint(0, 4, shape, generator=g).float()
        for k in sorted({0, 1, nnz // 2, nnz, nnz + 3, -2}):
            new = drop_and_grow(mask, drop, grow, k)
            assert new.dtype == torch.bool and new.shape == mask.shape
            assert int(new.sum()) == nnz
            kk = max(0, min(k, nnz))
            if kk == 0:
                assert torch.equal(new, mask)
                continue
            # reconstruct the drop set: the kk active entries of smallest drop score, lowest index first on ties
            active = mask.reshape(-1).nonzero().squeeze(1).tolist()
            dropped = sorted(active, key=lambda i: (drop.reshape(-1)[i].item(), i))[:kk]
            after = mask.reshape(-1).clone()
            after[dropped] = False
            inactive = (~after).nonzero().squeeze(1).tolist()
            grown = sorted(inactive, key=lambda i: (-grow.reshape(-1)[i].item(), i))[:kk]
            expected = after.clone()
            expected[grown] = True
            assert torch.equal(new.reshape(-1), expected)
            # the dropped entries are the smallest drop scores among the active ones
            kept = [i for i in active if i not in dropped]
            if kept:
                assert max(drop.reshape(-1)[dropped]) <= min(drop.reshape(-1)[kept])


def test_drop_and_grow_regrows_just_dropped_entry():
    mask = torch.tensor([[True, True], [False, False]])
    w = torch.tensor([[0.1, 5.0], [0.0, 0.0]])
    grad = torch.tensor([[9.0, 0.0], [1.0, 2.0]])  # the dropped (0, 0) has the largest grow score
    assert torch.equal(drop_and_grow(mask, w, grad, 1), mask)
    # with k = 2 both actives drop; candidates are all four entries, the two largest grow scores win
    assert torch.equal(drop_and_grow(mask, w, grad, 2), torch.tensor([[True, False], [False, True]]))
    # a dense tensor is unchanged whatever the scores
    dense = torch.ones(2, 3, dtype=torch.bool)
    assert torch.equal(drop_and_grow(dense, torch.randn(2, 3), torch.randn(2, 3), 4), dense)


def test_drop_and_grow_bad_inputs():
    mask = torch.tensor([True, False])
    with pytest.raises(ConfigError, match="drop_score"):
        drop_and_grow(mask, torch.zeros(3), torch.zeros(2), 1)
    with pytest.raises(ConfigError, match="mask"):
        drop_and_grow(mask.float(), torch.zeros(2), torch.zeros(2), 1)


def test_prune_regrow_count():
    mask = torch.zeros(10, dtype=torch.bool)
    mask[:7] = True
    assert prune_regrow_count(mask, 0.5) == 4  # ceil(3.5)
    assert prune_regrow_count(mask, 1.0) == 7
    assert prune_regrow_count(mask, 0.0) == 0
    with pytest.raises(ConfigError, match="rate"):
        prune_regrow_count(mask, 1.5)


def test_cosine_prune_rate():
    assert cosine_prune_rate(0, 500, 0.5) == 0.5
    assert cosine_prune_rate(250, 500, 0.5) == pytest.approx(0.25)
    assert cosine_prune_rate(500, 500, 0.5) == pytest.approx(0.0, abs=1e-15)
    rates = [cosine_prune_rate(t, 10, 0.3) for t in range(11)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    for args, param in [((0, 0, 0.5), "total_rounds"), ((0, 10, 1.5), "alpha0"), ((0, 10, -0.1), "alpha0"),
                        ((-1, 10, 0.5), "round_idx"), ((11, 10, 0.5), "round_idx")]:
        with pytest.raises(ConfigError, match=param):
            cosine_prune_rate(*args)


# --- bit packing -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (1000,), (3, 5, 7), (0,)])
def test_pack_roundtrip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    mask = torch.rand(shape, generator=g) < 0.4
    packed, s = pack_mask(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(math.prod(shape) / 8)
    assert s == shape
    assert torch.equal(unpack_mask(packed, s), mask)


def test_pack_bit_order_and_dicts():
    mask = torch.zeros(10, dtype=torch.bool)
    mask[[0, 3, 9]] = True
    packed, _ = pack_mask(mask)
    assert packed.tolist() == [1 + 8, 2]  # little-endian bits: position 8j + i is bit i of byte j
    masks = {"a": torch.rand(3, 4) < 0.5, "b": torch.ones(5, dtype=torch.bool)}
    out = unpack_masks(pack_masks(masks), {k: tuple(m.shape) for k, m in masks.items()})
    assert all(torch.equal(out[k], masks[k]) for k in masks)
    with pytest.raises(ConfigError, match="packed"):
        unpack_mask(packed, (17,))


@pytest.mark.parametrize("seed", range(6))
def test_dicts_packed_in_one_go_are_each_mask_packed_alone(seed: int) -> None:
    # every length's last byte (0-7 unused bits), empty and 0-dim masks, bool and 0/1 float masks
    g = torch.Generator().manual_seed(seed)
    shapes = {"empty": (0,), "scalar": (), "one": (1,), **{f"n{i}": (i + 1,) for i in range(16)},
              "conv": (4, 3, 3, 3), "fc": (10, 7)}
    masks = {k: (torch.rand(s, generator=g) < 0.5).to(torch.float32 if seed % 2 else torch.bool)
             for k, s in shapes.items()}
    packed = pack_masks(masks)
    assert list(packed) == list(masks)
    for k, m in masks.items():
        assert torch.equal(packed[k], pack_mask(m)[0]), k
    # the host-side checks name the entry's shape, as unpacking one mask does
    out = unpack_masks(packed, shapes)
    for k, m in masks.items():
        assert out[k].dtype == torch.bool and out[k].shape == m.shape and torch.equal(out[k], m != 0), k
        assert torch.equal(out[k], unpack_mask(packed[k], shapes[k])), k
    with pytest.raises(ConfigError, match="ceil"):
        unpack_masks({**packed, "fc": packed["fc"][:-1]}, shapes)


class _Operators(TorchDispatchMode):
    """The operators dispatched inside it (views aside): ``with _Operators() as c: ...; c.n``."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if not func.is_view:
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_dict_of_masks_packs_and_unpacks_in_a_few_operators() -> None:
    def ops(count: int) -> tuple[int, int]:
        masks = {f"w{i}": torch.rand(6, 5) < 0.5 for i in range(count)}
        with _Operators() as packing:
            packed = pack_masks(masks)
        with _Operators() as unpacking:
            unpack_masks(packed, {k: (6, 5) for k in masks})
        return packing.n, unpacking.n

    few, many = ops(3), ops(30)
    assert few == many and max(many) <= 10, (few, many)


def _sort_reference(scores: torch.Tensor, k: int, largest: bool) -> torch.Tensor:
    """The selection ``stable_top_k`` replaces: the first k of a stable sort."""
    out = torch.zeros(scores.numel(), dtype=torch.bool)
    out[torch.sort(scores, descending=largest, stable=True).indices[:k]] = True
    return out


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_stable_top_k_equals_the_first_k_of_a_stable_sort(largest, dtype):
    """Ties (few distinct values), NaN, ±0.0 and ±inf, every k: the same entries as the sort."""
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        n = int(torch.randint(1, 60, (1,), generator=g))
        values = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
        pool = values if trial % 2 else values[:5]  # half the trials without NaN / inf
        scores = pool[torch.randint(0, len(pool), (n,), generator=g)].to(dtype)
        for k in range(n + 1):
            got = stable_top_k(scores, k, largest=largest)
            want = _sort_reference(scores.float() if dtype in (torch.float16, torch.bfloat16) else scores, k, largest)
            assert torch.equal(got, want), (trial, k, scores.tolist())
            assert int(got.sum()) == k


def test_stable_top_k_on_distinct_and_large_scores():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(100_000, generator=g).abs().round(decimals=2)  # many ties among 100k entries
    for k in (1, 17, 25_000, 99_999):
        for largest in (True, False):
            assert torch.equal(stable_top_k(scores, k, largest=largest), _sort_reference(scores, k, largest))


def test_stable_top_k_on_integer_scores():
    scores = torch.tensor([3, 1, 3, 0, 1, 2])
    for k in range(7):
        for largest in (True, False):
            assert torch.equal(stable_top_k(scores, k, largest=largest), _sort_reference(scores, k, largest))


def test_stable_top_k_bad_k():
    with pytest.raises(ConfigError, match="k"):
        stable_top_k(torch.zeros(3), 4, largest=True)
    with pytest.raises(ConfigError, match="k"):
        stable_top_k(torch.zeros(3), -1, largest=False)


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_the_device_path_selects_what_the_counting_path_selects(largest, dtype):
    """``sorted_top_k`` (used for scores off the CPU: no host sync) against ``stable_top_k``'s counting path (the
    CPU's), on the same ties, NaN, ±0 and ±inf cases: the same entries."""
    g = torch.Generator().manual_seed(2)
    for trial in range(30):
        n = int(torch.randint(1, 50, (1,), generator=g))
        values = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
        pool = values[:5] if (trial % 2 or dtype == torch.int64) else values
        scores = pool[torch.randint(0, len(pool), (n,), generator=g)].to(dtype)
        for k in range(n + 1):
            assert torch.equal(sorted_top_k(scores, k, largest=largest), stable_top_k(scores, k, largest=largest)), \
                (trial, k, scores.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_drop_and_grow_on_the_device_path_gives_the_same_masks(dtype, monkeypatch):
    """The device path of ``drop_and_grow`` (two stable sorts per selection, nothing read on the host) against the
    CPU's (``nonzero`` lists and linear-time counting), forced on the CPU: the same masks on ties, NaN, ±0, ±inf,
    half precision and integer scores, every ``k`` from 0 past the number of active entries, empty and dense masks."""
    from pl_fedsparse.functional import sparse

    g = torch.Generator().manual_seed(3)
    values = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
    for trial in range(40):
        n = int(torch.randint(1, 40, (1,), generator=g))
        pool = values[:5] if (trial % 2 or dtype == torch.int64) else values
        drop, grow = (pool[torch.randint(0, len(pool), (n,), generator=g)].to(dtype) for _ in range(2))
        mask = torch.rand(n, generator=g) < [0.5, 0.0, 1.0, 0.1][trial % 4]
        for k in range(int(mask.sum()) + 3):
            monkeypatch.setattr(sparse, "HOST_SELECTION_ON_CPU", True)
            want = drop_and_grow(mask, drop, grow, k)
            monkeypatch.setattr(sparse, "HOST_SELECTION_ON_CPU", False)
            got = drop_and_grow(mask, drop, grow, k)
            assert torch.equal(got, want), (trial, k, mask.tolist(), drop.tolist(), grow.tolist())
            assert int(got.sum()) == int(mask.sum())


_SCORE_VALUES = torch.tensor([0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")])
#: values apart in float64 (1 + 2⁻³⁰) or float32 (1 + 2⁻¹²) only: a joining dtype too narrow makes them ties
_CLOSE_VALUES = torch.tensor([1.0 + 2.0 ** -30, 1.0 + 2.0 ** -12, 1.0 - 2.0 ** -30], dtype=torch.float64)
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64]
_SHAPES = [(), (0,), (7,), (3, 5), (2, 3, 4), (40,)]


def _readjustment_case(g: torch.Generator) -> tuple[list, list, list, list]:
    """Masks of several shapes (0-dim and empty among them), scores of mixed dtypes in one call with ties, NaN, ±0,
    ±inf and values one dtype tells apart and a narrower one does not, counts from below 0 to past the active
    entries."""
    masks, drops, grows, ks = [], [], [], []
    for _ in range(int(torch.randint(1, 7, (1,), generator=g))):
        shape = _SHAPES[int(torch.randint(0, len(_SHAPES), (1,), generator=g))]
        masks.append(torch.rand(shape, generator=g) < [0.5, 0.0, 1.0, 0.2][int(torch.randint(0, 4, (1,), generator=g))])
        for scores in (drops, grows):
            dtype = _DTYPES[int(torch.randint(0, len(_DTYPES), (1,), generator=g))]
            pool = _SCORE_VALUES[:5] if dtype == torch.int64 else torch.cat([_SCORE_VALUES, _CLOSE_VALUES])
            scores.append(pool[torch.randint(0, len(pool), shape, generator=g)].to(dtype))
        ks.append(int(torch.randint(-1, int(masks[-1].sum()) + 3, (1,), generator=g)))
    return masks, drops, grows, ks


@pytest.mark.parametrize("seed", range(4))
def test_many_tensors_readjusted_at_once_get_each_ones_own_mask(seed: int, monkeypatch) -> None:
    """``drop_and_grow_many`` on the device path (the tensors joined, two sorts a selection) and on the host path
    against ``drop_and_grow`` of each tensor alone: the same masks, shapes and counts — with the counts given, and with
    a rate (each tensor's ``prune_regrow_count``, computed where the masks are)."""
    from pl_fedsparse.functional import sparse

    g = torch.Generator().manual_seed(seed)
    for trial in range(60):
        masks, drops, grows, ks = _readjustment_case(g)
        rate = [0.0, 1.0, 0.5, 0.1, 0.3, 1 / 3][trial % 6]
        want = [drop_and_grow(*case) for case in zip(masks, drops, grows, ks)]
        by_rate = [drop_and_grow(m, d, gr, prune_regrow_count(m, rate)) for m, d, gr in zip(masks, drops, grows)]
        for host in (True, False):
            monkeypatch.setattr(sparse, "HOST_SELECTION_ON_CPU", host)
            for expected, got in ((want, drop_and_grow_many(masks, drops, grows, ks)),
                                  (by_rate, drop_and_grow_many(masks, drops, grows, rate=rate))):
                assert len(got) == len(expected)
                for w, o, m in zip(expected, got, masks):
                    assert o.shape == m.shape and torch.equal(o, w), (seed, trial, host, ks, rate)
                    assert int(o.sum()) == int(m.sum())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_many_tensors_readjusted_at_once_on_a_gpu_get_the_cpus_masks() -> None:
    """On a GPU (CUDA's stable sorts, its float64 counts), the joined readjustment gives the masks the CPU's counting
    gives tensor by tensor."""
    _joined_on_device_equals_host(torch.device("cuda"))


def _joined_on_device_equals_host(device: torch.device) -> None:
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        masks, drops, grows, ks = _readjustment_case(g)
        rate = [0.0, 1.0, 0.5, 0.3, 0.55, 1 / 3][trial % 6]
        want = [drop_and_grow(*case) for case in zip(masks, drops, grows, ks)]
        by_rate = [drop_and_grow(m, d, gr, prune_regrow_count(m, rate)) for m, d, gr in zip(masks, drops, grows)]
        there = [[t.to(device) for t in ts] for ts in (masks, drops, grows)]
        for expected, got in ((want, drop_and_grow_many(*there, ks)), (by_rate, drop_and_grow_many(*there, rate=rate))):
            for w, o in zip(expected, got):
                assert o.device.type == device.type and torch.equal(o.cpu(), w), (trial, ks, rate)


def test_counts_from_a_rate_on_the_device_path_are_pythons() -> None:
    """``ceil(rate · nnz)`` in float64 on the masks' device equals Python's ``math.ceil`` for rates whose product
    with a count lands next to an integer."""
    from pl_fedsparse.functional import sparse

    saved, sparse.HOST_SELECTION_ON_CPU = sparse.HOST_SELECTION_ON_CPU, False
    try:
        for nnz in (1, 3, 7, 10, 25, 49, 50, 100, 1000, 4097):  # (0.3 · 50, 0.6 · 25 and 0.55 · 100 in float32: 16,
            # 16 and 55 where Python says 15, 15 and 56)
            mask = torch.zeros(2 * nnz + 5, dtype=torch.bool)
            mask[:nnz] = True
            drop = grow = torch.arange(2 * nnz + 5, dtype=torch.float32)  # the first k go, the last k come
            for rate in (0.1, 0.3, 0.7, 1 / 3, 0.29, 0.57, 0.15, 0.6, 0.55):
                (new,) = drop_and_grow_many([mask], [drop], [grow], rate=rate)
                k = math.ceil(rate * nnz)
                assert int((new & ~mask).sum()) == k and torch.equal(new, drop_and_grow(mask, drop, grow, k)), (nnz, rate)
    finally:
        sparse.HOST_SELECTION_ON_CPU = saved


def test_many_tensors_readjusted_at_once_in_a_few_operators(monkeypatch) -> None:
    """On the device path a readjustment's operators do not grow with its number of tensors (about 25 a tensor,
    one by one)."""
    from pl_fedsparse.functional import sparse

    monkeypatch.setattr(sparse, "HOST_SELECTION_ON_CPU", False)

    def ops(count: int) -> int:
        g = torch.Generator().manual_seed(count)
        masks = [torch.rand(6, 5, generator=g) < 0.5 for _ in range(count)]
        scores = [torch.rand(6, 5, generator=g) for _ in range(2 * count)]
        drop_and_grow_many(masks, scores[:count], scores[count:], rate=0.3)  # (the layout made once)
        with _Operators() as counted:
            drop_and_grow_many(masks, scores[:count], scores[count:], rate=0.3)
        return counted.n

    few, many = ops(2), ops(20)
    assert few == many and many <= 40, (few, many)


def test_drop_and_grow_many_bad_inputs() -> None:
    mask = torch.tensor([True, False])
    with pytest.raises(ConfigError, match="drop_and_grow_many"):
        drop_and_grow_many([mask], [torch.zeros(2)], [], [1])
    with pytest.raises(ConfigError, match="drop_and_grow_many.*not both"):
        drop_and_grow_many([mask], [torch.zeros(2)], [torch.zeros(2)], [1], rate=0.5)
    with pytest.raises(ConfigError, match="drop_and_grow_many.*not both"):
        drop_and_grow_many([mask], [torch.zeros(2)], [torch.zeros(2)])
    with pytest.raises(ConfigError, match="rate"):
        drop_and_grow_many([mask], [torch.zeros(2)], [torch.zeros(2)], rate=1.5)
    with pytest.raises(ConfigError, match=r"masks\[1\]"):
        drop_and_grow_many([mask, mask.float()], [torch.zeros(2)] * 2, [torch.zeros(2)] * 2, [1, 1])
    with pytest.raises(ConfigError, match=r"ks\[0\]"):
        drop_and_grow_many([mask], [torch.zeros(2)], [torch.zeros(2)], [1.5])
    for host in (True, False):
        from pl_fedsparse.functional import sparse

        saved, sparse.HOST_SELECTION_ON_CPU = sparse.HOST_SELECTION_ON_CPU, host
        try:
            with pytest.raises(ConfigError, match=r"grow_score"):
                drop_and_grow_many([mask], [torch.zeros(2)], [torch.zeros(3)], [1])
        finally:
            sparse.HOST_SELECTION_ON_CPU = saved
    assert drop_and_grow_many([], [], [], []) == [] == drop_and_grow_many([], [], [], rate=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_prune_regrow_runs_on_the_weights_device_without_a_host_copy_of_the_scores():
    from pl_fedsparse.callbacks.prune_regrow import prune_regrow

    g = torch.Generator().manual_seed(0)
    masks = {"w": torch.rand(64, 64, generator=g) < 0.5}
    drop, grow = torch.rand(64, 64, generator=g), torch.rand(64, 64, generator=g)
    on_cpu = prune_regrow(masks, {"w": drop}, {"w": grow}, 0.3)
    on_gpu = prune_regrow(masks, {"w": drop.cuda()}, {"w": grow.cuda()}, 0.3)
    assert on_gpu["w"].device.type == "cuda"
    assert torch.equal(on_gpu["w"].cpu(), on_cpu["w"])


@pytest.mark.parametrize("shape", [(7,), (5, 3), (4, 3, 3, 3), (1,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_expand_values_is_boolean_index_assignment(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """``expand_values`` (masked_scatter_) puts the values where ``dense[mask] = values`` puts them, bit for bit:
    row-major order, zeros elsewhere, -0.0 and NaN kept, the values' dtype."""
    from pl_fedsparse.functional.sparse import expand_values

    g = torch.Generator().manual_seed(len(shape))
    for density in (0.0, 0.3, 1.0):
        mask = torch.rand(shape, generator=g) < density
        values = torch.randn(int(mask.sum()), generator=g).to(dtype)
        if values.numel() > 1:
            values[0], values[-1] = -0.0, float("nan")
        want = torch.zeros(shape, dtype=dtype)
        want[mask] = values
        got = expand_values(values, mask.to(torch.uint8))  # (a 0/1 mask is read as bool)
        assert got.dtype == dtype and got.shape == mask.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # the same bytes (-0.0, NaN)


def test_expand_values_refuses_a_count_that_is_not_the_masks() -> None:
    from pl_fedsparse.errors import ConfigError
    from pl_fedsparse.functional.sparse import expand_values

    mask = torch.tensor([True, False, True, True])
    for values in (torch.ones(2), torch.ones(4), torch.ones(3, 1)):
        with pytest.raises(ConfigError, match=r"^values=.* is invalid: expected a 1-D tensor of 3 values"):
            expand_values(values, mask)


def test_unpack_blocks_names_the_parameter_of_a_wrong_count() -> None:
    from pl_fedsparse.functional.gate import make_block_table
    from pl_fedsparse.functional.gate_upload import unpack_blocks

    t = make_block_table([("w", (2, 3), True)], num_splits=3)
    with pytest.raises(ConfigError, match=r"^values\['w'\]=\(3,\) is invalid: expected a 1-D tensor of 4 values"):
        unpack_blocks({"w": torch.ones(3)}, torch.tensor([True, False, True]), t)


def test_apply_masks_joined_is_each_product_alone() -> None:
    """The masks joined and converted once, one multi-tensor product: the same values (signs of zeros, NaN and
    infinities kept) as ``v * mask.to(v.dtype)`` tensor by tensor, for every floating dtype; unmasked tensors handed
    back as they are; mixed dtypes, a tensor that needs its gradient and a mask of another shape one by one."""
    from pl_fedsparse.functional import apply_masks

    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        special = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), float("-inf"), -1.5])
        tensors = {"a": torch.randn(3, 4, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype),
                   "c": special.to(dtype), "d": torch.randn(2, 2, 2, generator=g).to(dtype)}
        masks = {"a": torch.rand(3, 4, generator=g) < 0.5, "c": torch.tensor([True, True, False, False, True, False]),
                 "d": torch.rand(2, 2, 2, generator=g) < 0.5}
        variants = [(tensors, masks), ({**tensors, "d": tensors["d"].double()}, masks),
                    ({**tensors, "a": tensors["a"].clone().requires_grad_()}, masks)]
        for ts, ms in variants:
            got = apply_masks(ts, ms)
            assert got["b"] is ts["b"] and list(got) == list(ts)
            for k in ms:
                want = ts[k] * ms[k].to(ts[k].dtype)
                assert got[k].dtype == want.dtype and got[k].shape == want.shape
                assert torch.equal(torch.isnan(got[k]), torch.isnan(want))
                assert torch.equal(torch.nan_to_num(got[k].detach(), nan=0.0), torch.nan_to_num(want.detach(), nan=0.0))
                assert torch.equal(torch.signbit(got[k]), torch.signbit(want)), (dtype, k)
    a = torch.ones(2, 3, requires_grad=True)
    apply_masks({"a": a, "b": torch.ones(2)}, {"a": torch.tensor([True, False, True]), "b": torch.tensor([True, False])})[
        "a"].sum().backward()  # (a mask broadcast over rows and a tensor that needs its gradient: one by one)
    assert a.grad is not None and a.grad.tolist() == [[1.0, 0.0, 1.0]] * 2


def test_apply_masks_costs_the_same_operators_for_any_number_of_tensors() -> None:
    from pl_fedsparse.functional import apply_masks

    def ops(count: int) -> int:
        tensors = {f"w{i}": torch.randn(4, 3) for i in range(count)}
        masks = {k: torch.rand(4, 3) < 0.5 for k in tensors}
        with _Operators() as counted:
            apply_masks(tensors, masks)
        return counted.n

    assert ops(3) == ops(30) <= 4
