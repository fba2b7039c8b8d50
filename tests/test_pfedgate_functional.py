"""pFedGate's functional core against the numbers of the method notes (``../shared/methods/pfedgate.md`` §1-§3, §7)
and hand computations: block split and look-up table, gate sizes, the code's knapsack and its achieved densities,
the exact solver, the straight-through estimator (both variants) and the personalised parameters θ' = θ ⊙ expand(M').
No data needed. Expected values are derived by hand in the comments, never read back from the functions under test.
"""

from __future__ import annotations

import copy
import itertools
import math
import random

import pytest
import torch
from torch import nn

from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional.gate import (
    achieved_density,
    adapt_gated_weights,
    block_table,
    code_s_min,
    expand_block_weights,
    knapsack_exact,
    knapsack_greedy,
    make_block_table,
    personalized_params,
    select_blocks,
    sparse_gated_weights,
    split_sizes,
    straight_through,
)
from pl_fedsparse.models import CNNFEMNIST, LeNetCIFAR
from pl_fedsparse.models.gate import GatingLayer, SwitchNorm2d, adapted_forward


def _meta(factory, *args, **kw):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return factory(*args, **kw)


def lenet():  # type: ignore[no-untyped-def]
    return _meta(LeNetCIFAR)


def femnist_cnn():  # type: ignore[no-untyped-def]
    return _meta(CNNFEMNIST, num_classes=62)


def cnn_leaf():  # type: ignore[no-untyped-def]
    """The code's ``AdaptedLeafCNN3(100)`` (``--model_type cnn_leaf``): the LEAF CNN on 3×32×32 with 100 classes."""
    return _meta(CNNFEMNIST, num_classes=100, in_channels=3, input_size=32)


# ---------------------------------------------------------------------------------------------------------- models

@pytest.mark.parametrize("factory, total, layers", [
    # notes §7: conv(3→32) 2,432, conv(32→64) 51,264, fc 1600→120 192,120, fc 120→84 10,164, out 84→10 850
    (lenet, 256_830, [2_432, 51_264, 192_120, 10_164, 850]),
    # conv(1→32) 832, fc 1024→2048 2,099,200, out 2048→62 127,038
    (femnist_cnn, 2_278_334, [832, 51_264, 2_099_200, 127_038]),
    # cnn_leaf: fc 1600→2048 3,278,848, out 2048→100 204,900
    (cnn_leaf, 3_537_444, [2_432, 51_264, 3_278_848, 204_900]),
])
def test_pfedgate_model_sizes(factory, total: int, layers: list[int]) -> None:  # type: ignore[no-untyped-def]
    model = factory()
    assert sum(p.numel() for p in model.parameters()) == total
    per_layer = [sum(p.numel() for p in m.parameters()) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert per_layer == layers


# ---------------------------------------------------------------------------------------------------- block split

@pytest.mark.parametrize("n, sizes", [
    (32, [7, 7, 7, 7, 4]),          # ⌈32/5⌉ = 7, ⌈32/7⌉ = 5 blocks, last 32 − 28
    (84, [17, 17, 17, 17, 16]),
    (2400, [480] * 5),
    (10, [2] * 5),                  # the 10-element bias: blocks of 2 (notes §2)
    (16, [4, 4, 4, 4]),             # ⌈16/5⌉ = 4 → only ⌈16/4⌉ = 4 blocks
    (6, [2, 2, 2]),
    (3, [1, 1, 1]),                 # n < B: one element each
    (1, [1]),
    (2_097_152, [419_431] * 4 + [419_428]),
])
def test_equal_split_by_hand(n: int, sizes: list[int]) -> None:
    assert split_sizes(n, 5) == sizes


@pytest.mark.parametrize("n, s_min, sizes", [
    (100, 0.2, [20, 20, 20, 20, 20]),   # first ⌊0.2·100⌋ = 20, then 80 in 4
    (100, 0.1, [10, 23, 23, 23, 21]),   # 90 in 4: ⌈22.5⌉ = 23, last 90 − 69
    (7, 0.2, [1, 2, 2, 2]),             # first max(1, ⌊1.4⌋) = 1, then 6: blocks of 2
    (2, 0.2, [1, 1]),                   # ⌊0.4⌋ = 0 → at least one element
    (1, 0.2, [1]),
])
def test_paper_split_by_hand(n: int, s_min: float, sizes: list[int]) -> None:
    assert split_sizes(n, 5, split="paper", s_min=s_min) == sizes


def test_splits_cover_every_element() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n, b = rng.randint(1, 100_000), rng.randint(2, 12)
        for split, s_min in (("equal", None), ("paper", rng.uniform(0.01, 0.5))):
            sizes = split_sizes(n, b, split=split, s_min=s_min)  # type: ignore[arg-type]
            assert sum(sizes) == n and len(sizes) <= b and min(sizes) >= 1


@pytest.mark.parametrize("factory, blocks", [(lenet, 50), (femnist_cnn, 40), (cnn_leaf, 40)])
def test_number_of_blocks(factory, blocks: int) -> None:  # type: ignore[no-untyped-def]
    """Notes §2: L = 10 tensors × 5 = 50 for LeNet, 8 × 5 = 40 for the 2-conv/2-FC CNNs (B = 5)."""
    table = block_table(factory(), 5)
    assert table.num_blocks == blocks
    assert table.numel == sum(p.numel() for p in factory().parameters())
    assert sum(table.first) == len(table.names)


def test_lenet_lookup_table_and_groups() -> None:
    t = block_table(lenet(), 5)
    assert t.names == ("conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias", "fc1.weight", "fc1.bias",
                       "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias")
    by_name = {n: list(t.sizes[b:e]) for n, (b, e) in zip(t.names, t.spans)}
    assert by_name["conv1.weight"] == [480] * 5 and by_name["conv1.bias"] == [7, 7, 7, 7, 4]
    assert by_name["fc1.weight"] == [38_400] * 5 and by_name["fc3.bias"] == [2] * 5
    assert t.linear == (False,) * 20 + (True,) * 30  # convs: "non-linear"; the three nn.Linear: "linear"
    assert t.block_names[:2] == ("conv1.weight.sub0", "conv1.weight.sub1")
    assert t.starts[5:10] == (0, 7, 14, 21, 28)


def test_other_parameters_are_split_in_the_non_linear_group() -> None:
    t = block_table(nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(4, 2)), 5)
    assert t.names == ("0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias")
    groups = {n: {t.linear[j] for j in range(b, e)} for n, (b, e) in zip(t.names, t.spans)}
    assert groups == {"0.weight": {False}, "0.bias": {False}, "1.weight": {False}, "1.bias": {False},
                      "3.weight": {True}, "3.bias": {True}}


# --------------------------------------------------------------------------------------------------------- the gate

@pytest.mark.parametrize("channels, side, blocks, one_path, two_paths", [
    (3, 32, 50, 153_762, 307_512),   # LeNet-CIFAR (notes §1 table)
    (1, 28, 40, 31_488, 62_968),     # (F)EMNIST CNN
    (3, 32, 40, 123_012, 246_012),   # CIFAR-100 cnn_leaf
])
def test_gate_parameter_counts(channels: int, side: int, blocks: int, one_path: int, two_paths: int) -> None:
    for separate, expected in ((False, one_path), (True, two_paths)):
        gate = _meta(GatingLayer, blocks, in_channels=channels, input_size=side, separate_paths=separate)
        assert sum(p.numel() for p in gate.parameters()) == expected
    # buffers: SN running mean/var (2C) + BN running mean/var (2L per path) + BN's num_batches_tracked
    gate = _meta(GatingLayer, blocks, in_channels=channels, input_size=side, separate_paths=False)
    assert sum(b.numel() for b in gate.buffers()) == 2 * channels + 2 * blocks + 1


def test_gate_outputs_one_path_and_two_paths() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 8, 8)
    one = GatingLayer(7, in_channels=3, input_size=8, separate_paths=False)
    g, m = one(x, s_min=0.45)
    assert g.shape == m.shape == (7,) and g.dtype == m.dtype == torch.float32
    assert bool(((m > 0) & (m < 1)).all()) and bool((g >= 0.45).all())
    torch.testing.assert_close(g, m.clamp(min=0.45), rtol=0, atol=0)  # one path: G is the clipped M
    # the batch mean of sigmoid(BN(FC(SN(x)))), computed step by step here
    z = one.norm_input(x).flatten(1)  # training mode: batch statistics, as inside the call above
    fc, bn = one.gating[1], one.gating[2]
    expected = torch.sigmoid((z @ fc.weight.T + fc.bias - (z @ fc.weight.T + fc.bias).mean(0))
                             / ((z @ fc.weight.T + fc.bias).var(0, unbiased=False) + bn.eps).sqrt()).mean(0)
    torch.testing.assert_close(m, expected, rtol=1e-5, atol=1e-6)

    two = GatingLayer(7, in_channels=3, input_size=8)  # paper: two paths, B starting as a copy of A
    g2, m2 = two(x)
    torch.testing.assert_close(g2, m2)
    with torch.no_grad():
        two.w_transform[1].weight.add_(0.5)  # type: ignore[index]
    g3, m3 = two(x)
    assert not torch.allclose(g3, m3)


def test_gate_is_float32_under_autocast() -> None:
    torch.manual_seed(1)
    gate = GatingLayer(5, in_channels=1, input_size=4).eval()
    x = torch.randn(3, 1, 4, 4).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        g, m = gate(x, s_min=0.2)
    assert g.dtype == m.dtype == torch.float32
    g_ref, m_ref = gate(x.float(), s_min=0.2)
    torch.testing.assert_close((g, m), (g_ref, m_ref), rtol=0, atol=0)


def test_gate_refuses_a_single_sample_in_training_and_a_wrong_shape() -> None:
    gate = GatingLayer(5, in_channels=1, input_size=4)
    with pytest.raises(ConfigError, match=r"x.shape\[0\]=1 is invalid"):
        gate(torch.randn(1, 1, 4, 4))
    gate.eval()(torch.randn(1, 1, 4, 4))  # evaluation works on one sample
    with pytest.raises(ConfigError, match=r"x=\(2, 3, 4, 4\) is invalid"):
        gate(torch.randn(2, 3, 4, 4))


# -------------------------------------------------------------------------------------------------- SwitchNorm2d

def test_switchnorm_configuration() -> None:
    sn = SwitchNorm2d(3)
    assert sum(p.numel() for p in sn.parameters()) == 2 * 3 + 6
    assert sn.weight.shape == (1, 3, 1, 1) and bool((sn.weight == 1).all()) and bool((sn.bias == 0).all())
    assert sn.mean_weight.tolist() == [1.0, 1.0, 1.0] and sn.var_weight.tolist() == [1.0, 1.0, 1.0]
    assert sn.running_mean.abs().sum() == 0 and sn.running_var.abs().sum() == 0  # start at zeros, var too
    assert (sn.eps, sn.momentum) == (1e-5, 0.9)


def _only(sn: SwitchNorm2d, k: int) -> None:
    with torch.no_grad():
        logits = torch.full((3,), -1e4)
        logits[k] = 0.0
        sn.mean_weight.copy_(logits)
        sn.var_weight.copy_(logits)


def test_switchnorm_statistics_by_hand() -> None:
    torch.manual_seed(2)
    x = torch.randn(4, 2, 3, 5) * 3 + 1
    sn = SwitchNorm2d(2)
    _only(sn, 0)  # IN: per sample and channel, unbiased variance
    var, mean = torch.var_mean(x, dim=(2, 3), keepdim=True, unbiased=True)
    torch.testing.assert_close(sn(x), (x - mean) / (var + 1e-5).sqrt())
    # running statistics after that one training step, from zero with momentum 0.9
    mean_bn = x.mean(dim=(0, 2, 3))
    second = (var + mean ** 2).mean(dim=(0, 2, 3))  # batch mean of the unbiased per-instance second moments
    torch.testing.assert_close(sn.running_mean.flatten(), 0.1 * mean_bn)
    torch.testing.assert_close(sn.running_var.flatten(), 0.1 * (second - mean_bn ** 2))
    _only(sn, 2)  # BN in eval mode: the running statistics
    sn.eval()
    rm, rv = sn.running_mean.view(1, 2, 1, 1), sn.running_var.view(1, 2, 1, 1)
    torch.testing.assert_close(sn(x), (x - rm) / (rv + 1e-5).sqrt())
    _only(sn, 1)  # LN: per sample over C·H·W (mean exact; variance from the unbiased instance moments)
    ln_mean = x.mean(dim=(1, 2, 3), keepdim=True)
    ln_var = (var + mean ** 2).mean(dim=1, keepdim=True) - ln_mean ** 2
    torch.testing.assert_close(sn(x), (x - ln_mean) / (ln_var + 1e-5).sqrt())


# ------------------------------------------------------------------------------------------------------ knapsack

def _kept(table, keep) -> int:  # type: ignore[no-untyped-def]
    return sum(w for w, k in zip(table.sizes, keep.tolist()) if k)


def _importances(num: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = [torch.full((num,), 0.5), torch.linspace(0.2, 1.0, num), torch.linspace(1.0, 0.2, num)]
    out += [0.2 + 0.8 * torch.rand(num, generator=g) for _ in range(20)]
    return out


@pytest.mark.parametrize("density, kept", [
    # LeNet, B = 5, s_min = 0.2. First blocks: 480+7+10240+13+38400+24+2016+17+168+2 = 51,367.
    # Non-linear candidates 1920+25+40960+51 = 42,956; linear 153600+96+8064+67+672+8 = 162,507.
    # s = 0.5: caps round(0.3·42,956) = 12,887 and round(0.3·162,507) = 48,752: one 10,240 conv2.weight chunk
    #   + every small one (1,996), and one 38,400 fc1.weight chunk + every small one (8,907), in any order.
    (0.5, 51_367 + 10_240 + 1_996 + 38_400 + 8_907),
    # s = 0.3: caps 4,296 and 16,251: no conv2/fc1 chunk fits, every small one does (notes: fc1 keeps its 20 %).
    (0.3, 51_367 + 1_996 + 8_907),
])
def test_lenet_achieved_density_with_the_codes_knapsack(density: float, kept: int) -> None:
    """Notes §3.1: s' = 0.432 / 0.242 at s = 0.5 / 0.3, the paper's 0.43 / 0.25, whatever the importances are."""
    table = block_table(lenet(), 5)
    assert code_s_min(5, density) == 0.2
    for g in _importances(table.num_blocks):
        keep = select_blocks(g.clamp(min=0.2), table, density)
        assert _kept(table, keep) == kept
        assert all(keep[j] for j in range(table.num_blocks) if table.first[j])
        fc1 = table.spans[table.names.index("fc1.weight")]
        assert int(keep[fc1[0]:fc1[1]].sum()) == (2 if density == 0.5 else 1)
    assert round(kept / 256_830, 3) == {0.5: 0.432, 0.3: 0.242}[density]


@pytest.mark.parametrize("factory, at_05, at_03", [(femnist_cnn, 0.434, 0.246), (cnn_leaf, 0.436, 0.247)])
def test_other_cnns_achieved_density(factory, at_05: float, at_03: float) -> None:  # type: ignore[no-untyped-def]
    """Notes §3.1's table for the (F)EMNIST CNN and CIFAR-100 cnn_leaf."""
    table = block_table(factory(), 5)
    for g in _importances(table.num_blocks)[:8]:
        for density, expected in ((0.5, at_05), (0.3, at_03)):
            assert round(achieved_density(select_blocks(g, table, density), table), 3) == expected


def test_greedy_ranks_by_integer_importance_and_group_capacity_by_hand() -> None:
    # one linear tensor of 10 → blocks of 2; candidates 1..4 (8 elements); s = 0.6, s_min 0.2: cap round(8·0.4) = 3
    t = make_block_table([("w", (10,), True)], num_splits=5)
    g = torch.tensor([0.5, 0.66, 0.74, 0.2, 0.2])  # round(10·G) = 5, 7, 7, 2, 2: a tie, broken by index
    assert select_blocks(g, t, 0.6).tolist() == [True, True, False, False, False]
    assert select_blocks(g, t, 0.6, solver="exact", budget="group").tolist() == [True, False, True, False, False]
    # the global budget of Eq. 6: ⌊0.6·10⌋ − 2 = 4 → two candidates
    assert select_blocks(g, t, 0.6, solver="exact").tolist() == [True, True, True, False, False]
    # two groups, each with its own capacity: linear cand 8 → round(8·0.3) = 2 (one block); conv cand 4 → 1 (none)
    t2 = make_block_table([("fc", (10,), True), ("conv", (5,), False)], num_splits=5)  # conv: blocks of 1
    g2 = torch.tensor([0.9, 0.3, 0.9, 0.8, 0.3, 0.9, 0.9, 0.9, 0.9, 0.9])
    assert select_blocks(g2, t2, 0.5).tolist() == [True, False, True, False, False] + [True, True, False, False, False]


def test_greedy_and_exact_solvers_by_hand_and_against_brute_force() -> None:
    assert knapsack_greedy([9, 8, 8], [6, 5, 5], 10) == [True, False, False]  # value 9
    assert knapsack_exact([9, 8, 8], [6, 5, 5], 10) == [False, True, True]   # value 16
    assert knapsack_exact([1.0], [3], 2) == [False] and knapsack_greedy([1.0], [3], 2) == [False]
    rng = random.Random(4)
    for _ in range(150):
        n = rng.randint(1, 10)
        values = [rng.random() for _ in range(n)]
        weights = [rng.choice([1, 2, 3, 5, 8, 13]) for _ in range(n)]
        cap = rng.randint(0, sum(weights))
        best = max(sum(v for v, b in zip(values, bits) if b)
                   for bits in itertools.product([0, 1], repeat=n) if sum(w for w, b in zip(weights, bits) if b) <= cap)
        sel = knapsack_exact(values, weights, cap)
        assert sum(w for w, s in zip(weights, sel) if s) <= cap
        assert sum(v for v, s in zip(values, sel) if s) == pytest.approx(best, abs=1e-12)
        greedy = knapsack_greedy(values, weights, cap)
        assert sum(w for w, s in zip(weights, greedy) if s) <= cap
        assert sum(v for v, s in zip(values, greedy) if s) <= best + 1e-12


def test_global_budget_is_respected_and_the_exact_solver_fills_it() -> None:
    table = block_table(lenet(), 5)
    for g in _importances(table.num_blocks)[:6]:
        for density in (0.3, 0.5, 0.8):
            for solver in ("greedy", "exact"):
                keep = select_blocks(g, table, density, solver=solver, budget="global")  # type: ignore[arg-type]
                assert _kept(table, keep) <= math.floor(density * table.numel)
            exact = select_blocks(g, table, density, solver="exact")
            greedy = select_blocks(g, table, density, solver="greedy", budget="global")
            assert float(g[exact].sum()) >= float(g[greedy].sum()) - 1e-9  # Eq. 6's optimum beats the greedy's


def test_density_below_one_over_b_is_refused_with_the_equal_split() -> None:
    table = block_table(lenet(), 5)
    with pytest.raises(ConfigError, match=r"^density=0\.1 is invalid: expected a density in \[0\.2, 1\].*s < 1/B"):
        select_blocks(torch.full((50,), 0.5), table, 0.1)
    # the paper's split with s_min = 0.1 honours s = 0.1 under Eq. 6's budget
    paper = block_table(lenet(), 5, split="paper", s_min=0.1)
    assert paper.num_blocks == 49  # fc3.bias: 1, then 9 in blocks of 3 → 4 blocks
    keep = select_blocks(torch.linspace(0.1, 1, 49), paper, 0.1, solver="exact")
    assert achieved_density(keep, paper) <= 0.1
    with pytest.raises(ConfigError, match=r"^density=0\.05 is invalid"):
        select_blocks(torch.full((49,), 0.5), paper, 0.05)


@pytest.mark.parametrize("call, message", [
    (lambda: split_sizes(10, 1), r"^num_splits=1 is invalid"),
    (lambda: split_sizes(10, 5, split="blocks"), r"^split='blocks' is invalid"),  # type: ignore[arg-type]
    (lambda: split_sizes(10, 5, split="paper", s_min=0.0), r"^s_min=0\.0 is invalid"),
    (lambda: make_block_table([("w", (4,), True)], 2, s_min=0.3), r"^s_min=0\.3 is invalid: expected None"),
    (lambda: select_blocks(torch.ones(3), make_block_table([("w", (4,), True)], 2), 0.5),
     r"^importance=\(3,\) is invalid: expected a tensor of shape \(2,\)"),
    (lambda: select_blocks(torch.ones(2), make_block_table([("w", (4,), True)], 2), 1.5), r"^density=1\.5 is invalid"),
    (lambda: select_blocks(torch.ones(2), make_block_table([("w", (4,), True)], 2), 0.5, solver="dp"),
     r"^solver='dp' is invalid"),
    (lambda: straight_through(torch.ones(2, dtype=torch.bool), torch.ones(2), variant="hard"),
     r"^variant='hard' is invalid"),
    (lambda: personalized_params({}, torch.ones(2), make_block_table([("w", (4,), True)], 2)),
     r"^params=\['w'\] is invalid"),
])
def test_bad_inputs_give_one_line_errors(call, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message) as info:
        call()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------- straight-through

THETA = [0.5, -1.0, 2.0, 1.5]
X = [1.0, 2.0, -1.0, 0.5]     # L = Σ θ_k M'_k x_k, so ∂L/∂M'_k = θ_k x_k = [0.5, −2, −2, 0.75]
KEEP = [True, True, False, True]


def _tiny_loss(m_sparse: torch.Tensor) -> tuple[torch.Tensor, nn.Linear]:
    """The tiny model: Linear(4 → 1, no bias), B = 4 → four one-element blocks; loss = its output."""
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([THETA]))
    table = make_block_table([("weight", (1, 4), True)], num_splits=4)
    theta_prime = personalized_params(dict(lin.named_parameters()), m_sparse, table)
    return adapted_forward(lin, theta_prime, torch.tensor([X])).sum(), lin


@pytest.mark.parametrize("variant, grad_g", [
    ("paper", [0.4, -1.2, -0.8, 0.675]),   # M_k θ_k x_k for every block, the dropped one too
    ("code", [0.4, -1.2, 0.0, 0.675]),     # the dropped block passes nothing to G
])
def test_straight_through_gradients_by_hand(variant: str, grad_g: list[float]) -> None:
    g = torch.tensor([0.7, 0.3, 0.5, 0.2], requires_grad=True)
    m = torch.tensor([0.8, 0.6, 0.4, 0.9], requires_grad=True)
    m_sparse = sparse_gated_weights(m, g, torch.tensor(KEEP), variant=variant)  # type: ignore[arg-type]
    torch.testing.assert_close(m_sparse.detach(), torch.tensor([0.8, 0.6, 0.0, 0.9]))
    loss, lin = _tiny_loss(m_sparse)
    assert loss.item() == pytest.approx(0.5 * 0.8 * 1 - 1 * 0.6 * 2 + 1.5 * 0.9 * 0.5)  # −0.125
    loss.backward()
    torch.testing.assert_close(g.grad, torch.tensor(grad_g))
    torch.testing.assert_close(m.grad, torch.tensor([0.5, -2.0, 0.0, 0.75]))          # I_k θ_k x_k
    torch.testing.assert_close(lin.weight.grad, torch.tensor([[0.8, 1.2, 0.0, 0.45]]))  # I_k M_k x_k: exactly 0
    assert lin.weight.grad[0, 2].item() == 0.0


@pytest.mark.parametrize("variant, grad_p", [
    # one shared path: G = clip(p, 0.2), M = p. ∂L/∂p = M_k θ_k x_k · 1[p_k ≥ 0.2] (via G) + I_k θ_k x_k (via M)
    ("paper", [0.7 * 0.5 + 0.5, 0.3 * -2 - 2, 0.5 * -2 + 0, 0 + 0.75]),
    ("code", [0.7 * 0.5 + 0.5, 0.3 * -2 - 2, 0.0, 0 + 0.75]),
])
def test_straight_through_with_one_shared_path_and_the_clip(variant: str, grad_p: list[float]) -> None:
    p = torch.tensor([0.7, 0.3, 0.5, 0.1], requires_grad=True)
    m_sparse = sparse_gated_weights(p, p.clamp(min=0.2), torch.tensor(KEEP), variant=variant)  # type: ignore[arg-type]
    _tiny_loss(m_sparse)[0].backward()
    torch.testing.assert_close(p.grad, torch.tensor(grad_p))


def test_dense_budget_code_variant_passes_no_gradient_to_g() -> None:
    g = torch.tensor([0.7, 0.3, 0.5, 0.2], requires_grad=True)
    m = torch.tensor([0.8, 0.6, 0.4, 0.9], requires_grad=True)
    table = make_block_table([("weight", (1, 4), True)], num_splits=4)
    out, keep = adapt_gated_weights(g, m, table, 1.0, variant="code")
    assert keep.all() and out is m  # the code's s = 1 case: M' = M
    loss = _tiny_loss(out)[0]
    assert torch.autograd.grad(loss, [g], allow_unused=True)[0] is None
    out_paper, _ = adapt_gated_weights(g, m, table, 1.0)  # paper: I* = 1 with its straight-through term
    (grad,) = torch.autograd.grad(_tiny_loss(out_paper)[0], [g])
    torch.testing.assert_close(grad, torch.tensor([0.4, -1.2, -0.8, 0.675]))


# ---------------------------------------------------------------------------------------- θ' = θ ⊙ expand(M')

def test_expand_paper_split_blocks() -> None:
    t = make_block_table([("w", (10,), False)], num_splits=5, split="paper", s_min=0.3)  # sizes 3, 2, 2, 2, 1
    assert expand_block_weights(torch.tensor([1.0, 2, 3, 4, 5]), t, 0).tolist() == [1, 1, 1, 2, 2, 3, 3, 4, 4, 5]


def test_expand_matches_an_element_loop() -> None:
    rng = random.Random(7)
    for _ in range(60):
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        b = rng.randint(2, 7)
        split, s_min = rng.choice([("equal", None), ("paper", rng.uniform(0.05, 0.6))])
        t = make_block_table([("a", (3,), False), ("w", shape, True)], b, split=split, s_min=s_min)  # type: ignore[arg-type]
        values = torch.rand(t.num_blocks)
        expected = []
        for j in range(*t.spans[1]):
            expected += [float(values[j])] * split_sizes(math.prod(shape), b, split=split, s_min=s_min)[j - t.spans[1][0]]  # type: ignore[arg-type]
        assert expand_block_weights(values, t, 1).flatten().tolist() == expected


def test_dense_budget_keeps_every_block_and_scales_lenet_by_m() -> None:
    torch.manual_seed(5)
    model = LeNetCIFAR()
    table = block_table(model, 5)
    gate = GatingLayer(table.num_blocks, in_channels=3, input_size=32, separate_paths=False)
    x = torch.randn(4, 3, 32, 32)
    g, m = gate(x, s_min=code_s_min(5, 1.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for variant in ("paper", "code"):
        m_sparse, keep = adapt_gated_weights(g, m, table, 1.0, variant=variant)  # type: ignore[arg-type]
        assert bool(keep.all()) and achieved_density(keep, table) == 1.0
        theta = personalized_params(dict(model.named_parameters()), m_sparse, table)
        j = 0
        for name, p in model.named_parameters():
            for chunk, scaled in zip(torch.split(p.detach().flatten(), split_sizes(p.numel(), 5)),
                                     torch.split(theta[name].detach().flatten(), split_sizes(p.numel(), 5))):
                torch.testing.assert_close(scaled, m[j].detach() * chunk)  # θ' = M-scaled θ, block by block
                j += 1
        assert j == 50
        # the functional forward equals a copy of the model holding θ', and the global weights are untouched
        copy_model = copy.deepcopy(model)
        copy_model.load_state_dict({n: t.detach() for n, t in theta.items()})
        torch.testing.assert_close(adapted_forward(model, theta, x), copy_model(x))
        for n, p in model.named_parameters():
            assert torch.equal(p, before[n])


def test_one_backward_reaches_theta_and_the_gate_and_dropped_blocks_get_zero_gradient() -> None:
    torch.manual_seed(6)
    model = LeNetCIFAR()
    table = block_table(model, 5)
    gate = GatingLayer(table.num_blocks, in_channels=3, input_size=32)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    g, m = gate(x, s_min=0.2)
    m_sparse, keep = adapt_gated_weights(g, m, table, 0.3)
    logits = adapted_forward(model, personalized_params(dict(model.named_parameters()), m_sparse, table), x)
    nn.functional.cross_entropy(logits, y).backward()
    assert all(p.grad is not None for p in gate.parameters())
    w = model.fc1.weight.grad.flatten()
    b, _ = table.spans[table.names.index("fc1.weight")]
    assert keep[b:b + 5].tolist() == [True, False, False, False, False]  # at s = 0.3 fc1 keeps its first 20 %
    assert w[:38_400].abs().sum() > 0 and w[38_400:].abs().sum() == 0


# ------------------------------------------------------------------------------------------ the greedy on the device
def test_the_device_knapsack_takes_what_the_scan_takes() -> None:
    """:func:`knapsack_greedy_tensor` (no host sync) against the code's scan, on random instances with many ties
    and repeated weights."""
    from pl_fedsparse.functional.gate import knapsack_greedy, knapsack_greedy_tensor

    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(0, 30)
        weights = [rng.choice([1, 2, 3, 5, 8, 40]) for _ in range(n)]
        values = [float(rng.randint(0, 10)) for _ in range(n)]
        capacity = rng.randint(0, 100)
        got = knapsack_greedy_tensor(torch.tensor(values, dtype=torch.float64), torch.tensor(weights, dtype=torch.int64),
                                     capacity, len(set(weights)))
        assert got.tolist() == knapsack_greedy(values, weights, capacity), (values, weights, capacity)


def test_the_device_knapsack_takes_what_the_scan_takes_over_many_rounds() -> None:
    """As above with up to 14 distinct non-zero weights and items of weight 0 over up to 80 items (one round per
    distinct weight and a last one for what weighs nothing after the lightest item failed: every round, and the
    threshold falling through many weights, exercised), capacities from none to all of it."""
    from pl_fedsparse.functional.gate import knapsack_greedy, knapsack_greedy_tensor

    rng = random.Random(2)
    choices = [0, 1, 2, 3, 4, 6, 7, 9, 11, 13, 17, 24, 31, 50, 90]
    for _ in range(600):
        n = rng.randint(1, 80)
        weights = [rng.choice(choices) for _ in range(n)]
        values = [float(rng.randint(0, 20)) for _ in range(n)]
        capacity = rng.randint(0, sum(weights))
        got = knapsack_greedy_tensor(torch.tensor(values), torch.tensor(weights), capacity,
                                     len(set(weights) - {0}))
        assert got.tolist() == knapsack_greedy(values, weights, capacity), (values, weights, capacity)


@pytest.mark.parametrize("factory", [lambda: LeNetCIFAR(), lambda: CNNFEMNIST()], ids=["lenet", "cnn-femnist"])
@pytest.mark.parametrize("budget", ["group", "global"])
def test_select_blocks_on_the_device_path_equals_the_host_path(factory: object, budget: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from pl_fedsparse.functional import gate

    table = block_table(factory(), 5)  # type: ignore[operator]
    g = torch.Generator().manual_seed(0)
    for density in (0.3, 0.5, 0.8, 0.95):
        for _ in range(5):
            importance = torch.rand(table.num_blocks, generator=g)
            host = select_blocks(importance, table, density, budget=budget)
            monkeypatch.setattr(gate, "HOST_KNAPSACK_ON_CPU", False)
            device = select_blocks(importance, table, density, budget=budget)
            monkeypatch.setattr(gate, "HOST_KNAPSACK_ON_CPU", True)
            assert torch.equal(host, device), (density, budget)


def test_the_row_knapsacks_take_what_each_rows_scan_takes() -> None:
    """:func:`knapsack_greedy_rows` (every group's knapsack at once) against the code's scan row by row, with rows
    padded by weight-0 items, many ties and repeated weights, one capacity per row."""
    from pl_fedsparse.functional.gate import knapsack_greedy, knapsack_greedy_rows

    rng = random.Random(1)
    for _ in range(1500):
        rows, n = rng.randint(1, 4), rng.randint(0, 20)
        lengths = [rng.randint(0, n) for _ in range(rows)]
        weights = [[rng.choice([1, 2, 3, 5, 8, 40]) for _ in range(k)] + [0] * (n - k) for k in lengths]
        values = [[float(rng.randint(0, 10)) for _ in range(n)] for _ in range(rows)]
        caps = [rng.randint(0, 100) for _ in range(rows)]
        distinct = max([len(set(w[:k])) for w, k in zip(weights, lengths)] + [0])
        got = knapsack_greedy_rows(torch.tensor(values, dtype=torch.float64).view(rows, n),
                                   torch.tensor(weights, dtype=torch.int64).view(rows, n),
                                   torch.tensor(caps), distinct)
        for r in range(rows):
            k = lengths[r]
            want = knapsack_greedy(values[r][:k], weights[r][:k], caps[r])
            assert got[r, :k].tolist() == want, (values[r], weights[r], caps[r])


def _operators(fn) -> int:
    """The operators ``fn()`` dispatches that launch a kernel on a GPU (views and allocations left out)."""
    from conftest import count_operators

    return count_operators(fn)


def test_the_groups_knapsacks_issue_the_operators_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-group budget's two knapsacks (linear and convolution blocks) run as rows of one
    (:func:`knapsack_greedy_rows`): on a GPU a step of small kernels costs its launches, and one knapsack round is
    about a dozen. Two groups cost what the larger one alone costs, plus the padding and the write-back (3)."""
    from pl_fedsparse.functional import gate

    monkeypatch.setattr(gate, "HOST_KNAPSACK_ON_CPU", False)
    table = block_table(LeNetCIFAR(), 5)
    importance = torch.rand(table.num_blocks, generator=torch.Generator().manual_seed(0))
    select_blocks(importance, table, 0.5, budget="group")  # (the cached tables made outside the count)
    both = _operators(lambda: select_blocks(importance, table, 0.5, budget="group"))
    groups = gate._knapsack_groups(table, "group")
    assert len(groups) == 2 and all(groups)
    items = max(groups, key=len)
    distinct = max(len({table.sizes[j] for j in g}) for g in groups)
    values = torch.round(importance.double()[items] * gate.IMPORTANCE_LEVELS)
    sizes = torch.tensor([table.sizes[j] for j in items])
    one = _operators(lambda: gate.knapsack_greedy_tensor(values, sizes, 10, distinct))
    assert both <= one + 3 + 3, (both, one)  # (+3: the importance's double, round and scale before the knapsack)


@pytest.mark.parametrize("split", ["equal", "paper"])
@pytest.mark.parametrize("factory", [lambda: LeNetCIFAR(), lambda: CNNFEMNIST()], ids=["lenet", "cnn-femnist"])
def test_personalized_params_from_one_split_equal_each_parameters_expansion(factory: object, split: str) -> None:
    """``θ' = θ ⊙ expand(M')`` made from one split of ``M'`` (its backward one concatenation) gives every value and
    every gradient, of ``θ`` and of ``M'``, bit for bit as expanding each parameter from its own slices of ``M'``."""
    from pl_fedsparse.functional.gate import expand_block_weights, personalized_params

    model = factory()  # type: ignore[operator]
    table = block_table(model, 5, split=split)
    g = torch.Generator().manual_seed(3)
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    m = torch.rand(table.num_blocks, generator=g).requires_grad_(True)
    weights = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}
    new = personalized_params(params, m, table)
    old = {n: params[n] * expand_block_weights(m, table, i) for i, n in enumerate(table.names)}
    assert all(torch.equal(new[n], old[n]) for n in table.names)
    grads_new = torch.autograd.grad(sum((new[n] * weights[n]).sum() for n in table.names), [m, *params.values()])
    grads_old = torch.autograd.grad(sum((old[n] * weights[n]).sum() for n in table.names), [m, *params.values()])
    assert all(torch.equal(a, b) for a, b in zip(grads_new, grads_old))


def test_a_knapsack_round_dispatches_8_operators() -> None:
    """A round of the device knapsack (one more distinct weight, one more round)
    costs 8 operators (22 at first, then 14): the room used read from one cumulative sum over what is taken and what
    is a candidate, and, as that sum never decreases, the first failure as the length of the prefix that fits (a
    sum, no index search), the items taken as the candidates inside that prefix, the next candidates as the items
    lighter than the failure. Fails when an operator is added back to the round."""
    from pl_fedsparse.functional.gate import knapsack_greedy_rows

    values = torch.rand(2, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = torch.randint(1, 9, (2, 40), generator=torch.Generator().manual_seed(1))
    capacity = torch.tensor([60, 90])
    rounds = [_operators(lambda d=d: knapsack_greedy_rows(values, weights, capacity, d)) for d in (2, 3, 4)]
    assert rounds[1] - rounds[0] == rounds[2] - rounds[1] == 8, rounds
