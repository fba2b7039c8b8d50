"""pFedGate's ``compute: sliced`` (:mod:`pl_fedsparse.functional.gate_sliced`): the sparse personalised model run on
the kept output rows only must give the logits and the gradients (to θ and to the gate) of the masked forward
(:func:`pl_fedsparse.models.gate.adapted_forward`), to float tolerance.

The reference is always the masked forward on the same ``θ' = θ ⊙ expand(M')``; the rows a keep pattern activates are
derived by hand from the block sizes in the comments. The tests that could pass by accident are paired with one
showing they can fail (the paper estimator without the dropped rows' weight gradient gives a different gate
gradient).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_datamodule, tiny_loop, tiny_module
from torch import Tensor, nn

from pl_fedsparse.callbacks import PFedGate
from pl_fedsparse.errors import ConfigError
from pl_fedsparse.functional.gate import (
    adapt_gated_weights,
    block_table,
    code_s_min,
    make_block_table,
    personalized_params,
)
from pl_fedsparse.functional.gate_sliced import active_rows, sliceable_layers, sliced_forward
from pl_fedsparse.models import LeNetCIFAR
from pl_fedsparse.models.gate import GatingLayer, adapted_forward


def _close(got: dict[str, Tensor], ref: dict[str, Tensor], rtol: float = 1e-4) -> None:
    """Every tensor of ``got`` equals ``ref`` up to ``rtol`` of the largest reference entry (gradients of different
    tensors differ by orders of magnitude, and some are numerically zero, e.g. a bias before BatchNorm)."""
    scale = max(float(t.abs().max()) for t in ref.values())
    assert scale > 0
    for name, expected in ref.items():
        torch.testing.assert_close(got[name], expected, rtol=rtol, atol=rtol * scale, msg=name)


def _grads(module: nn.Module) -> dict[str, Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in module.named_parameters()}


def _lenet_step(model: nn.Module, gate: GatingLayer, x: Tensor, y: Tensor, density: float, variant: str,
                compute: str, dropped_grad: bool | None = None, solver: str = "greedy"
                ) -> tuple[Tensor, Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """One forward/backward of the callback's training step: ``(logits, keep, θ grads, gate grads)``."""
    table = block_table(model)
    model.zero_grad(set_to_none=True)
    gate.zero_grad(set_to_none=True)
    importance, weights = gate(x, s_min=code_s_min(5, density))
    m_sparse, keep = adapt_gated_weights(importance, weights, table, density, variant=variant,  # type: ignore[arg-type]
                                         solver=solver)  # type: ignore[arg-type]
    theta = personalized_params(dict(model.named_parameters()), m_sparse, table)
    if compute == "sliced":
        out = sliced_forward(model, theta, x, keep, table,
                             dropped_grad=variant == "paper" if dropped_grad is None else dropped_grad)
    else:
        out = adapted_forward(model, theta, x)
    F.cross_entropy(out, y).backward()
    return out.detach(), keep, _grads(model), _grads(gate)


def _lenet_case(seed: int, batch: int = 12) -> tuple[nn.Module, GatingLayer, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = LeNetCIFAR()
    for name, p in model.named_parameters():  # biases of both signs and some weight, so dropped rows matter
        if name.endswith("bias"):
            p.data.normal_(0.0, 0.3)
    gate = GatingLayer(block_table(model).num_blocks, in_channels=3, input_size=32)
    for p in gate.parameters():  # perturb the gate, so that its gradients are not those of the default init
        p.data.add_(torch.randn_like(p), alpha=0.5)
    for path in (gate.gating, gate.w_transform):  # spread the importances: different seeds keep different blocks
        assert path is not None
        path[2].bias.data.normal_(0.0, 2.0)
    x = torch.randn(batch, 3, 32, 32)
    y = torch.randint(0, 10, (batch,))
    return model, gate, x, y


# ------------------------------------------------------------------------------------------------ which rows

def test_active_rows_of_lenet_by_hand() -> None:
    with torch.device("meta"):
        table = block_table(LeNetCIFAR())
    names = ["conv1.weight", "conv2.weight", "fc1.weight", "fc2.weight", "fc3.weight"]
    only_first = torch.tensor(table.first)
    rows = active_rows(only_first, table, names)
    # conv1 2400 = 5 × 480, 75 per filter: block 0 = filters 0-5 and 80 % of filter 6 → 7 rows
    # conv2 51200 = 5 × 10240, 800 per filter: filters 0-11 and 640/800 of filter 12 → 13 rows
    # fc1 192000 = 5 × 38400, 1600 per row: exactly 24 rows; fc2 10080 = 5 × 2016, 120 per row: 16.8 → 17 rows;
    # fc3 840 = 5 × 168, 84 per row: 2 rows
    assert {n: int(r.sum()) for n, r in rows.items()} == {
        "conv1.weight": 7, "conv2.weight": 13, "fc1.weight": 24, "fc2.weight": 17, "fc3.weight": 2}
    assert rows["conv2.weight"][:13].all() and not rows["conv2.weight"][13:].any()
    # conv2's block 2 alone = elements [20480, 30720) = filters 25.6 … 38.4 → rows 25-38 (both ends partial)
    keep = torch.zeros(table.num_blocks, dtype=torch.bool)
    keep[table.spans[table.names.index("conv2.weight")][0] + 2] = True
    assert active_rows(keep, table, ["conv2.weight"])["conv2.weight"].nonzero().flatten().tolist() == \
        list(range(25, 39))


def test_sliceable_layers_are_plain_conv2d_and_linear() -> None:
    class MyLinear(nn.Linear):  # a subclass may override forward: masked
        pass

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(4, 4, 3, padding=1,
                          padding_mode="reflect"), nn.Flatten(), nn.Linear(4, 4), MyLinear(4, 2), nn.BatchNorm1d(2))
    assert sliceable_layers(model, block_table(model)) == {"0": "0.weight", "4": "4.weight"}


# ------------------------------------------------------------------------------ LeNet-CIFAR, the callback's step

@pytest.mark.parametrize("solver", ["greedy", "exact"])
@pytest.mark.parametrize("variant", ["paper", "code"])
@pytest.mark.parametrize("density", [1.0, 0.5, 0.3])
@pytest.mark.slow
def test_sliced_equals_masked_on_lenet_cifar(density: float, variant: str, solver: str) -> None:
    patterns = set()
    for seed in range(3):  # three gates, three different gate outputs
        ref = _lenet_step(*_lenet_case(seed), density, variant, "masked", solver=solver)
        got = _lenet_step(*_lenet_case(seed), density, variant, "sliced", solver=solver)
        assert torch.equal(got[1], ref[1])
        patterns.add(tuple(ref[1].tolist()))
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
        _close(got[2], ref[2])  # θ
        _close(got[3], ref[3])  # the gate φ (through G and M)
        rows = int(active_rows(ref[1], block_table(LeNetCIFAR()), ["conv2.weight"])["conv2.weight"].sum())
        if solver == "greedy":  # the code's group capacities: conv2 gets 2 of its 5 blocks at 0.5, block 0 at 0.3
            assert rows in {1.0: {64}, 0.5: {26, 27}, 0.3: {13}}[density]
        else:
            assert rows < 64 or density == 1.0
    # the gates chose different blocks, except where the budget fixes them: at s = 0.3 the code's greedy keeps every
    # block that fits its group's capacity, which is all of them but conv2's and fc1's weight blocks (s' = 0.242)
    assert len(patterns) > 1 or density == 1.0 or (density == 0.3 and solver == "greedy")


def test_paper_estimator_needs_the_dropped_rows_weight_gradient() -> None:
    # without it the logits and θ's gradient are unchanged (dropped rows have θ' = 0 and pass θ nothing), but the
    # gate loses θ ⊙ ∂L/∂θ' of the dropped blocks, which the paper's estimator passes on to G (App. A)
    ref = _lenet_step(*_lenet_case(0), 0.3, "paper", "masked")
    bad = _lenet_step(*_lenet_case(0), 0.3, "paper", "sliced", dropped_grad=False)
    torch.testing.assert_close(bad[0], ref[0], rtol=1e-5, atol=1e-5)
    _close(bad[2], ref[2])
    with pytest.raises(AssertionError):
        _close(bad[3], ref[3])


# ------------------------------------------------------------------- other layer shapes, hand-made keep patterns

def _odd_model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(3, 7, 3, stride=2, padding=1),            # 189 = 5 × 38 − 1: every boundary inside a filter
        nn.ReLU(),
        nn.Conv2d(7, 6, 3, padding=2, dilation=2, bias=False),
        nn.Tanh(),                                           # no ReLU: a dropped row's gradient is not dead
        nn.Conv2d(6, 6, 3, groups=2),                        # grouped: masked
        nn.Flatten(),
        nn.Linear(6 * 2 * 2, 9),
        nn.Sigmoid(),
        nn.Linear(9, 5, bias=False),
    )


@pytest.mark.parametrize("trial", range(4))
def test_sliced_equals_masked_for_any_keep_pattern(trial: int) -> None:
    model = _odd_model()
    table = block_table(model, 5)
    g = torch.Generator().manual_seed(trial)
    keep = (torch.rand(table.num_blocks, generator=g) < 0.45) | torch.tensor(table.first)
    if trial == 3:  # a whole tensor dropped: that layer runs masked
        b, e = table.spans[table.names.index("6.weight")]
        keep[b:e] = False
    x = torch.randn(4, 3, 8, 8, generator=g)
    ref_grads = []
    for compute in ("masked", "sliced"):
        model.zero_grad(set_to_none=True)
        m_prime = (keep.float() * (0.5 + torch.rand(table.num_blocks, generator=torch.Generator().manual_seed(9))))
        m_prime.requires_grad_(True)  # M', exactly 0 on dropped blocks, with a gradient everywhere
        theta = personalized_params(dict(model.named_parameters()), m_prime, table)
        out = (sliced_forward(model, theta, x, keep, table) if compute == "sliced"
               else adapted_forward(model, theta, x))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        ref_grads.append((out.detach(), _grads(model), m_prime.grad.clone()))
    (o1, g1, m1), (o2, g2, m2) = ref_grads
    torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-6)
    _close(g2, g1)
    _close({"M'": m2}, {"M'": m1})
    assert m1[~keep].abs().max() > 0  # dropped blocks do receive a gradient: the test can see it go missing


def test_linear_on_a_sequence_and_no_grad() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 4))
    table = make_block_table([("0.weight", (10, 6), True), ("0.bias", (10,), True), ("2.weight", (4, 10), True),
                              ("2.bias", (4,), True)], num_splits=5)
    keep = torch.tensor(table.first)
    theta = personalized_params(dict(model.named_parameters()), keep.float(), table)
    x = torch.randn(2, 3, 6)  # [batch, sequence, features]
    with torch.no_grad():
        torch.testing.assert_close(sliced_forward(model, theta, x, keep, table), adapted_forward(model, theta, x))
    assert "forward" not in model[0].__dict__  # the modules' own forward is back


# -------------------------------------------------------------------------------------------- the callback

def test_compute_option_is_validated_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^PFedGate\.compute='dense' is invalid: expected 'masked'") as info:
        PFedGate(compute="dense")  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_federation_with_sliced_compute_equals_masked(tmp_path: Path) -> None:
    results: dict[str, Any] = {}
    for compute in ("masked", "sliced"):
        loop = tiny_loop(tmp_path / compute, num_rounds=2,
                         callbacks=[PFedGate(density=0.3, gate_lr=1.0, compute=compute)])  # type: ignore[arg-type]
        loop.fit(tiny_module(), tiny_datamodule(num_clients=2))
        results[compute] = (dict(loop.global_state), loop.client_store.get(1, "PFedGate/gate"))
    (glob_m, gate_m), (glob_s, gate_s) = results["masked"], results["sliced"]
    for name in glob_m:
        torch.testing.assert_close(glob_s[name], glob_m[name], rtol=1e-4, atol=1e-6)
    for name in gate_m:
        torch.testing.assert_close(gate_s[name], gate_m[name], rtol=1e-4, atol=1e-6)
